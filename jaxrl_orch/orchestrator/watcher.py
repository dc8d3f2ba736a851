"""WeightWatcher: turns a newly published trainer version into the engine's current policy.

What it owns
    The one writer of ``PolicyHandle``. Per new version, strictly in this order:
    1. ``reload_fn(version, params)``: the engine's hook (reshard onto the decode mesh, swap
       between two decode steps). Async hooks are awaited; sync ones run in a worker thread so
       the event loop keeps dispatching while weights move.
    2. ``policy.advance(version)``: wakes everything parked on the version (the version hold,
       the dispatcher's stale-rollout check).
    3. ``observer.on_version(version)`` for each observer (e.g. the staleness gate), called
       synchronously right after the bump, with no await in between, so nobody can see the
       new version on the handle while the gate still counts the old one.
    Only the newest unconsumed version matters: if the trainer publishes 4 and 5 while 3 is
    loading, the watcher loads 5 next and never 4; the version set on the handle is always
    the one actually loaded (``watcher/skipped_versions_total`` counts the skips).

Version sources (``async next_version(current) -> PublishedVersion``, newest > current)
    ``InProcessPublisher``: the trainer calls ``publish(version, params)`` from any thread
    (its worker thread, typically); the waiter is woken thread-safely.

Stall detection
    A watcher that stops receiving versions halts the run quietly: the gate closes or the
    version hold parks forever. ``wait_for_version(v, timeout)`` (what the loop's hold awaits)
    therefore raises ``WatcherStallError`` naming the awaited and current versions, how long
    it waited and where versions come from, when the timeout passes, and at once when the
    watcher itself died or was stopped.

Driven by the orchestrator loop (``start()`` as a task, ``stop()``, ``check()``, ``gauges()``).
Never: read time except through the injected clock, sleep except through asyncio, bump the
version before the engine has the weights, or import another orchestrator component.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxrl_orch.types import PolicyHandle, VersionObserver

# How long ``stop()`` lets a reload in progress finish.
STOP_TIMEOUT_S = 60.0


class WatcherStallError(RuntimeError):
    """The policy version did not reach the awaited value in time (or the watcher is gone)."""


@dataclasses.dataclass
class PublishedVersion:
    version: int
    params: Any
    # When the source first knew of it (publish call, or the poll that found it), on the
    # source's clock; the watcher measures publish-to-live latency from here.
    published_at: float


class VersionSource(Protocol):
    async def next_version(self, current: int) -> PublishedVersion:
        """Wait for and return the newest version greater than ``current``."""
        ...


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async callable; run a sync one in a worker thread (it may block for seconds)."""
    # type(fn).__call__ covers callable objects whose __call__ is ``async def``.
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


