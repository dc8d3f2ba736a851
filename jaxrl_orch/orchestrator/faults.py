"""Faults made visible: environment errors once per kind, and an event loop that stops turning.

What it owns
- ``FaultLog``: every error rollout the main loop routes (train and eval). Each distinct
  message (per env, digits masked, so ``bad id 17`` and ``bad id 18`` are one kind) is
  reported once when first seen, with a note that later ones are only counted; every error
  rollout is appended to ``errors.jsonl`` (env, ids, the version it landed at, its error
  texts, its example), so the text is on record next to the trained rollouts. Deliberate
  cancellations (``Cancelled: ...``: the drop policy, a stop) are neither reported nor
  recorded. ``digest()`` gives ``{"env: message": count}`` for the summary; ``close()``
  prints the counts once more at the end.
- ``LoopWatchdog``: a heartbeat task on the event loop and a watcher thread. When the loop
  has not turned for ``warn_s`` (environment code calling ``time.sleep`` or blocking I/O in
  a coroutine stalls every rollout, the gate and the trainer's feed alike) the thread reports
  the Python frame the loop is stuck in, by function, file and line (an import is named by
  the code that imported), and each other function that holds the same stall for ``warn_s``;
  the heartbeat counts each stall and its length once the loop turns again.

Gauges: ``faults/env_errors_total``, ``faults/distinct_errors``,
``faults/loop_blocked_total``, ``faults/loop_blocked_max_s``.

Who drives it: the main loop (``FaultLog.note`` per routed episode; the watchdog runs as one
of its tasks). Neither decides anything: they report and count.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from jaxrl_orch.paths import JsonlAppender
from jaxrl_orch.types import Episode

_DIGITS = re.compile(r"\d+")
_LINE = re.compile(r":\d+\)")
_STDLIB = tuple(
    os.path.realpath(p) for p in {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
)


def warn(text: str) -> None:
    """One line on stderr (through tqdm, so it never tears a progress bar)."""
    tqdm.write(text, file=sys.stderr)


def _deliberate(error: str) -> bool:
    return error.startswith("Cancelled: ")


class FaultLog:
    """See the module docstring."""

    def __init__(
        self, path: str | os.PathLike | None = None, report: Callable[[str], None] = warn
    ) -> None:
        self.path = path
        self.report = report
        self.counts: dict[str, int] = {}
        self.total = 0
        self._out: JsonlAppender | None = None

    def note(self, episode: Episode, version: int) -> None:
        for r in episode:
            errors = [e for e in r.errors if not _deliberate(e)]
            if not errors:
                continue
            self.total += 1
            key = f"{r.env}: {_DIGITS.sub('#', errors[0])[:300]}"
            n = self.counts[key] = self.counts.get(key, 0) + 1
            if n == 1:
                self.report(
                    f"!! env {r.env!r} rollout failed ({'eval' if r.is_eval else 'train'}, "
                    f"group {r.group_id}): {errors[0][:500]}  [first of its kind; later ones "
                    "are counted, every one is in errors.jsonl]"
                )
            self._record(r, errors, version)

    def _record(self, r: Any, errors: list[str], version: int) -> None:
        if self.path is None:
            return
        if self._out is None:
            self._out = JsonlAppender(self.path)
        row = {
            "landed_version": int(version),
            "env": r.env,
            "group_id": int(r.group_id),
            "episode_id": int(r.episode_id),
            "is_eval": bool(r.is_eval),
            "errors": errors,
            "example": r.example,
        }
        self._out.append(row)

    def digest(self) -> dict[str, int]:
        return dict(sorted(self.counts.items(), key=lambda kv: -kv[1]))

    def gauges(self) -> dict[str, float]:
        return {
            "faults/env_errors_total": float(self.total),
            "faults/distinct_errors": float(len(self.counts)),
        }

    def close(self) -> None:
        if self.counts:
            kinds = "; ".join(f"{n} x {k}" for k, n in list(self.digest().items())[:5])
            more = f" (+{len(self.counts) - 5} more kinds)" if len(self.counts) > 5 else ""
            where = f"; all in {self.path}" if self.path is not None else ""
            self.report(f"!! {self.total} env error rollouts: {kinds}{more}{where}")
        if self._out is not None:
            self._out.close()
            self._out = None


def culprit(frame: Any) -> str:
    """The innermost frame outside the standard library (asyncio included), as
    ``function (file:line)``; the innermost one at all if every frame is the stdlib's. Inside an
    import, the code that imported is named too: that is where a lazy import on the loop can
    be moved. A loop in its own machinery (every frame up to asyncio's ``_run_once`` the
    stdlib's: its select, between callbacks) runs no one's coroutine, so the frame that started
    the loop is not named for it: the collector or another thread holding the interpreter
    stalls it there."""
    if frame is None:
        return "an unknown place"
    f = frame
    while f is not None:
        if not _is_stdlib(f.f_code.co_filename):
            importer = _importer(f)
            return _where(f) + (f", imported by {_where(importer)}" if importer else "")
        if f.f_code.co_name == "_run_once":
            return f"asyncio's own machinery, no coroutine ({_where(frame)})"
        f = f.f_back
    return _where(frame)


def _importer(frame: Any) -> Any:
    """The first frame outside the standard library above the import machinery's frames above
    ``frame`` (None when ``frame`` does not run inside an import)."""
    f, importing = frame.f_back, False
    while f is not None:
        if _is_stdlib(f.f_code.co_filename):
            importing = importing or f.f_code.co_filename.startswith("<frozen importlib")
        elif importing:
            return f
        f = f.f_back
    return None


def _is_stdlib(filename: str) -> bool:
    # the import machinery's frames are frozen (``<frozen importlib._bootstrap>``): they are
    # the standard library's, as the files the machinery runs from would be
    return filename.startswith("<frozen ") or os.path.realpath(filename).startswith(_STDLIB)


def _where(f: Any) -> str:
    return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"


class Stall:
    """Which frames of one stall get named. The frame running when the stall passes ``warn_s``
    is named; one stall can hold several culprits in turn (a slow import, then a blocking
    ``score``), so a different function is named too once it has held the loop ``warn_s`` by
    itself, up to ``MAX_NAMED`` per stall. A function is named once per stall, whatever line
    it has reached."""

    MAX_NAMED = 3

    def __init__(self, warn_s: float) -> None:
        self.warn_s = warn_s
        self._beat: float | None = None
        self._named: set[str] = set()
        self._running: str | None = None
        self._since = 0.0

    def names(self, beat: float, where: str, now: float) -> bool:
        if beat != self._beat:
            self._beat, self._named, self._running = beat, set(), None
        function = _LINE.sub("", where)
        if function != self._running:
            self._running, self._since = function, now
        if function in self._named or len(self._named) >= self.MAX_NAMED:
            return False
        if self._named and now - self._since < self.warn_s:
            return False
        self._named.add(function)
        return True


class LoopWatchdog:
    """See the module docstring. ``run()`` is the heartbeat task; it starts the thread."""

    def __init__(self, warn_s: float, report: Callable[[str], None] = warn) -> None:
        if not warn_s > 0:
            raise ValueError(f"warn_s must be > 0 seconds, got {warn_s!r}")
        self.warn_s = warn_s
        self.report = report
        self.interval_s = min(0.25, warn_s / 4)
        self.blocked_total = 0
        self.blocked_max_s = 0.0
        self._beat = time.monotonic()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread_id: int | None = None

    async def run(self) -> None:
        self._loop_thread_id = threading.get_ident()
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                now = time.monotonic()
                stalled = now - self._beat - self.interval_s
                if stalled > self.warn_s:
                    self.blocked_total += 1
                    self.blocked_max_s = max(self.blocked_max_s, stalled)
                    self.report(f"!! the event loop was blocked for {stalled:.1f}s")
                self._beat = now
        finally:
            self.stop()

    def _watch(self) -> None:
        stall = Stall(self.warn_s)
        while not self._halt.wait(self.interval_s):
            beat = self._beat
            now = time.monotonic()
            if now - beat <= self.warn_s:
                continue
            where = culprit(sys._current_frames().get(self._loop_thread_id))
            if stall.names(beat, where, now):
                self.report(
                    f"!! the event loop has not turned for {self.warn_s:g}s; it is running "
                    f"{where}: code on the event loop (an environment's run/score) must "
                    "not block: await, or move the work to a thread (asyncio.to_thread)"
                )

    def stop(self) -> None:
        self._halt.set()

    def gauges(self) -> dict[str, float]:
        return {
            "faults/loop_blocked_total": float(self.blocked_total),
            "faults/loop_blocked_max_s": float(self.blocked_max_s),
        }
