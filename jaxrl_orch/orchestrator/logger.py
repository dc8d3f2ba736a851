"""PeriodicLogger and the event-loop lag monitor (the writers they write to: ``writers.py``).

What it owns
    Pulling: every ``interval_s`` the logger calls each source (an object with ``gauges()``
    or a callable returning a dict) and writes the merged gauges to every writer. Components
    never write metrics themselves; they expose ``gauges()`` and the logger pulls. Keys are
    ``component/metric``; two sources reporting the same key is a wiring bug and raises.
    ``write_step(step, metrics)`` is the loop's push path for per-step metrics (one call per
    trained batch).

    Lag: ``LagMonitor`` sleeps ``probe_s`` over and over and records how late each wake-up
    is (``loop/lag_s`` last, ``loop/lag_max_s``). Anything that blocks the event loop (a sync
    reload, tokenization not moved to a thread) shows up here as the overshoot.

    Gauge rows are stamped with ``step_fn()`` (the build wires the policy version: the last
    trained step), so they line up with the step rows.

Driven by the orchestrator loop: ``start()`` as a task, ``stop()`` last in shutdown (it writes
one final gauge snapshot and closes the writers, which the logger owns), ``check()``.
Never: read time except through the injected clock, sleep except through asyncio, or affect
training in any way; a failing source or writer fails loudly rather than being skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_orch.orchestrator.metrics.writers import clean_metrics
from jaxrl_orch.types import MetricsWriter


class LagMonitor:
    """Measures event-loop lag as the overshoot of a short asyncio sleep."""

    def __init__(self, probe_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        if probe_s <= 0:
            raise ValueError(f"probe_s must be > 0, got {probe_s!r}")
        self.probe_s = probe_s
        self.clock = clock
        self.last_s = 0.0
        self.max_s = 0.0
        self.probes = 0

    async def run(self) -> None:
        while True:
            t0 = self.clock()
            await asyncio.sleep(self.probe_s)
            self.last_s = max(0.0, self.clock() - t0 - self.probe_s)
            self.max_s = max(self.max_s, self.last_s)
            self.probes += 1

    def gauges(self) -> dict[str, float]:
        return {"loop/lag_s": self.last_s, "loop/lag_max_s": self.max_s}


class PeriodicLogger:
    def __init__(
        self,
        sources: Sequence[Any],
        writers: Sequence[MetricsWriter],
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        step_fn: Callable[[], int] | None = None,
        lag_probe_s: float | None = 0.1,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        for s in sources:
            if not (callable(getattr(s, "gauges", None)) or callable(s)):
                raise TypeError(f"source {s!r} has no gauges() and is not callable")
        for w in writers:
            if not (callable(getattr(w, "write", None)) and callable(getattr(w, "close", None))):
                raise TypeError(f"writer {w!r} needs write(step, metrics) and close()")
        self.sources = list(sources)
        self.writers = list(writers)
        self.interval_s = interval_s
        self.clock = clock
        self.step_fn = step_fn
        self.lag = LagMonitor(lag_probe_s, clock) if lag_probe_s is not None else None
        self.ticks = 0
        self.writes_total = 0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None

    def collect(self) -> dict[str, float]:
        """Pull every source once; the lag monitor's and the logger's own gauges included."""
        merged: dict[str, float] = {}
        for s in [*self.sources, self]:
            part = s.gauges() if callable(getattr(s, "gauges", None)) else s()
            for k, v in clean_metrics(part).items():
                if k in merged:
                    raise ValueError(f"gauge {k!r} reported by two sources (second: {s!r})")
                merged[k] = v
        return merged

    def gauges(self) -> dict[str, float]:
        own = {"logger/writes_total": float(self.writes_total)}
        return {**own, **(self.lag.gauges() if self.lag is not None else {})}

    def write_step(self, step: int, metrics: dict[str, float]) -> None:
        """The loop's per-step metrics, written to every writer at ``step``."""
        clean = clean_metrics(metrics)
        for w in self.writers:
            w.write(int(step), clean)
        self.writes_total += 1

    def _write_gauges(self) -> None:
        step = self.step_fn() if self.step_fn is not None else self.ticks
        self.write_step(step, self.collect())
        self.ticks += 1

    async def _tick_loop(self) -> None:
        next_at = self.clock() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - self.clock()))
            self._write_gauges()
            # A late tick (blocked loop) is not repaid with a burst of catch-up writes.
            next_at = max(next_at + self.interval_s, self.clock())

    async def start(self) -> None:
        """Run the periodic writes and the lag monitor until ``stop()``; failures re-raise."""
        if self._tasks:
            raise RuntimeError("PeriodicLogger.start() called twice")
        self._tasks = [asyncio.create_task(self._tick_loop(), name="logger-ticks")]
        if self.lag is not None:
            self._tasks.append(asyncio.create_task(self.lag.run(), name="loop-lag"))
        try:
            await asyncio.gather(*self._tasks)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        except Exception as exc:
            self._error = exc
            raise
        finally:
            for t in self._tasks:
                t.cancel()

    async def stop(self) -> None:
        """End both loops, write a final gauge snapshot, close the writers."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        if not self._closed:
            self._closed = True
            try:
                if self._error is None:
                    self._write_gauges()
            finally:
                for w in self.writers:
                    w.close()

    def check(self) -> None:
        """Re-raise the failure that killed the logger's loop, if any."""
        if self._error is not None:
            raise self._error
