"""PeriodicLogger, the event-loop lag monitor and the metric writers.

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

    Writers (``types.MetricsWriter``: ``write(step, metrics)``, ``close()``):
    ``ConsoleWriter`` one compact line per write (chosen keys, ``*`` patterns allowed);
    ``stage(title, detail)`` prints a stage header (data, warm-up, RL, final eval, export)
    the same way. ``ProgressWriter`` a tqdm bar over the run's steps (on a terminal only; the
    console lines go through ``tqdm.write`` so they never tear it); ``JsonlWriter`` one JSON
    object per line with ``step`` and ``time`` (non-finite values become ``null``);
    ``TensorBoardWriter`` scalars via tensorboardX. Values must be real numbers; anything else
    raises naming the key.

Driven by the orchestrator loop: ``start()`` as a task, ``stop()`` last in shutdown (it writes
one final gauge snapshot and closes the writers, which the logger owns), ``check()``.
Never: read time except through the injected clock, sleep except through asyncio, or affect
training in any way; a failing source or writer fails loudly rather than being skipped.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from tqdm import tqdm

from jaxrl_orch.types import MetricsWriter


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric keys must be str, got {key!r}")
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"metric {key!r} must be a real number (int, float, bool, numpy scalar), "
                f"got {type(value).__name__}: {value!r}"
            )
        out[key] = float(value)
    return out


def stage(title: str, detail: str) -> None:
    """A stage header on the console (through tqdm, so it never tears a progress bar)."""
    tqdm.write(f"== {title}: {detail}")


class ConsoleWriter:
    """One compact line per write: ``step 12 | a/b=0.5 c/d=3``.

    ``keys``: which metrics, in order; a key with ``*`` is a pattern (``"eval/*/reward_mean"``)
    matching any metric of the write, sorted. ``None`` prints every metric.
    """

    def __init__(self, stream: TextIO | None = None, keys: Sequence[str] | None = None) -> None:
        self.stream, self.keys = stream, list(keys) if keys is not None else None

    def _chosen(self, m: dict[str, float]) -> list[str]:
        if self.keys is None:
            return sorted(m)
        out: list[str] = []
        for key in self.keys:
            if "*" in key:
                out += [k for k in sorted(m) if fnmatch.fnmatchcase(k, key) and k not in out]
            elif key in m and key not in out:
                out.append(key)
        return out

    def write(self, step: int, metrics: dict[str, float]) -> None:
        m = _clean(metrics)
        body = " ".join(f"{k}={m[k]:.4g}" for k in self._chosen(m))
        if not body:
            return  # none of the chosen keys: no empty line
        stream = self.stream or sys.stdout
        tqdm.write(f"step {step} | {body}", file=stream)  # clears and redraws any live bar
        stream.flush()

    def close(self) -> None:
        pass


class ProgressWriter:
    """A progress bar over ``total`` steps, advanced to each write's step (never backwards:
    eval rows repeat a step). ``postfix_keys`` are shown next to it when a write has them.

    ``disable=None`` shows the bar only when ``stream`` is a terminal, so logs and captured
    output get the console lines without carriage-return noise.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "rl",
        postfix_keys: Sequence[str] = (),
        stream: TextIO | None = None,
        disable: bool | None = None,
    ) -> None:
        if total < 0 or not 0 <= initial <= total:
            raise ValueError(f"need 0 <= initial <= total, got initial={initial} total={total}")
        self.postfix_keys = list(postfix_keys)
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=stream or sys.stderr,
            disable=disable,
            dynamic_ncols=True,
        )

    @property
    def position(self) -> int:
        return int(self.bar.n)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        m = _clean(metrics)
        shown = {k.rsplit("/", 1)[-1]: f"{m[k]:.3g}" for k in self.postfix_keys if k in m}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        elif shown:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class JsonlWriter:
    """Appends one JSON object per write; flushed each time so a crash loses nothing."""

    def __init__(self, path: str | os.PathLike, clock: Callable[[], float] = time.time) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.clock = clock
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row: dict[str, Any] = {"step": int(step), "time": self.clock()}
        for k, v in _clean(metrics).items():
            row[k] = v if math.isfinite(v) else None  # strict JSON has no NaN/inf
        self._f.write(json.dumps(row, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardWriter:
    """Scalars to a TensorBoard event file under ``logdir`` (tensorboardX, no TensorFlow)."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        from tensorboardX import SummaryWriter  # imported lazily: it pulls in protobuf

        self.logdir = os.fspath(logdir)
        self._w = SummaryWriter(self.logdir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in _clean(metrics).items():
            self._w.add_scalar(k, v, int(step))
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class LagMonitor:
    """Measures event-loop lag as the overshoot of a short asyncio sleep."""

    def __init__(self, probe_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        if probe_s <= 0:
            raise ValueError(f"probe_s must be > 0, got {probe_s!r}")
        self.probe_s, self.clock = probe_s, clock
        self.last_s = self.max_s = 0.0
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
        self.sources, self.writers = list(sources), list(writers)
        self.interval_s, self.clock, self.step_fn = interval_s, clock, step_fn
        self.lag = LagMonitor(lag_probe_s, clock) if lag_probe_s is not None else None
        self.ticks = self.writes_total = 0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None

    def collect(self) -> dict[str, float]:
        """Pull every source once; the lag monitor's and the logger's own gauges included."""
        merged: dict[str, float] = {}
        for s in [*self.sources, self]:
            part = s.gauges() if callable(getattr(s, "gauges", None)) else s()
            for k, v in _clean(part).items():
                if k in merged:
                    raise ValueError(f"gauge {k!r} reported by two sources (second: {s!r})")
                merged[k] = v
        return merged

    def gauges(self) -> dict[str, float]:
        own = {"logger/writes_total": float(self.writes_total)}
        return {**own, **(self.lag.gauges() if self.lag is not None else {})}

    def write_step(self, step: int, metrics: dict[str, float]) -> None:
        """The loop's per-step metrics, written to every writer at ``step``."""
        clean = _clean(metrics)
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
