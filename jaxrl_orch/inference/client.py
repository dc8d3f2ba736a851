"""Async face of the inference driver: what environments and the dispatcher call.

Owns: ``EngineClient`` (implements ``types.InferenceClient``) and ``ClientPool`` (implements
``types.InferencePool``). A client never touches the engine or device arrays; it queues work
on an ``InferenceDriver`` and awaits the driver's thread-safe futures from the event loop, so
the loop is never blocked by decoding.

Multi-turn: the caller passes the whole token history as the new prompt each turn; the
client keeps no conversation state. Cancelling the awaiting task cancels the request, which
frees its engine slot at the driver's next loop turn.

``ClientPool.select()`` picks the client with the fewest requests in flight (ties go round
robin), so a dispatcher can pin all rollouts of one group to one replica.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxrl_orch.types import Completion, SamplingParams

if TYPE_CHECKING:  # the client only queues on it: importing it would bring JAX
    from jaxrl_orch.inference.driver import InferenceDriver


class EngineClient:
    def __init__(self, driver: InferenceDriver) -> None:
        self.driver = driver
        self.in_flight = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        (future,) = self.driver.submit(prompt_ids, sampling, n=1)
        return await self._await(future)

    async def _await(self, future: Any) -> Completion:
        self.in_flight += 1
        try:
            # wrap_future propagates cancellation of the awaiting task to the driver's future.
            return await asyncio.wrap_future(future)
        finally:
            self.in_flight -= 1


class ClientPool:
    def __init__(self, clients: Sequence[EngineClient]) -> None:
        if not clients:
            raise ValueError("ClientPool needs at least one client, got an empty sequence")
        self.clients = list(clients)
        self._turn = itertools.count()

    def select(self) -> EngineClient:
        """Least in-flight requests; ties broken round robin."""
        start = next(self._turn) % len(self.clients)
        order = self.clients[start:] + self.clients[:start]
        return min(order, key=lambda c: c.in_flight)
