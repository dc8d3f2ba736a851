"""OverlapSchedule: whether generation runs while the trainer steps, chosen by measurement.

Why: with ``max_staleness >= 1`` the engine generates the next batch while the trainer trains
this one. On separate chips that overlap is free time. When both share the same cores (one CPU
host, fake devices), the two programs compete for them and each slows down: measured here, an
overlapped step can be *slower* than the synchronous one. So on such hosts the schedule
measures both ways and keeps the faster:

- ``overlapped``: the engine never waits for the trainer (the asynchronous pipeline as is);
- ``sliced``: the engine's driver pauses between two decode calls while a train step runs and
  resumes after it (time slicing). The staleness bound, the gate and dispatch are unchanged;
  only the engine's compute yields the cores to the trainer's step;
- ``auto``: after ``settle`` steps (compilation, first fills), ``probe`` step periods overlapped,
  then ``probe`` sliced (the period that straddles the switch is skipped), then the faster
  median for the rest of the run. The decision and both medians are kept in ``decision``
  (the run's ``summary.json["overlap"]``) and announced on the console.

A step period is the time from one train step's start to the next one's: in a steady pipeline,
exactly the run's time per step. Measured on the trainer's worker thread (``training()`` wraps
each step); the engine's driver waits on ``engine_may_run`` between calls.

Who uses it: ``schedule_for`` is the one place that decides between synchronous,
overlapped and measured, for an engine in the trainer's process (``sides.InProcessSide``;
replicas on other hosts never share the trainer's cores); ``Engine.overlap`` names the mode.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxrl_orch.orchestrator.metrics.writers import stage

MODES = ("auto", "overlapped", "sliced")


class OverlapSchedule:
    def __init__(
        self,
        mode: str = "auto",
        *,
        probe: int = 2,
        settle: int = 1,
        announce: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        synchronous: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"overlap must be one of {MODES}, got {mode!r}")
        if probe < 1 or settle < 0:
            raise ValueError(f"probe must be >= 1 and settle >= 0, got {probe}, {settle}")
        self.mode = "overlapped" if mode == "auto" else mode
        self.engine_may_run = threading.Event()
        self.engine_may_run.set()
        self._probe = probe
        self._settle = settle
        self._announce = announce or (lambda _: None)
        self._clock = clock
        self._last_start: float | None = None
        self._seen = 0  # step periods observed so far
        self._periods: dict[str, list[float]] = {"overlapped": [], "sliced": []}
        self.decision: dict[str, Any] | None = None if mode == "auto" else {"mode": mode}
        if synchronous:
            self.decision = {"mode": "synchronous"}

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Wraps one train step on the trainer's thread."""
        now = self._clock()
        if self._last_start is not None:
            self._observe(now - self._last_start)
        self._last_start = now
        if self.mode == "sliced":
            self.engine_may_run.clear()
        try:
            yield
        finally:
            self.engine_may_run.set()

    def _observe(self, period: float) -> None:
        self._seen += 1
        if self.decision is not None:
            return
        n = self._seen - self._settle
        p = self._probe
        if n < 1:
            return
        if n <= p:
            self._periods["overlapped"].append(period)
            if n == p:
                self.mode = "sliced"  # from the next step on
        elif n >= p + 2:  # n == p + 1 straddles the switch
            self._periods["sliced"].append(period)
            if n == 2 * p + 1:
                self._decide()

    def _decide(self) -> None:
        over, sliced = (statistics.median(self._periods[k]) for k in ("overlapped", "sliced"))
        self.mode = "sliced" if sliced < over else "overlapped"
        self.decision = {
            "mode": self.mode,
            "overlapped_step_s": over,
            "sliced_step_s": sliced,
            "steps_probed": self._seen,
        }
        verdict = (
            "overlapping generation and training is slower here (they share cores): "
            "the engine now pauses during each train step"
            if self.mode == "sliced"
            else "overlapping generation and training is faster: kept"
        )
        self._announce(f"{verdict} (overlapped {over:.2f} s/step, time-sliced {sliced:.2f})")


def schedule_for(synchronous: bool, mode: str, colocated: bool, backend: str) -> OverlapSchedule:
    """A synchronous run (S = 0) never overlaps: the engine never waits, nothing to time.
    ``auto`` measures only where engine and trainer share cores (a CPU host, or one set of
    devices); separate chips always overlap."""
    if synchronous:
        return OverlapSchedule("overlapped", synchronous=True)
    if mode == "auto" and not (colocated or backend == "cpu"):
        mode = "overlapped"
    return OverlapSchedule(mode, announce=lambda line: stage("overlap", line))


def probe_steps(settle: int = 1, probe: int = 2) -> int:
    """Train steps an ``auto`` probe spans: from the next one on, the decision holds."""
    return settle + 2 * probe + 1