class InProcessPublisher:
    """The trainer hands versions over in-process; ``publish`` is safe from any thread.

    ``published_at`` is stamped with the ``time()`` of the event loop the watcher awaits on
    (``time.monotonic`` on a standard loop, virtual time in simulation), so it matches the
    watcher's clock without extra wiring.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._latest: PublishedVersion | None = None
        self._last_version: int | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.published_total = 0

    def publish(self, version: int, params: Any) -> None:
        with self._lock:
            if self._last_version is not None and version <= self._last_version:
                raise ValueError(
                    f"published versions must increase: last was {self._last_version}, "
                    f"got {version}"
                )
            # Replacing an unconsumed version drops our reference to its params at once.
            self._latest = PublishedVersion(int(version), params, self._now())
            self._last_version = int(version)
            self.published_total += 1
            waiters = self._waiters
            self._waiters = []
        for loop, fut in waiters:
            # A closed loop means its watcher is gone; nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut)

    def _now(self) -> float:
        # Reading loop.time() from the trainer's thread is safe: it only reads a clock.
        return self._loop.time() if self._loop is not None else time.monotonic()

    async def next_version(self, current: int) -> PublishedVersion:
        while True:
            loop = self._loop = asyncio.get_running_loop()
            with self._lock:
                latest = self._latest
                if latest is not None and latest.version > current:
                    self._latest = None
                    return latest
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    def __repr__(self) -> str:
        return f"InProcessPublisher(last published version {self._last_version})"


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class WeightWatcher:
    def __init__(
        self,
        source: VersionSource,
        reload_fn: Callable[[int, Any], Any],
        policy: PolicyHandle,
        *,
        observers: Sequence[VersionObserver] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for obs in observers:
            if not callable(getattr(obs, "on_version", None)):
                raise TypeError(f"observer {obs!r} has no on_version(version) method")
        self.source = source
        self.reload_fn = reload_fn
        self.policy = policy
        self.observers = list(observers)
        self.clock = clock
        self._stopping = False
        self._dead = asyncio.Event()  # set when the loop ends, by failure or stop()
        self._error: BaseException | None = None
        self._run_task: asyncio.Task | None = None
        self._pending: asyncio.Future | None = None
        self._started_at: float | None = None
        self._last_version_at: float | None = None
        self._awaiting = -1
        self.reloads_total = 0
        self.skipped_versions_total = 0
        self.last_reload_s = 0.0
        self.last_latency_s = 0.0

    async def start(self) -> None:
        """Run until ``stop()``: wait for a version, load it, bump, notify. Failures are stored
        (``check()``) and re-raised here."""
        if self._run_task is not None:
            raise RuntimeError("WeightWatcher.start() called twice")
        self._run_task = asyncio.current_task()
        self._started_at = self._last_version_at = self.clock()
        try:
            while not self._stopping:
                self._pending = asyncio.ensure_future(self.source.next_version(self.policy.version))
                try:
                    published = await self._pending
                except asyncio.CancelledError:
                    if self._stopping:
                        break
                    raise
                await self._apply(published)
        except Exception as exc:
            self._error = exc
            raise
        finally:
            self._dead.set()

    async def _apply(self, pub: PublishedVersion) -> None:
        if pub.version <= self.policy.version:
            raise ValueError(
                f"version source {self.source!r} returned version {pub.version}, not newer "
                f"than the current {self.policy.version}"
            )
        t0 = self.clock()
        await _call(self.reload_fn, pub.version, pub.params)
        now = self.clock()
        previous = self.policy.version
        self.policy.advance(pub.version)
        for obs in self.observers:
            obs.on_version(pub.version)
        self.reloads_total += 1
        self.skipped_versions_total += max(0, pub.version - previous - 1)
        self.last_reload_s = now - t0
        self.last_latency_s = now - pub.published_at
        self._last_version_at = now

    async def stop(self) -> None:
        """End the loop. A reload in progress finishes first: a half-swapped engine is worse
        than a late stop."""
        self._stopping = True
        if self._pending is not None:
            self._pending.cancel()
        run = self._run_task
        if run is not None and run is not asyncio.current_task() and not run.done():
            await asyncio.wait([run], timeout=STOP_TIMEOUT_S)
        self._dead.set()

    def check(self) -> None:
        """Re-raise the failure that killed the watcher's loop, if any."""
        if self._error is not None:
            raise self._error

    async def wait_for_version(self, version: int, timeout: float | None = None) -> None:
        """Return once ``policy.version >= version``; raise ``WatcherStallError`` if that does
        not happen within ``timeout`` seconds (None waits indefinitely), or at once if the
        watcher has died or stopped."""
        if self.policy.version >= version:
            return
        t0 = self.clock()
        self._awaiting = version
        waiter = asyncio.ensure_future(self.policy.wait_for(version, timeout))
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait({waiter, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._awaiting = -1
            for fut in (waiter, dead):
                fut.cancel()
        if self.policy.version >= version:
            return
        waited = self.clock() - t0
        since = (
            "never"
            if self._last_version_at is None
            else (f"{self.clock() - self._last_version_at:.1f}s ago")
        )
        if self._error is not None:
            why = f"the watcher died ({type(self._error).__name__}: {self._error})"
        elif self._dead.is_set():
            why = "the watcher is stopped"
        else:
            why = f"no new version within {timeout}s"
        raise WatcherStallError(
            f"waited {waited:.1f}s for policy version {version} but it is still "
            f"{self.policy.version}: {why}; last version arrived {since}; "
            f"{self.reloads_total} reloads so far; source: {self.source!r}"
        ) from self._error

    def gauges(self) -> dict[str, float]:
        since = 0.0 if self._last_version_at is None else self.clock() - self._last_version_at
        return {
            "watcher/version": float(self.policy.version),
            "watcher/reloads_total": float(self.reloads_total),
            "watcher/reload_latency_s": self.last_latency_s,
            "watcher/reload_s": self.last_reload_s,
            "watcher/skipped_versions_total": float(self.skipped_versions_total),
            "watcher/since_last_version_s": since,
            "watcher/awaiting_version": float(self._awaiting),
        }
