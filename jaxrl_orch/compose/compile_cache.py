"""The persistent compilation cache every process of a run shares, and its hits and misses.

What it owns: ``use_compile_cache(setting)``, which points JAX's persistent compilation cache
at ``Processes.compile_cache`` (resolved by ``cache_dir``) and returns the run's
``CompileCache``: the directory and this run's hit and miss counts. ``compose.parts.build_run``
calls it first, before anything compiles, in every role (the only process, trainer process 0
and its peers, an engine replica): the trainer step, the engine's prefill and decode programs
(its warm-up compiles every prompt bucket and decode width), the reshards and the LoRA merges
all load from one directory.

Every program is cached (no minimum compile time, no minimum size): the programs of a CPU run
compile in well under JAX's default floor of 1 s each, but there are dozens, so the floor would
leave most of a restart's compile time uncached; an accelerator's programs are past it anyway.
JAX's own ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` and ``..._MIN_ENTRY_SIZE_BYTES``, when
set, are left as they are (the test suite sets one). Off (None or ''), the cache is disabled
outright: left enabled without a directory, JAX still hashes every program for it.

Counting: JAX records ``/jax/compilation_cache/compile_requests_use_cache`` for each compile
that consults the cache and ``/jax/compilation_cache/cache_hits`` for each program loaded from
it. A miss is a request that was not a hit: JAX's own ``cache_misses`` counts only entries
written, which leaves out a trainer peer's programs (process 0 writes them) and any under a
floor. One listener per process, for its life (JAX compiles on any thread); a run's counts are
deltas from its start, so runs in one process (the tests) each count their own.

Only this process's compiles are counted: an engine replica's stay in its own process.

A directory that cannot be made or written, or on a disk nearly full (``MIN_FREE_BYTES``),
turns the cache off for the run in one line (``== compile cache: off: ...``): the run needs none.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.paths import is_url

AUTO = "auto"
# Below this much free space the cache is turned off at the start: a CPU run's entries take
# tens of MB, an accelerator run's hundreds.
MIN_FREE_BYTES = 256 << 20
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"
_FLOORS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # -1: no size floor, and JAX's initialisation may not raise it (0 would let it).
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def cache_dir(value: str | None) -> Path | None:
    """The directory ``Processes.compile_cache = value`` names, or None when it is off."""
    if not value:
        return None
    if value != AUTO:
        return Path(value).expanduser()
    own = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if own and is_url(own):
        raise ValueError(
            f"Processes.compile_cache = 'auto' takes $JAX_COMPILATION_CACHE_DIR, and it is a URL "
            f"({own!r}): a compilation cache in object storage was seen not to hit "
            "(docs/faults.md, 'A restart's cost'); unset it or set Processes.compile_cache"
        )
    if own:
        return Path(own).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "jaxrl_orch" / "xla"


class _Counts:
    """This process's cache requests and hits since it started (the listener's tally)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.hits = 0
        self.listening = False
        self.thread = threading.local()  # JAX records an event on the thread that compiles

    def on_event(self, event: str, **_kwargs: object) -> None:
        if event not in (_REQUEST, _HIT):
            return
        if event == _HIT:
            self.thread.hit = True
        with self.lock:
            if event == _HIT:
                self.hits += 1
            else:
                self.requests += 1

    def listen(self) -> None:
        with self.lock:
            if self.listening:
                return
            self.listening = True
        jax.monitoring.register_event_listener(self.on_event)

    def now(self) -> tuple[int, int]:
        with self.lock:
            return self.requests, self.hits


_COUNTS = _Counts()


def reset_thread_hits() -> None:
    """Forget this thread's cache hits (``hit_on_this_thread`` then says whether a compile
    after this loaded its program from the cache)."""
    _COUNTS.thread.hit = False


def hit_on_this_thread() -> bool:
    return bool(getattr(_COUNTS.thread, "hit", False))


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """A run's view of the cache: ``directory`` (None: off) and the counts since ``since``
    (this process's ``(requests, hits)`` when the run set the cache up)."""

    directory: Path | None
    since: tuple[int, int] = (0, 0)
    executables: Any = None  # the run's ExecutableStore (compose.executables), None: off

    def counts(self) -> tuple[int, int]:
        """``(hits, misses)`` of this run's compiles so far."""
        requests, hits = _COUNTS.now()
        hits -= self.since[1]
        return hits, requests - self.since[0] - hits

    def gauges(self) -> dict[str, float]:
        hits, misses = self.counts()
        return {"compile_cache/hits": float(hits), "compile_cache/misses": float(misses)}

    def reused(self) -> tuple[int, int]:
        """``(reused, compiled)``: the programs this run loaded (from the cache or whole from
        the executable store) and those it compiled."""
        hits, misses = self.counts()
        loaded = 0 if self.executables is None else self.executables.summary()["loaded"]
        return hits + loaded, misses

    def program(self, group: str, name: str, jitted: Any) -> Any:
        """``jitted`` with its executables kept whole (``compose.executables``), or ``jitted``
        itself when the store is off."""
        store = self.executables
        return jitted if store is None else store.program(group, name, jitted)

    def summary(self) -> dict[str, object]:
        hits, misses = self.counts()
        where = None if self.directory is None else str(self.directory)
        kept = None if self.executables is None else self.executables.summary()
        return {"dir": where, "hits": hits, "misses": misses, "executables": kept}


def _usable(directory: Path | None) -> Path | None:
    """``directory``, or None said in one line when it cannot serve: it cannot be made, this
    process may not write it, or its disk has less than ``MIN_FREE_BYTES`` free. Left on, JAX
    would warn once per program it failed to write, and compile every one again anyway."""
    if directory is None:
        return None
    why = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = f"cannot make {directory} ({exc.strerror or exc})"
    else:
        free = shutil.disk_usage(directory).free
        if not os.access(directory, os.W_OK | os.X_OK):
            why = f"cannot write {directory} (permission denied)"
        elif free < MIN_FREE_BYTES:
            why = f"{directory} has {free / 1e6:.0f} MB free, under {MIN_FREE_BYTES / 1e6:.0f} MB"
    if why is not None:
        stage("compile cache", f"off: {why}")
        return None
    return directory


def use_compile_cache(value: str | None, keep_executables: bool = False) -> CompileCache:
    """Point this process's persistent compilation cache where ``value`` says (see the module
    docstring), before anything compiles; returns the run's view of it, with an executable
    store in ``<dir>/executables`` when ``keep_executables``. A directory that cannot be made
    turns the cache off, said in one line: the run needs none."""
    directory = _usable(cache_dir(value))
    _COUNTS.listen()
    jax.config.update("jax_enable_compilation_cache", directory is not None)
    if directory is not None:
        for flag, floor in _FLOORS.items():
            if flag.upper() not in os.environ:
                jax.config.update(flag, floor)
    jax.config.update("jax_compilation_cache_dir", None if directory is None else str(directory))
    # JAX opens its cache once, at the first compile of the process: a run in a process that
    # compiled before (the tests run several) must have it opened again on its own setting.
    compilation_cache.reset_cache()
    store = None
    if directory is not None and keep_executables:
        from jaxrl_orch.compose.executables import ExecutableStore  # which imports this module

        kept = _usable(directory / "executables")
        store = None if kept is None else ExecutableStore(kept)
    return CompileCache(directory, _COUNTS.now(), store)
