"""Orchestrator: the main loop, driving the components it is handed.

What it owns: running the components (started together, stopped in a bounded shutdown), the
main loop that takes finished episodes off ``out_q`` and routes each to its sink, the eval
rows, the step rows' writers, and the surface its caller drives: ``run``, ``request_drain``,
``state()`` / ``restore()`` / ``checkpoint_state()``. It builds nothing: ``build_orchestrator``
(``compose/orchestrator.py``) builds and wires the components and hands them over as
``components.LoopComponents``, with the caller's ``components.LoopHooks``; the caller creates
the shared ``PolicyHandle``, whose version (the trainer's) fixes the first step.

What it delegates: shipping batches (the version hold, the age policies, the empty-batch
guard, stamping, persisting) to ``shipping.BatchShipper``; the drain and its deadline to
``drain.Drain``; the state's layout and the resume check to ``resume``; the step rows to the
``StepLedger`` (one per step, once trained).

Durable: with a rollout journal (``journal``), every train episode is journaled as the loop
takes it, before the sink; ``start`` first replays the journal into a restart's plan
(``recovery.plan``) for the dispatcher and the sink; ``checkpoint_state`` syncs it.

Bounded: nothing moving for ``stall_timeout_s`` raises ``PipelineStallError`` (``progress``);
a SIGTERM drain past ``drain_timeout_s`` cancels what is in flight; error rollouts are
reported and recorded by the ``FaultLog``; the ``LoopWatchdog`` names code blocking the loop.

Invariants: every episode taken off ``out_q`` goes to exactly one sink (eval ones are dropped
once a drain is abandoned); a background component that dies is re-raised here. The trainer
works in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopComponents, LoopHooks
from jaxrl_orch.orchestrator.drain import Drain
from jaxrl_orch.orchestrator.ledger import StepLedger, StepRecord
from jaxrl_orch.orchestrator.progress import Progress, maybe_await, next_episode, waiting_on
from jaxrl_orch.orchestrator.recovery import Recovery, plan
from jaxrl_orch.orchestrator.resume import loop_state, restore_loop
from jaxrl_orch.orchestrator.shipping import BatchShipper, LoopCalls
from jaxrl_orch.types import BatchTrainer, EvalBatch, MetricsWriter, PolicyHandle, Rollout

# How long the main loop waits for an episode before it rechecks the drain, the ledger and the
# background tasks; an episode landing or a new policy version wakes it sooner.
POLL_S = 0.5
# Each component's stop() at shutdown: everything that matters is already on disk by then.
SHUTDOWN_TIMEOUT_S = 30.0


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
        self.config = config
        self.clock = clock
        self.trainer = trainer
        self.policy = policy
        self.on_step = hooks.on_step
        self.engine_held = hooks.engine_held
        self.on_landed = hooks.on_landed
        self.on_recovered = hooks.on_recovered
        self.before_close = hooks.before_close
        self.parts = parts
        self.gate = parts.gate
        self.dispatcher = parts.dispatcher
        self.watcher = parts.watcher
        self.train_sink = parts.train_sink
        self.eval_sink = parts.eval_sink
        self.logger = parts.logger
        self.store = parts.store
        self.faults = parts.faults
        self.watchdog = parts.watchdog
        # Per-step and per-eval metrics go here; periodic gauge snapshots go to gauge_writers.
        self.writers = list(writers)
        self.stopped = asyncio.Event()
        self.eval_history: list[EvalBatch] = []
        self._tasks: list[asyncio.Task] = []
        self._failed: asyncio.Task | None = None
        self.recovery: Recovery | None = None  # what this start took back from the journal
        # One row per step, written once trained (``step_metrics``) or at ship time.
        self.ledger = StepLedger(clock, self.write_metrics, hooks.step_metrics)
        self.progress = Progress(clock, config.stall_timeout_s, self._waiting_on)
        self.drain = Drain(config, policy, parts, self._schedule_eval, clock)
        calls = LoopCalls(self._take, self._schedule_eval, self._shipped)
        self.shipper = BatchShipper(
            config,
            policy,
            parts,
            trainer,
            self.ledger,
            self.progress,
            self.drain,
            calls,
            clock=clock,
        )
        self.start_step = self.shipper.step
        self.resumed = self.start_step > 1

    history = property(lambda self: self.ledger.history, doc="one StepRecord per shipped step")
    age_histogram = property(lambda self: self.ledger.age_histogram, doc="observed head ages")
    step = property(lambda self: self.shipper.step, doc="the next step to ship (1-based)")
    dropped_total = property(lambda self: self.shipper.dropped_total, doc="``drop``'s discards")
    draining = property(lambda self: self.drain.draining, doc="no train work is admitted")
    abandoned = property(lambda self: self.drain.abandoned, doc="the drain deadline passed")

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> list[StepRecord]:
        await self.start()
        finished = False
        try:
            await self.main_loop()
            finished = True
        finally:
            await self.shutdown(finished)
        return self.history

    async def start(self) -> None:
        if self.parts.journal is not None:
            self.recovery = await asyncio.to_thread(self._recover)
            if self.on_recovered is not None:
                self.on_recovered(self.recovery.summary(), self.recovery.named)
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

    def _recover(self) -> Recovery:
        """Replay the journal for a start at this version, hand the plan to the dispatcher and
        the sink, and begin this start's epoch file with what the plan still needs."""
        journal = self.parts.journal
        replay = journal.replay()
        version = self.policy.version
        recovery = plan(
            replay,
            version=version,
            max_staleness=self.config.max_staleness,
            next_ordinal=self.dispatcher.admission.train_groups,
            group_size=self.config.group_size,
        )
        journal.begin(version, recovery.live)
        self.dispatcher.recover(recovery)
        self.train_sink.recover(recovery.trained_before)
        return recovery

    def request_drain(self, deadline_s: float | None = None) -> None:
        """Stop admitting train work; let in-flight work land, then stop. With ``deadline_s``
        (the SIGTERM path), work still in flight after it is cancelled."""
        self.drain.request(deadline_s)

    async def shutdown(self, finished: bool = False) -> None:
        """``finished``: the main loop returned (it did not raise or get cancelled)."""
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
        if self.before_close is not None:
            await maybe_await(self.before_close(finished))
        for w in self.writers:
            w.close()
        self.faults.close()
        if self.parts.journal is not None:
            self.parts.journal.close()

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
            if self.drain.overdue():
                await self.drain.abandon(self.step - 1)
            episode = (
                q.get_nowait()
                if q.qsize()
                else await next_episode(self.dispatcher.out_q, self.policy, POLL_S)
            )
            while episode is not None:
                await self._take(episode)
                # The dispatcher emits in bursts: take what is already queued in one run, up to
                # the first episode after which there is something to ship.
                episode = q.get_nowait() if q.qsize() and not self.shipper.due() else None
            if self.ledger.due(self.policy.version):
                self.ledger.flush()
            if self.shipper.due():
                self._check_tasks()
                await self.shipper.try_ship()
            if self.drain.draining and self.drain.complete(self.step - 1):
                self.stopped.set()

    async def _take(self, episode: list[Rollout]) -> None:
        self._route(episode)
        if not episode[0].is_eval:
            if self.parts.journal is not None:
                self.parts.journal.landed(episode)
            await self.train_sink.add(episode)
            self.shipper.check_signal()

    def _route(self, episode: list[Rollout]) -> None:
        self.progress.moved()
        if self.on_landed is not None:
            self.on_landed()
        landed = float(self.policy.version)
        for r in episode:
            r.metrics["orch/landed_version"] = landed
        self.faults.note(episode, self.policy.version)
        if episode[0].is_eval and not self.drain.abandoned:
            batch = self.eval_sink.add(episode)
            if batch is not None:
                self.eval_history.append(batch)
                self.write_metrics(batch.step, batch.metrics)

    async def _shipped(self, step: int) -> None:
        if self.on_step is not None:
            await maybe_await(self.on_step(step, self.state()))

    def write_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for w in self.writers:
            w.write(step, metrics)

    def _waiting_on(self) -> str:
        awaited = sum(self.eval_sink.pending().values())
        held = self.engine_held() if self.engine_held is not None else None
        return waiting_on(
            self.dispatcher.gauges(), self.gate.gauges(), self.train_sink, awaited, held=held
        )

    def _schedule_eval(self, step: int) -> None:
        for env, n in self.dispatcher.schedule_eval(step).items():
            self.eval_sink.expect(step, env, n)

    # ------------------------------------------------------------------ state

    def checkpoint_state(self) -> dict[str, Any]:
        """``state()`` for a checkpoint of a version the trainer has just trained: the rows of
        trained steps are written first, so no checkpoint holds a step whose row a crash loses
        (a row written past the checkpoint is trimmed and written again on resume)."""
        self.ledger.flush()
        if self.parts.journal is not None:
            self.parts.journal.sync()
        return self.state()

    def state(self) -> dict[str, Any]:
        """Everything a resume needs from the orchestrator (saved with the trainer's step)."""
        return loop_state(self.step, self.parts)

    def restore(self, state: Mapping[str, Any]) -> None:
        """The mirror of ``state()``, before ``start()``, on an orchestrator built for the
        restored trainer (``start_step`` = its version + 1); ``resume`` holds the rule."""
        version = self.policy.version
        s = self.config.max_staleness
        restore_loop(state, self.parts, step=self.step, version=version, max_staleness=s)
