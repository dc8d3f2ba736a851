"""A virtual-time asyncio event loop, so the real orchestrator can run on a simulated clock.

Owns: an event loop whose ``time()`` is a number it advances itself. When the loop has nothing
ready to run, instead of sleeping until the next timer it jumps the clock to that timer. A
1,000-step scenario with seconds-long simulated latencies therefore runs in real milliseconds,
and the order of events is deterministic for a given program and seed.

Invariants:
- Virtual time never goes backwards and only moves when no callback is ready.
- Work submitted to the default executor (``asyncio.to_thread``) runs inline and completes at
  the current virtual instant: threads would otherwise race the virtual clock.
- A loop with no timers and nothing ready is deadlocked; ``select`` raises ``SimulationDeadlock``
  rather than hanging forever.

Used by ``jaxrl_orch.tools.simulate`` and by tests. Components never import it: they only read
``loop.time()`` through the clock callable they are given.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Nothing can ever run again: no ready callbacks, no timers, no I/O."""


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    # asyncio insists on a ThreadPoolExecutor; no thread is ever started because submit runs
    # the callable inline.

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
            future.set_exception(exc)
        return future


class _VirtualSelector(selectors.DefaultSelector):
    """Real selector for the loop's self-pipe; a timeout advances virtual time instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if events:
            return events
        assert self.loop is not None
        if timeout is None:
            raise SimulationDeadlock(
                f"simulation deadlocked at t={self.loop.time():.3f}s: nothing ready and no timers"
            )
        if timeout > 0:
            self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = 0.0
        # Advancing by ``deadline - now`` can land a rounding error short of the deadline; a
        # nanosecond of resolution makes such a timer fire instead of spinning on 1e-16 s steps.
        self._clock_resolution = 1e-9
        self.set_default_executor(_InlineExecutor())

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"virtual time cannot go backwards (advance by {seconds})")
        self._virtual_now += seconds


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]]) -> tuple[T, float]:
    """Run ``main()`` on a fresh virtual-time loop; return (result, virtual seconds)."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        result = loop.run_until_complete(main())
        return result, loop.time()
    finally:
        asyncio.set_event_loop(None)
        loop.close()
