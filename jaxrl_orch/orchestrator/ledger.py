"""StepLedger: what the loop measures about each shipped step, and the one row it writes for it.

What it owns: the per-step record (``history``), the observed-age histogram, the time the loop
spent parked per reason (version hold, pace) between two ships, and the step rows. A row holds
what the loop saw at ship time (ages and their in-flight / in-queue split, admissions, step
time, parking, queue depth); with ``step_metrics`` the row waits until that step is trained and
then carries the trainer's numbers too, so ``metrics.jsonl`` gets exactly one row per step, in
step order (``flush``; ``flush(final=True)`` at shutdown writes the rest). Also the pure
decisions of shipping: ``stamp_ages`` and ``drop_stale`` on a batch's rollouts, and
``pace_wait``, the ``pace`` policy's test of whether a batch may ship yet.

A helper of the loop (``loop.py``, ``shipping.py``), not a component: no start/stop, no
imports of other components.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence

from jaxrl_orch.orchestrator.stats import head_versions, summaries
from jaxrl_orch.types import Rollout, TrainBatch


@dataclasses.dataclass
class StepRecord:
    """What the loop measured about one shipped step (also written as its step row)."""

    step: int
    metrics: dict[str, float]


def stamp_ages(rollouts: Sequence[Rollout], step: int, now: float) -> None:
    """``off_policy_steps = (step - 1) - head_version`` on live-policy rollouts and samples."""
    for r, head in zip(rollouts, head_versions(rollouts), strict=True):
        r.shipped_at = now
        if r.live_policy:
            r.off_policy_steps = (step - 1) - head
        for s in r.samples:
            s.off_policy_steps = r.off_policy_steps


def drop_stale(batch: TrainBatch, step: int, bound: int) -> tuple[TrainBatch, int]:
    """The ``drop`` policy: ``batch`` without the live rollouts whose head age at ``step``
    exceeds ``bound`` (nor their samples), and how many those were."""
    keep = []
    dropped = 0
    for r, head in zip(batch.trained, head_versions(batch.trained), strict=True):
        if r.live_policy and (step - 1) - head > bound:
            dropped += 1
        else:
            keep.append(r)
    metrics = {**batch.metrics, "orch/dropped": float(dropped)}
    if not dropped:
        return dataclasses.replace(batch, metrics=metrics), 0
    samples = [s for r in keep for s in r.samples]
    return dataclasses.replace(batch, trained=keep, samples=samples, metrics=metrics), dropped


def pace_wait(
    step: int,
    version: int,
    bound: int,
    batch_size: int,
    ready: Sequence[int],
    unlanded: Sequence[int],
) -> bool:
    """Whether shipping batch ``step`` now, as the ``batch_size`` oldest of the ready rollouts
    (head versions ``ready``), could leave a rollout to be trained past head age ``bound``.

    ``unlanded`` holds, for each rollout that may still be trained but is not ready yet (in
    flight, or landed in a group still waiting for the rest), a lower bound on its head version.
    A rollout with head ``x`` must be trained by step ``x + bound + 1``. For every version ``x``
    the trainer has already moved past (no more rollouts will start under it), what is left
    with a head <= ``x`` once this batch is taken must fit in the batches after ``step`` that
    may still train it: ``(x + bound + 1 - step) * batch_size``. For ``x = step - bound - 1``
    there is no later batch, so every such rollout must be ready and in this one. Versions not
    yet moved past need no check: the admission gate lets at most ``(x + bound + 1) *
    batch_size`` rollouts start under version ``x`` or earlier, and every batch holds
    ``batch_size``, so they fit by count. Taking a younger rollout while older ones are still
    out uses a slot they may need later: the check refuses exactly that, so waiting always
    ends once the older ones land.
    """
    taken = sorted(ready)[:batch_size]
    for x in range(step - bound - 1, version):
        left = sum(h <= x for h in ready) - sum(h <= x for h in taken)
        left += sum(h <= x for h in unlanded)
        if left > (x + bound + 1 - step) * batch_size:
            return True
    return False


class StepLedger:
    def __init__(
        self,
        clock: Callable[[], float],
        write: Callable[[int, dict[str, float]], None],
        step_metrics: Callable[[int, dict[str, float]], dict[str, float] | None] | None = None,
    ) -> None:
        self.clock = clock
        self.write = write
        self.step_metrics = step_metrics
        self.history: list[StepRecord] = []
        # Observed head age (in versions) of every live rollout shipped: bounded memory.
        self.age_histogram: Counter[int] = Counter()
        self.parked_s = {"hold": 0.0, "pace": 0.0}
        self._parked_since: dict[str, float] = {}
        self._admitted_at_last_ship = 0
        self._last_ship_time = clock()
        self._unwritten: dict[int, dict[str, float]] = {}

    def park(self, reason: str) -> None:
        """The loop waits for ``reason`` from now (until ``unpark``); idempotent."""
        self._parked_since.setdefault(reason, self.clock())

    def unpark(self, reason: str) -> None:
        if reason in self._parked_since:
            self.parked_s[reason] += self.clock() - self._parked_since.pop(reason)

    def restart_clock(self) -> None:
        self._last_ship_time = self.clock()

    def record(
        self,
        batch: TrainBatch,
        now: float,
        *,
        version: int,
        admitted_total: int,
        out_q_depth: int,
        dropped_total: int,
    ) -> dict[str, float]:
        """Measure the batch just shipped as step ``batch.step``; write (or defer) its row."""
        live = [r for r in batch.trained if r.live_policy and r.off_policy_steps is not None]
        ages = [r.off_policy_steps for r in live]
        self.age_histogram.update(ages)
        last = batch.step - 1
        landed = [r.metrics["orch/landed_version"] for r in live]
        m: dict[str, float] = {"step": float(batch.step), "orch/version": float(version)}
        series = {
            "orch/age": ages,
            # head = last - age: versions spent in flight, then waiting in the queue
            "orch/age_in_flight": [v - (last - a) for v, a in zip(landed, ages, strict=True)],
            "orch/age_in_queue": [last - v for v in landed],
            "orch/in_flight_s": [r.finished_at - r.admitted_at for r in live],
            "orch/in_queue_s": [now - r.finished_at for r in live],
        }
        m.update(summaries(series))
        m["orch/admitted"] = float(admitted_total - self._admitted_at_last_ship)
        self._admitted_at_last_ship = admitted_total
        m["orch/step_s"] = now - self._last_ship_time
        self._last_ship_time = now
        for reason, secs in self.parked_s.items():
            m[f"orch/parked_{reason}_s"] = secs
            self.parked_s[reason] = 0.0
        m["orch/out_q_depth"] = float(out_q_depth)
        m["orch/trainable_samples"] = float(len(batch.samples))
        m["orch/dropped_total"] = float(dropped_total)
        metrics = dict(batch.metrics)
        metrics.update({k: v for k, v in m.items() if math.isfinite(v)})
        self.history.append(StepRecord(batch.step, metrics))
        if self.step_metrics is None:
            self.write(batch.step, metrics)
        else:
            self._unwritten[batch.step] = metrics  # the same dict: history sees the merge
        return metrics

    def due(self, version: int) -> bool:
        """Whether a deferred row's step has been trained (``flush`` has work)."""
        return bool(self._unwritten) and version >= min(self._unwritten)

    def flush(self, final: bool = False) -> None:
        """Write the deferred rows of trained steps (``final``: every row, trained or not)."""
        for step in sorted(self._unwritten):
            extra = self.step_metrics(step, self._unwritten[step])
            if extra is None and not final:
                return  # rows go out in step order
            metrics = self._unwritten.pop(step)
            metrics.update(extra or {})
            self.write(step, metrics)
