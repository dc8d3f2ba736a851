"""Orchestrator: the main loop, driving the components it is handed.

What it owns: running the components, the main loop that routes finished episodes and ships
training batches, the drain, a bounded shutdown, and ``state()`` / ``restore()``; the step rows
are the ``StepLedger``'s (one per step, once trained). It builds nothing: ``build_orchestrator``
(``compose/orchestrator.py``) builds and wires the components and hands them over as
``parts.LoopComponents``, with the caller's ``parts.LoopHooks``; the caller creates the shared
``PolicyHandle``, whose version (the trainer's) fixes the first step.

Shipping batch ``step`` (1-based; after it trains, the trainer publishes version ``step``):
1. drain instead once ``step > max_steps``;
2. version hold (prime-rl): wait until ``policy.version >= step - 1 - max_staleness``; a hold
   parked longer than ``stall_timeout_s`` raises ``WatcherStallError``;
3. observed-age policy (DESIGN.md section 4): ``pace`` routes every landed episode, then waits
   while the batch, oldest heads first, could leave any rollout to a step past the bound
   (``ledger.pace_wait``: the one exact test, over what is ready, in flight and waiting);
4. take the batch from the sink; ``drop`` discards its rollouts past the bound, and a batch
   left empty is not shipped but counts towards the empty-batch guard;
5. stamp ``off_policy_steps = (step - 1) - head_version`` on live-policy rollouts;
6. persist the trained rollouts, then ship, then ``step += 1``; ``drop`` then cancels in-flight
   rollouts that can no longer make it within the bound.

Bounded: nothing moving for ``stall_timeout_s`` raises ``PipelineStallError`` (``progress``);
a SIGTERM drain past ``drain_timeout_s`` cancels what is in flight; error rollouts are
reported and recorded by the ``FaultLog``; the ``LoopWatchdog`` names code blocking the loop.

Invariants: every episode taken off ``out_q`` goes to exactly one sink (eval ones are dropped
once a drain is abandoned); a batch's rollouts are on disk before the trainer sees it; a
background component that dies is re-raised here. The trainer works in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopComponents, LoopHooks
from jaxrl_orch.orchestrator.faults import warn
from jaxrl_orch.orchestrator.ledger import StepLedger, StepRecord, drop_stale, pace_wait, stamp_ages
from jaxrl_orch.orchestrator.progress import (
    Progress,
    check_resume_state,
    maybe_await,
    next_episode,
    waiting_on,
)
from jaxrl_orch.types import (
    BatchTrainer,
    EvalBatch,
    MetricsWriter,
    PolicyHandle,
    Rollout,
    TrainBatch,
)

# How long the main loop waits for an episode before it rechecks the drain, the ledger and the
# background tasks; an episode landing or a new policy version wakes it sooner.
POLL_S = 0.5
# Each component's stop() at shutdown: everything that matters is already on disk by then.
SHUTDOWN_TIMEOUT_S = 30.0


class EmptyBatchError(RuntimeError):
    """Too many consecutive batches had nothing trainable."""


class Orchestrator:
    """Drives the components ``compose.orchestrator.build_orchestrator`` built and wired."""

    def __init__(
        self,
        config: OrchestratorConfig,
        policy: PolicyHandle,
        parts: LoopComponents,
        *,
        trainer: BatchTrainer,
        writers: Sequence[MetricsWriter] = (),
        clock: Callable[[], float] = time.monotonic,
        hooks: LoopHooks = LoopHooks(),
    ) -> None:
        self.config, self.clock, self.trainer = config, clock, trainer
        self.on_step = hooks.on_step
        # Versions count finished optimizer steps, so a run resumed before step k holds k - 1.
        self.policy = policy
        self.step = self.start_step = policy.version + 1
        self.resumed = self.start_step > 1
        self.gate, self.dispatcher, self.watcher = parts.gate, parts.dispatcher, parts.watcher
        self.train_sink, self.eval_sink = parts.train_sink, parts.eval_sink
        self.logger, self.store = parts.logger, parts.store
        self.faults, self.watchdog = parts.faults, parts.watchdog
        # Per-step and per-eval metrics go here; periodic gauge snapshots go to gauge_writers.
        self.writers = list(writers)
        self.stopped = asyncio.Event()
        self.draining = False
        self.eval_history: list[EvalBatch] = []
        self.dropped_total = self._empty_batches = 0
        self._tasks: list[asyncio.Task] = []
        self._failed: asyncio.Task | None = None
        # One row per step, written once trained (``step_metrics``) or at ship time.
        self.ledger = StepLedger(clock, self.write_metrics, hooks.step_metrics)
        self._last_shipped_step = self.start_step - 1
        self._final_eval_due = False
        self.progress = Progress(clock, config.stall_timeout_s, self._waiting_on)
        self._drain_deadline: float | None = None
        self.abandoned = False  # the drain deadline passed: in-flight work was cancelled

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> list[StepRecord]:
        await self.start()
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
        return self.history

    async def start(self) -> None:
        self.train_sink.start()
        self.eval_sink.start()
        self._tasks = [
            asyncio.create_task(self.dispatcher.start(), name="dispatcher"),
            asyncio.create_task(self.watcher.start(), name="watcher"),
            asyncio.create_task(self.logger.start(), name="logger"),
        ]
        if self.watchdog is not None:
            self._tasks.append(asyncio.create_task(self.watchdog.run(), name="watchdog"))
        for t in self._tasks:
            t.add_done_callback(self._task_finished)
        self.ledger.restart_clock()
        if self.config.eval_at_start:
            self._schedule_eval(self.step - 1)

    def request_drain(self, deadline_s: float | None = None) -> None:
        """Stop admitting train work; let in-flight work land, then stop. With ``deadline_s``
        (the SIGTERM path), work still in flight after it is cancelled (``_abandon``)."""
        if deadline_s is not None and self._drain_deadline is None:
            self._drain_deadline = self.clock() + deadline_s
        if not self.draining:
            self.draining = True
            self.dispatcher.stop_admitting_train()

    history = property(lambda self: self.ledger.history, doc="one StepRecord per shipped step")
    age_histogram = property(lambda self: self.ledger.age_histogram, doc="observed head ages")

    async def shutdown(self) -> None:
        self.ledger.flush(final=True)
        timeout = SHUTDOWN_TIMEOUT_S
        stops = (
            self.dispatcher.stop,
            self.watcher.stop,
            self.train_sink.stop,
            self.eval_sink.stop,
            self.logger.stop,  # last: its final snapshot sees the others stopped
        )
        for stop in stops:
            # Bounded: everything that matters is already on disk.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(maybe_await(stop()), timeout)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.writers:
            w.close()
        self.faults.close()

    def _check_tasks(self) -> None:
        self.dispatcher.check()
        if self._failed is not None:
            raise self._failed.exception()

    def _task_finished(self, task: asyncio.Task) -> None:
        # A done-callback, so the main loop's per-episode check is one attribute read.
        if self._failed is None and not task.cancelled() and task.exception() is not None:
            self._failed = task

    # ------------------------------------------------------------------ main loop

    async def main_loop(self) -> None:
        q = self.dispatcher.out_q
        while not self.stopped.is_set():
            self._check_tasks()
            self.progress.check(self.policy.version)
            if self._drain_deadline is not None and self.clock() > self._drain_deadline:
                await self._abandon()
            episode = (
                q.get_nowait()
                if q.qsize()
                else await next_episode(self.dispatcher.out_q, self.policy, POLL_S)
            )
            while episode is not None:
                await self._take(episode)
                # The dispatcher emits in bursts: take what is already queued in one run, up to
                # the first episode after which there is something to ship.
                episode = q.get_nowait() if q.qsize() and not self._ship_due() else None
            if self.ledger.due(self.policy.version):
                self.ledger.flush()
            if self._ship_due():
                self._check_tasks()
                await self._try_ship()
            if self.draining and self._drained():
                self.stopped.set()

    def _ship_due(self) -> bool:
        """Whether ``_try_ship`` has anything to do (it is skipped for most episodes)."""
        cfg = self.config
        if self.draining:
            return False
        return (
            self.step > cfg.max_steps
            or self.policy.version < self.step - 1 - cfg.max_staleness
            or self.train_sink.ready_count >= cfg.batch_size
        )

    async def _take(self, episode: list[Rollout]) -> None:
        self._route(episode)
        if not episode[0].is_eval:
            await self.train_sink.add(episode)
            self._check_signal()

    def _route(self, episode: list[Rollout]) -> None:
        self.progress.moved()
        landed = float(self.policy.version)
        for r in episode:
            r.metrics["orch/landed_version"] = landed
        self.faults.note(episode, self.policy.version)
        if episode[0].is_eval and not self.abandoned:
            batch = self.eval_sink.add(episode)
            if batch is not None:
                self.eval_history.append(batch)
                self.write_metrics(batch.step, batch.metrics)

    def _check_signal(self) -> None:
        """The empty-batch guard at group granularity: with dynamic sampling a batch that never
        fills (every group flat, e.g. a reward that is always 0) would otherwise spin forever.
        Counts consecutive groups that contributed nothing trainable."""
        empty = self.train_sink.consecutive_empty_groups
        limit = self.config.empty_batch_limit * (self.config.batch_size // self.config.group_size)
        if empty > limit and not self.draining:
            raise EmptyBatchError(
                f"{empty} groups in a row contributed nothing trainable (limit {limit}): every "
                "group was filtered (no reward variance, errors or filters); check the "
                "environment, the reward and the initial policy (an SFT warm-up?)"
            )

    def write_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for w in self.writers:
            w.write(step, metrics)

    def _drained(self) -> bool:
        if not self.dispatcher.idle or not self.dispatcher.out_q.empty():
            return False
        if self.eval_sink.pending() and not self.abandoned:
            return False
        # The trainer must have finished what was shipped: the final state matches the data.
        if self.policy.version < self._last_shipped_step:
            return False
        if self._final_eval_due:
            # Evaluate the final weights, not whatever version was live when the drain began.
            self._final_eval_due = False
            self._schedule_eval(self._last_shipped_step)
            return False
        return True

    async def _abandon(self) -> None:
        """The drain deadline passed: cancel what is in flight (it lands as cancelled rollouts)
        and queued evals; the drain then ends once the trainer has trained what was shipped."""
        self._drain_deadline = None
        self.abandoned = True
        self._final_eval_due = False
        n, dropped = self.dispatcher.inflight, self.dispatcher.drop_pending_evals()
        await self.dispatcher.stop()
        warn(
            f"!! drain deadline (drain_timeout_s={self.config.drain_timeout_s:g}) passed: "
            f"cancelled {n} rollouts in flight and {dropped} queued eval rollouts; stopping "
            f"after the trainer's step {self._last_shipped_step}"
        )

    def _waiting_on(self) -> str:
        awaited = sum(self.eval_sink.pending().values())
        return waiting_on(self.dispatcher.gauges(), self.gate.gauges(), self.train_sink, awaited)

    def _schedule_eval(self, step: int) -> None:
        for env, n in self.dispatcher.schedule_eval(step).items():
            self.eval_sink.expect(step, env, n)

    # ------------------------------------------------------------------ shipping

    async def _pace_blocks(self) -> bool:
        # An episode still queued is neither in flight nor in the sink: route what has landed.
        while self.dispatcher.out_q.qsize():
            await self._take(self.dispatcher.out_q.get_nowait())
        ready, waiting = self.train_sink.untrained_heads()
        unlanded = waiting + self.dispatcher.train_in_flight()
        s = self.config.max_staleness
        return pace_wait(self.step, self.policy.version, s, self.config.batch_size, ready, unlanded)

    async def _try_ship(self) -> None:
        cfg = self.config
        while not self.draining:
            if self.step > cfg.max_steps:
                self._begin_final_drain()
                return
            required = self.step - 1 - cfg.max_staleness
            if self.policy.version < required:
                # Checked before the batch is even full: a stalled trainer also closes the gate,
                # so the batch may never fill. Parks the main loop (the dispatcher keeps
                # generating into out_q); a hold that outlasts stall_timeout_s raises
                # WatcherStallError instead of halting silently.
                t0 = self.clock()
                await self.watcher.wait_for_version(required, timeout=cfg.stall_timeout_s)
                self.ledger.parked_s["hold"] += self.clock() - t0
                continue
            if self.train_sink.ready_count < cfg.batch_size:
                return
            if cfg.age_policy == "pace" and await self._pace_blocks():
                # Not blocking: stragglers must keep landing in the sink while we wait.
                self.ledger.park("pace")
                return
            self.ledger.unpark("pace")
            batch = self.train_sink.take_batch()
            if batch is None:
                return
            if cfg.age_policy == "drop":
                self.dropped_total += drop_stale(batch, self.step, self.config.max_staleness)
            if not batch.samples:
                self._empty_batches += 1
                if self._empty_batches >= cfg.empty_batch_limit:
                    raise EmptyBatchError(
                        f"{self._empty_batches} consecutive batches had nothing trainable "
                        f"(last before step {self.step}): check the environment and reward"
                    )
                continue
            self._empty_batches = 0
            await self._ship(batch)

    async def _ship(self, batch: TrainBatch) -> None:
        step = self.step
        now = self.clock()
        batch.step = step
        stamp_ages(batch.trained, step, now)
        if self.store is not None:
            await self.store.write_async(step, batch.trained)
        self.trainer.submit(batch)
        self.progress.moved()
        self._last_shipped_step = step
        self.ledger.record(
            batch,
            now,
            version=self.policy.version,
            admitted_total=self.gate.admitted_total,
            out_q_depth=self.dispatcher.out_q.qsize(),
            dropped_total=self.dropped_total,
        )
        self.step += 1
        if self.config.age_policy == "drop":
            # In flight since before this version: it would land at least one step too late.
            self.dispatcher.cancel_stale(self.step - 1 - self.config.max_staleness)
        # The last step's eval is the final one, run on the final weights after the drain.
        if (
            self.config.eval_every
            and step % self.config.eval_every == 0
            and step < self.config.max_steps
        ):
            self._schedule_eval(step)
        if self.on_step is not None:
            await maybe_await(self.on_step(step, self.state()))

    def _begin_final_drain(self) -> None:
        self.request_drain()
        self._final_eval_due = bool(self.dispatcher.eval_sources)

    # ------------------------------------------------------------------ state

    def checkpoint_state(self) -> dict[str, Any]:
        """``state()`` for a checkpoint of a version the trainer has just trained: the rows of
        trained steps are written first, so no checkpoint holds a step whose row a crash loses
        (a row written past the checkpoint is trimmed and written again on resume)."""
        self.ledger.flush()
        return self.state()

    def state(self) -> dict[str, Any]:
        """Everything a resume needs from the orchestrator (saved with the trainer's step)."""
        return {
            "step": self.step,
            "gate": self.gate.state(),
            "train_sink": self.train_sink.state(),
            "dispatcher": self.dispatcher.state(),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """The mirror of ``state()``, before ``start()``, on an orchestrator built for the
        restored trainer (``start_step`` = its version + 1). The saved loop may have shipped
        up to ``S + 1`` steps the trainer had not trained yet (S = ``max_staleness``, the
        hold's bound): those batches are regenerated (their prompts are not replayed), so a
        saved step outside ``[start_step, start_step + S + 1]`` means the checkpoint's parts
        disagree and fails. The gate's saved counters are not copied: ``build_orchestrator``
        already recovered it by its rule (``gate.resume``), so the first step after a resume
        admits at most ``(S + 1) * B``."""
        check_resume_state(state, self.step, self.policy.version, self.config.max_staleness)
        # Lifetime counters come back; batches are numbered from the trainer's step.
        self.train_sink.restore({**state["train_sink"], "step": self.step})
        self.dispatcher.restore(state["dispatcher"])
