"""RemoteEngineClient: the orchestrator's face of one engine replica in another process.

Owns: one grpc.aio channel to a ``ReplicaServer`` and the mapping of gRPC failures onto the
errors the orchestrator acts on. Same duck type as ``inference.client.EngineClient``
(``generate()`` + ``in_flight``), so ``ClientPool`` pins groups to remote replicas unchanged.

Errors:
- ``ReplicaLost`` (``.replica``, ``.address``): the replica is gone or going (UNAVAILABLE,
  connection reset, server shutdown, a server-side cancel): the caller re-dispatches the work
  elsewhere. ``alive`` turns False; a later successful ``health()`` turns it True again.
- ``WeightPullError`` (``.replica``, ``.version``): a ``load_weights`` failed (pull timed out,
  uuid never offered, replica unreachable); the message carries the server's.
- Anything else from the server (bad request, no weights yet, RESOURCE_EXHAUSTED, an engine
  error, the ``timeout_s`` deadline): ``RuntimeError`` naming the replica with its message.

Loop contract: every method is a coroutine for the caller's event loop and never blocks it.
The channel is created lazily on the running loop (grpc.aio channels belong to one loop); a
client used from a new loop (e.g. a second ``asyncio.run``) opens a new channel there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from jaxrl_orch.distributed import protocol
from jaxrl_orch.types import Completion, SamplingParams

# Details grpc gives a call whose server process died or shut down under it.
_LOST_DETAILS = ("connection reset", "socket closed", "shutdown", "connection refused", "eof")


class ReplicaLost(RuntimeError):
    def __init__(self, replica: int, address: str, cause: str) -> None:
        super().__init__(f"replica {replica} at {address} is lost: {cause}")
        self.replica = replica
        self.address = address


class WeightPullError(RuntimeError):
    def __init__(self, replica: int, version: int, cause: str) -> None:
        super().__init__(f"replica {replica}: loading weights version {version} failed: {cause}")
        self.replica = replica
        self.version = version


def _is_lost(err: grpc.aio.AioRpcError) -> bool:
    code, details = err.code(), (err.details() or "").lower()
    # A server stopping under a call cancels it server side; our own cancels raise
    # asyncio.CancelledError instead, so a CANCELLED status always came from the replica.
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        return any(s in details for s in _LOST_DETAILS)
    return False


class RemoteEngineClient:
    def __init__(self, address: str, *, replica: int, timeout_s: float = 600.0) -> None:
        self.address = address
        self.replica = int(replica)
        self.timeout_s = float(timeout_s)
        self.in_flight = 0
        self.alive = True
        self._channel: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[str, Any] = {}

    def _call(self, method: str) -> Any:
        loop = asyncio.get_running_loop()
        if self._channel is None or self._loop is not loop:
            self._channel = grpc.aio.insecure_channel(self.address)
            self._loop = loop
            self._calls = {
                name: self._channel.unary_unary(
                    protocol.method_path(name),
                    request_serializer=protocol.dumps,
                    response_deserializer=protocol.loads,
                )
                for name in protocol.METHODS
            }
        return self._calls[method]

    def _lost(self, err: grpc.aio.AioRpcError) -> ReplicaLost:
        self.alive = False
        return ReplicaLost(self.replica, self.address, f"{err.code().name}: {err.details()}")

    def _failed(self, method: str, err: grpc.aio.AioRpcError) -> RuntimeError:
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            cause = f"no answer within timeout_s={self.timeout_s}"
        else:
            cause = f"{err.code().name}: {err.details()}"
        return RuntimeError(f"replica {self.replica} at {self.address}: {method}: {cause}")

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """One sample of ``prompt_ids``; cancelling the awaiting task cancels it on the replica."""
        request = {
            "prompt_ids": [int(t) for t in prompt_ids],
            "sampling": protocol.sampling_to_json(sampling),
        }
        call = self._call("Generate")
        self.in_flight += 1
        try:
            response = await call(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            if _is_lost(err):
                raise self._lost(err) from None
            raise self._failed("Generate", err) from None
        finally:
            self.in_flight -= 1
        return protocol.completion_from_json(response)

    async def health(self, timeout_s: float = 5.0) -> dict | None:
        """The replica's ``Health`` answer, or None when it does not answer within timeout_s."""
        try:
            response = await self._call("Health")({}, timeout=timeout_s)
        except grpc.aio.AioRpcError:
            self.alive = False
            return None
        self.alive = True
        return response

    async def load_weights(
        self,
        version: int,
        address: str,
        uuid: int,
        timeout_s: float,
        layout: dict | None = None,
        extra_s: float = 30.0,
    ) -> dict:
        """Have the replica pull ``uuid`` from the transfer server at ``address`` and serve it
        as ``version``; returns ``{"version", "pull_s", "swap_s"}``. ``layout``: how the sender
        laid the arrays out (``server.transfer_targets``) when it is not the replica's own."""
        request = {"version": version, "address": address, "uuid": uuid, "timeout_s": timeout_s}
        if layout is not None:
            request["layout"] = layout
        try:
            # The RPC outlives the pull's own deadline by the swap (at most a decode step), or
            # the first load's engine warm-up (``extra_s``).
            return await self._call("LoadWeights")(request, timeout=timeout_s + extra_s)
        except grpc.aio.AioRpcError as err:
            if _is_lost(err):  # the replica died during the load: the pool moves on without it
                raise self._lost(err) from None
            raise WeightPullError(
                self.replica, version, f"{err.code().name}: {err.details()}"
            ) from None

    async def close(self) -> None:
        channel, self._channel, self._loop, self._calls = self._channel, None, None, {}
        if channel is not None:
            await channel.close()
