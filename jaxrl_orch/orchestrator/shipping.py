"""BatchShipper: when the loop ships a training batch, and what the batch goes through on the way.

What it owns: the step counter (``step``, 1-based: after batch ``step`` trains, the trainer
publishes version ``step``), the empty-batch guard (per group and per batch), the count of
rollouts the ``drop`` policy discarded (``dropped_total``), and shipping. Shipping batch
``step``:

1. drain instead once ``step > max_steps`` (``drain.Drain.after_last_step``);
2. version hold (prime-rl): wait until ``policy.version >= step - 1 - max_staleness``; a hold
   parked longer than ``stall_timeout_s`` raises ``WatcherStallError``;
3. observed-age policy (docs/design.md section 4): ``pace`` routes every landed episode, then waits
   while the batch, oldest heads first, could leave any rollout to a step past the bound
   (``ledger.pace_wait``: the one exact test, over what is ready, in flight and waiting);
4. take the batch from the sink; ``drop`` discards its rollouts past the bound, and a batch
   left empty is not shipped but counts towards the empty-batch guard;
5. stamp ``off_policy_steps = (step - 1) - head_version`` on live-policy rollouts;
6. persist the trained rollouts (and journal their slots as trained at ``step``), then ship, then
   ``step += 1``; ``drop`` then cancels in-flight rollouts that can no longer make it within the
   bound; the periodic eval is scheduled (not the last step's: that one runs on the final weights,
   after the drain) and the loop hears of the step (``LoopCalls.shipped``: the caller's
   ``on_step``).

Who drives it: ``loop.Orchestrator``: ``due()`` between the episodes it routes, ``try_ship()``
once due, ``check_signal()`` after each train episode reaches the sink. Episodes that land
while ``pace`` decides are routed by the loop (``LoopCalls.take``), so each still goes to
exactly one sink.

Invariants: a batch's rollouts are on disk before the trainer sees it; the hold parks the main
loop only (the dispatcher keeps generating into ``out_q``); ``pace`` never blocks the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopComponents
from jaxrl_orch.orchestrator.drain import Drain
from jaxrl_orch.orchestrator.ledger import StepLedger, drop_stale, pace_wait, stamp_ages
from jaxrl_orch.orchestrator.progress import Progress
from jaxrl_orch.types import BatchTrainer, Episode, PolicyHandle, TrainBatch


class EmptyBatchError(RuntimeError):
    """Too many consecutive batches had nothing trainable."""


@dataclasses.dataclass(frozen=True)
class LoopCalls:
    """What the shipper calls back into the loop: ``take`` routes an episode that landed,
    ``schedule_eval`` queues the eval pass of a step, ``shipped`` runs once batch ``step`` is
    shipped."""

    take: Callable[[Episode], Awaitable[None]]
    schedule_eval: Callable[[int], None]
    shipped: Callable[[int], Awaitable[None]]


class BatchShipper:
    """Ships the loop's batches (see the module docstring)."""

    def __init__(
        self,
        config: OrchestratorConfig,
        policy: PolicyHandle,
        parts: LoopComponents,
        trainer: BatchTrainer,
        ledger: StepLedger,
        progress: Progress,
        drain: Drain,
        calls: LoopCalls,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.policy = policy
        self.parts = parts
        self.trainer = trainer
        self.ledger = ledger
        self.progress = progress
        self.drain = drain
        self.calls = calls
        self.clock = clock
        # Versions count finished optimizer steps, so a run resumed before step k holds k - 1.
        self.step = policy.version + 1
        self.dropped_total = 0
        self._empty_batches = 0

    def due(self) -> bool:
        """Whether ``try_ship`` has anything to do (it is skipped for most episodes)."""
        cfg = self.config
        if self.drain.draining:
            return False
        return (
            self.step > cfg.max_steps
            or self.policy.version < self.step - 1 - cfg.max_staleness
            or self.parts.train_sink.ready_count >= cfg.batch_size
        )

    def check_signal(self) -> None:
        """The empty-batch guard at group granularity: with dynamic sampling a batch that never
        fills (every group flat, e.g. a reward that is always 0) would otherwise spin forever.
        Counts consecutive groups that contributed nothing trainable."""
        empty = self.parts.train_sink.consecutive_empty_groups
        limit = self.config.empty_batch_limit * (self.config.batch_size // self.config.group_size)
        if empty > limit and not self.drain.draining:
            raise EmptyBatchError(
                f"{empty} groups in a row contributed nothing trainable (limit {limit}): every "
                "group was filtered (no reward variance, errors or filters); check the "
                "environment, the reward and the initial policy (an SFT warm-up?)"
            )

    async def try_ship(self) -> None:
        cfg = self.config
        sink = self.parts.train_sink
        while not self.drain.draining:
            if self.step > cfg.max_steps:
                self.drain.after_last_step()
                return
            required = self.step - 1 - cfg.max_staleness
            if self.policy.version < required:
                # Checked before the batch is even full: a stalled trainer also closes the gate,
                # so the batch may never fill. Parks the main loop (the dispatcher keeps
                # generating into out_q); a hold that outlasts stall_timeout_s raises
                # WatcherStallError instead of halting silently.
                t0 = self.clock()
                await self.parts.watcher.wait_for_version(required, timeout=cfg.stall_timeout_s)
                self.ledger.parked_s["hold"] += self.clock() - t0
                continue
            if sink.ready_count < cfg.batch_size:
                return
            if cfg.age_policy == "pace" and await self._pace_blocks():
                # Not blocking: stragglers must keep landing in the sink while we wait.
                self.ledger.park("pace")
                return
            self.ledger.unpark("pace")
            batch = sink.take_batch()
            if batch is None:
                return
            if cfg.age_policy == "drop":
                batch = self._drop(batch)
            if not batch.samples:
                self._count_empty_batch()
                continue
            self._empty_batches = 0
            await self._ship(batch)

    def _drop(self, batch: TrainBatch) -> TrainBatch:
        """The ``drop`` policy on ``batch``: counted, and journaled as consumed at this step."""
        taken = batch.trained
        batch, dropped = drop_stale(batch, self.step, self.config.max_staleness)
        self.dropped_total += dropped
        journal = self.parts.journal
        if dropped and journal is not None:
            kept = set(map(id, batch.trained))
            journal.shipped(self.step, [], [r for r in taken if id(r) not in kept])
        return batch

    async def _pace_blocks(self) -> bool:
        dispatcher = self.parts.dispatcher
        # An episode still queued is neither in flight nor in the sink: route what has landed.
        while dispatcher.out_q.qsize():
            await self.calls.take(dispatcher.out_q.get_nowait())
        ready, waiting = self.parts.train_sink.untrained_heads()
        unlanded = waiting + dispatcher.train_in_flight()
        s = self.config.max_staleness
        return pace_wait(self.step, self.policy.version, s, self.config.batch_size, ready, unlanded)

    def _count_empty_batch(self) -> None:
        self._empty_batches += 1
        if self._empty_batches >= self.config.empty_batch_limit:
            raise EmptyBatchError(
                f"{self._empty_batches} consecutive batches had nothing trainable "
                f"(last before step {self.step}): check the environment and reward"
            )

    async def _ship(self, batch: TrainBatch) -> None:
        step = self.step
        now = self.clock()
        batch = dataclasses.replace(batch, step=step)  # the step it ships at: the loop's
        stamp_ages(batch.trained, step, now)
        if self.parts.store is not None:
            await self.parts.store.write_async(step, batch.trained)
        if self.parts.journal is not None:
            self.parts.journal.shipped(step, batch.trained, [])
        self.trainer.submit(batch)
        self.progress.moved()
        self.ledger.record(
            batch,
            now,
            version=self.policy.version,
            admitted_total=self.parts.gate.admitted_total,
            out_q_depth=self.parts.dispatcher.out_q.qsize(),
            dropped_total=self.dropped_total,
        )
        self.step += 1
        self._after_ship(step)
        await self.calls.shipped(step)

    def _after_ship(self, step: int) -> None:
        cfg = self.config
        if cfg.age_policy == "drop":
            # In flight since before this version: it would land at least one step too late.
            self.parts.dispatcher.cancel_stale(self.step - 1 - cfg.max_staleness)
        # The last step's eval is the final one, run on the final weights after the drain.
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            self.calls.schedule_eval(step)
