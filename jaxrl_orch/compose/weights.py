"""The weight path: how a trained version gets from the trainer into the engine, and onto disk.

One line of named hops per trained version ``v``::

    Trainer worker (step v) -> WeightPath.on_publish: side.move -> StepTimes.record
        -> checkpoint (when due; step v's row is written first) -> publisher.publish
    event loop: WeightWatcher sees v -> side.swap (between two decode steps, or every replica
        pulls) -> PolicyHandle.version = v

What it owns
    The two hops that depend on where the engine lives are the ``compose.sides.EngineSide``'s:
    ``move`` (trainer thread: the params laid out for the engine, a device-to-device reshard or
    a trainer group's stage) and ``swap`` (event loop: the engine takes them).
    ``StepTimes``: step ``v``'s trainer diagnostics and phase times (generate, train, transfer,
    idle), merged into step ``v``'s one ``metrics.jsonl`` row by the orchestrator.
    ``WeightPath``: the trainer thread's side of the path, in order of safety: the move, then
    step ``v``'s numbers, then the checkpoint (its orchestrator state captured before anyone can
    see version ``v``, after the rows of trained steps are written, so a kill between the two
    never loses a row), then the publish.

Thread contract: ``on_publish`` runs on the trainer's worker thread between step ``v`` and step
``v + 1``. The params it gets are donated by the next step, so the move and a due checkpoint
finish before it returns. ``StepTimes.on_ship`` / ``step_metrics`` and ``side.swap`` run on the
event loop.

Never: reshards on the event loop, publishes a version before its checkpoint is written, or lets
a step's row carry another step's numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxrl_orch.orchestrator.watcher import InProcessPublisher

if TYPE_CHECKING:
    from jaxrl_orch.compose.sides import EngineSide


class StepTimes:
    """Per-step phase times (see the module docstring). ``synchronous``: S = 0, generation and
    training never overlap."""

    def __init__(self, engine_seconds: Callable[[], float], synchronous: bool) -> None:
        self._engine_seconds = engine_seconds  # prefill + decode time so far, all replicas
        self._synchronous = synchronous
        self._trained: dict[int, dict[str, float]] = {}
        self._generated: dict[int, float] = {}
        self._gen_total = 0.0

    def record(
        self, version: int, metrics: dict[str, float], transfer_s: float, nbytes: int = 0
    ) -> None:
        """Trainer thread: step ``version``'s diagnostics, before the version is published."""
        row = {f"trainer/{k}": v for k, v in metrics.items()}
        row["time/train_s"] = row.get("trainer/step_s", 0.0)
        row["time/transfer_s"] = transfer_s
        row["transfer/bytes"] = float(nbytes)
        self._trained[version] = row

    def on_ship(self, step: int, _state: dict[str, Any]) -> None:
        """Engine time since the previous ship: the generation behind batch ``step``."""
        total = self._engine_seconds()
        self._generated[step] = total - self._gen_total
        self._gen_total = total

    def step_metrics(self, step: int, row: dict[str, float]) -> dict[str, float] | None:
        """Step ``step``'s trainer diagnostics and phase times, once it is trained."""
        if step not in self._trained:
            return None
        m = self._trained.pop(step)
        m["time/generate_s"] = gen_s = self._generated.pop(step, 0.0)
        train_s = m["time/train_s"]
        xfer_s = m["time/transfer_s"]
        # Only totals are known, not their overlap: synchronous runs never overlap generation
        # and training, asynchronous ones are assumed to overlap fully.
        busy = gen_s + train_s if self._synchronous else max(gen_s, train_s)
        m["time/idle_s"] = max(0.0, row.get("orch/step_s", 0.0) - busy - xfer_s)
        return m


class WeightPath:
    """The trainer thread's hops (see the module docstring). ``checkpoint(v)`` writes version
    ``v`` with the orchestrator's state; it runs every ``checkpoint_every`` versions before
    ``last_step`` (the final version is saved after the drain, with the final state).
    ``on_trained()`` runs first, as each version reaches the path (``run.restart``)."""

    def __init__(
        self,
        side: EngineSide,
        times: StepTimes,
        publisher: InProcessPublisher,
        checkpoint: Callable[[int], None],
        *,
        checkpoint_every: int,
        last_step: int,
        on_trained: Callable[[], None] | None = None,
    ) -> None:
        self.on_trained = on_trained
        self.side = side
        self.times = times
        self.publisher = publisher
        self._checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.last_step = last_step

    def on_publish(self, version: int, params: Any, metrics: dict[str, float]) -> None:
        if self.on_trained is not None:
            self.on_trained()
        t0 = time.perf_counter()
        moved = self.side.move(params)
        transfer_s = time.perf_counter() - t0
        # before the checkpoint writes its row
        self.times.record(version, metrics, transfer_s, self.side.bytes_moved)
        if version % self.checkpoint_every == 0 and version < self.last_step:
            self._checkpoint(version)
        self.publisher.publish(version, moved)
