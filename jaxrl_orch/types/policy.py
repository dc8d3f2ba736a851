"""``PolicyHandle``: the one shared, current policy version of a run (its writer is the
weight watcher; the gate, the version hold and a simulated engine read it)."""

from __future__ import annotations

import asyncio


class PolicyHandle:
    """The shared, current policy version. Components read ``version`` off this one handle;
    the weight watcher is the only writer. ``advance`` wakes every waiter, so a version bump
    propagates without a message. Versions never go backwards."""

    def __init__(self, version: int = 0) -> None:
        self._version = int(version)
        self._advanced = asyncio.Event()

    @property
    def version(self) -> int:
        return self._version

    def advance(self, version: int) -> None:
        if version < self._version:
            raise ValueError(
                f"policy version must not go backwards: current {self._version}, got {version}"
            )
        self._version = int(version)
        # Wake everyone waiting now, then re-arm for the next advance.
        self._advanced.set()
        self._advanced = asyncio.Event()

    async def wait_advanced(self, timeout: float | None = None) -> bool:
        """Wait for the next advance. Returns False on timeout."""
        event = self._advanced
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Wait until ``self.version >= version``. Returns False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._version < version:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            if not await self.wait_advanced(remaining):
                return self._version >= version
        return True
