"""Eager start: run a coroutine's first step now, and make a Task only if it suspends.

Why: the dispatcher starts one coroutine per rollout. With an instant engine (or an
environment that answers from a cache) the coroutine finishes in its first step, and a Task
for it would cost more than the rollout itself: creation, a loop turn to run it, a
done-callback and another loop turn to collect it. Python 3.12's ``eager_task_factory`` does
the same thing for the same reason; this project supports Python 3.11, so it is done here for
the one place that needs it, without changing the event loop's task factory for anyone else.

Contract (``start_eagerly``): the coroutine's first step runs synchronously in the caller's
context. If it finishes, its value is returned and no Task exists (nothing could cancel or
await it, so nothing needs one). If it raises, the exception propagates to the caller
(``CancelledError`` included). If it suspends, a Task continues it from exactly that point and
behaves like a Task created from the start: cancelling it throws ``CancelledError`` into the
coroutine at its current await, and its result or exception is the coroutine's.

Never: run anything but the first step synchronously; swallow an exception.
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import Coroutine, Generator
from typing import Any


class _Started(collections.abc.Coroutine):
    """A coroutine that already ran its first step, handed to a Task as if it had not: the
    Task's first ``send`` gets back what that step yielded, and everything after goes straight
    to the coroutine (so its result, exceptions and ``StopIteration`` are the Task's)."""

    __slots__ = ("_coro", "_pending", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self._coro = coro
        self._pending = pending
        self._first = True

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            return self._pending
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        if self._first:
            # Cancelled before the Task's first step: the coroutine is parked on ``pending``;
            # cancel that as a Task waiting on it would, then deliver the exception there.
            self._first = False
            if asyncio.isfuture(self._pending):
                self._pending.cancel()
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        raise TypeError("an eagerly started coroutine is driven by its Task only")


def start_eagerly(coro: Coroutine[Any, Any, Any]) -> tuple[asyncio.Task | None, Any]:
    """Run ``coro`` up to its first suspension. Returns ``(None, result)`` if it finished
    there, else ``(task, None)`` with a Task running the rest. Must be called with a running
    event loop; exceptions raised before the first suspension propagate."""
    try:
        pending = coro.send(None)
    except StopIteration as stop:
        return None, stop.value
    return asyncio.ensure_future(_Started(coro, pending)), None
