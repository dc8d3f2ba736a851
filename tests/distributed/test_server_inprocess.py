"""ReplicaServer and RemoteEngineClient in one process, around a stand-in driver: the contracts
that a real engine would make slow or racy to show (cancellation reaches the driver future, the
queue bound, engine errors, a server shutting down under a call)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math

import pytest

from jaxrl_orch.distributed.client import RemoteEngineClient, ReplicaLost
from jaxrl_orch.distributed.server import ReplicaServer
from jaxrl_orch.types import Completion, SamplingParams

pytestmark = pytest.mark.timeout(60)


class _Engine:
    max_concurrent_decodes = 2


class _Driver:
    """Holds every submitted future; the test resolves or watches them."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []
        self.stopped = False

    def submit(self, prompt_ids, sampling, n=1):
        assert n == 1 and isinstance(sampling, SamplingParams)
        self.futures.append(concurrent.futures.Future())
        return [self.futures[-1]]

    def gauges(self):
        return {"inference/queue_depth": 0.0}

    def stop(self):
        self.stopped = True


async def _serving(max_queued: int = 2):
    server = ReplicaServer(_Engine(), address="127.0.0.1:0", replica=3, max_queued=max_queued)
    task = asyncio.create_task(server.serve())
    while server.bound_address is None:
        await asyncio.sleep(0.005)
    server.driver, server.version = _Driver(), 5  # as if weights had landed
    return server, task


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_deadline_and_task_cancel_cancel_the_driver_future_and_the_bound_holds():
    async def main():
        server, task = await _serving(max_queued=2)
        driver = server.driver
        quick = RemoteEngineClient(server.bound_address, replica=3, timeout_s=0.3)
        with pytest.raises(RuntimeError, match="replica 3 .*no answer within timeout_s=0.3"):
            await quick.generate([1, 2], SamplingParams())
        await _until(lambda: driver.futures[0].cancelled())  # the slot would free
        client = RemoteEngineClient(server.bound_address, replica=3)
        a = asyncio.ensure_future(client.generate([1], SamplingParams()))
        b = asyncio.ensure_future(client.generate([2], SamplingParams()))
        await _until(lambda: server.in_flight == 2)
        assert client.in_flight == 2
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED.*max_queued=2"):
            await client.generate([3], SamplingParams())
        await _until(lambda: len(driver.futures) == 3)
        a.cancel()  # the caller's task gives up: the replica's future follows
        await _until(lambda: any(f.cancelled() for f in driver.futures[1:]))
        (live,) = [f for f in driver.futures[1:] if not f.cancelled()]
        live.set_result(Completion([7], [float("nan")], [5], "stop"))
        done = await b
        assert done.token_ids == [7] and done.versions == [5] and math.isnan(done.logprobs[0])
        assert server.in_flight == 0 and client.in_flight == 0
        await server.stop(0.1)
        await task
        await quick.close()
        await client.close()

    asyncio.run(main())


def test_engine_error_is_a_runtime_error_and_shutdown_is_replica_lost():
    async def main():
        server, task = await _serving()
        driver = server.driver
        client = RemoteEngineClient(server.bound_address, replica=3)
        call = asyncio.ensure_future(client.generate([1], SamplingParams()))
        await _until(lambda: len(driver.futures) == 1)
        driver.futures[0].set_exception(ValueError("cache exploded"))
        with pytest.raises(RuntimeError, match="INTERNAL.*generate failed: ValueError: cache exp"):
            await call
        assert client.alive
        call = asyncio.ensure_future(client.generate([1], SamplingParams()))
        await _until(lambda: len(driver.futures) == 2)
        await server.stop(0.1)  # shuts down under the call
        with pytest.raises(ReplicaLost, match=f"replica 3 at {server.bound_address} is lost"):
            await call
        assert not client.alive and driver.stopped
        assert await client.health(timeout_s=0.5) is None
        await task
        await client.close()

    asyncio.run(main())
