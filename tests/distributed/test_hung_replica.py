"""A replica that is alive but does not answer (SIGSTOP, a wedged process) is lost like a dead one.

Real HTTP throughout. The pool tests run stand-in replicas in their own processes
(``support.standin_process``: a replica's server and weight-update path, no JAX engine), stopped
with SIGSTOP and resumed with SIGCONT: in-flight groups move at once and complete on the other
replica, a pull that gets no answer loses the replica instead of failing the caller, and a
resumed replica rejoins with the current weights. Deadlines are short settings, and nothing here
asserts a time: code that waited for the request or pull timeouts instead fails the asserts.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from support.standin_process import StandInProcess
from support.standin_replica import FakeOffer, HeldDriver, StandInEngine, serve

from jaxrl_orch.config.runtime import ProcessesSettings as Processes
from jaxrl_orch.distributed.pool import RemotePool
from jaxrl_orch.distributed.replica_client import RemoteEngineClient, ReplicaLost
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.types import SamplingParams

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SAMPLING = SamplingParams(max_tokens=4)


async def _started(procs, **deadlines: float) -> RemotePool:
    """A pool over ``procs`` probing every 0.1 s, started at version 3. Its requests may wait
    60 s, far past the deadlines under test: a pool that waited for them would fail instead of
    losing the replica."""
    pool = RemotePool(
        [p.url for p in procs],
        FakeOffer(),
        Processes(replica_request_timeout_s=60, **deadlines),
        probe_interval_s=0.1,
    )
    await pool.start(3, "w3")
    return pool


@pytest.fixture
def replicas():
    """Replica 0 holds every sample it is given (answer 40); replica 1 answers at once (41)."""
    procs = [StandInProcess(40, hold=True), StandInProcess(41)]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.kill()


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


async def _health(url: str) -> dict:
    probe = RemoteEngineClient(url, replica=9, timeout_s=60)
    try:
        return await probe.health(5.0)
    finally:
        await probe.close()


def test_a_stopped_replica_is_lost_its_groups_finish_elsewhere_and_it_rejoins_on_sigcont(
    replicas, capsys
):
    held, quick = replicas

    async def main():
        pool = await _started([held, quick], weight_pull_timeout_s=5, replica_health_timeout_s=2)
        watch = asyncio.ensure_future(pool.watch())
        handle = pool.select()
        while handle.replica != 0:
            handle = pool.select()
        calls = [asyncio.ensure_future(handle.generate([1, i], SAMPLING)) for i in range(4)]
        await _until(
            lambda: _in_flight_is(held.url, 4), "4 samples in flight on replica 0", timeout_s=10
        )
        held.pause()
        done = await asyncio.gather(*calls)
        lost = (set(pool.live), pool.lost_total, pool.reissued_total, pool.moved_groups_total)
        await pool.load_weights(4, "w4")  # while replica 0 is lost: only replica 1 loads it
        held.resume()
        await _until(lambda: _is_live(pool, 0), "replica 0 rejoins")
        back, other = await _health(held.url), await _health(quick.url)
        # The samples it held were abandoned: the resumed replica sees their clients gone.
        await _until(lambda: _in_flight_is(held.url, 0), "replica 0 cancels the abandoned ones")
        watch.cancel()
        await pool.close()
        return pool, done, lost, back, other

    pool, done, lost, back, other = asyncio.run(main())
    # Every request completed once, on the live replica, stamped with the version it held.
    assert [c.token_ids for c in done] == [[41]] * 4
    assert all(c.versions == [3] for c in done)
    assert lost == ({1}, 1, 4, 1)  # lost once; 4 re-issued; the group moved once
    assert other.engine_s == 4.0  # replica 1 answered each request exactly once
    out = capsys.readouterr().out
    assert f"engine replica 0 ({held.url}) lost: no answer to its health probe for " in out
    # It rejoined through the usual path: the current version first, then live.
    assert "engine replica 0 is back, serving version 4" in out
    assert back.version == 4 and back.engine_s == 0.0 and other.version == 4
    assert pool.live == {0, 1} and pool.rejoined_total == 1 and pool.lost_total == 1


def test_a_pull_to_a_stopped_replica_past_its_deadline_loses_it_instead_of_failing(
    replicas, capsys
):
    held, quick = replicas

    async def main():
        # The health deadline is long and nothing watches yet: the pull's own deadline
        # (weight_pull_timeout_s + weight_load_extra_s) is what finds the replica silent.
        pool = await _started(
            [held, quick],
            weight_pull_timeout_s=1,
            weight_load_extra_s=1,
            replica_health_timeout_s=60,
        )
        quick.pause()
        await pool.load_weights(4, "w4")  # does not raise: replica 0 is live
        lost = (set(pool.live), pool.lost_total)
        loaded = await _health(held.url)
        quick.resume()
        watch = asyncio.ensure_future(pool.watch())
        await _until(lambda: _is_live(pool, 1), "replica 1 rejoins")
        back = await _health(quick.url)
        watch.cancel()
        await pool.close()
        return pool, lost, loaded, back

    pool, lost, loaded, back = asyncio.run(main())
    assert lost == ({0}, 1) and loaded.version == 4
    out = capsys.readouterr().out
    assert f"engine replica 1 ({quick.url}) lost: no answer to /update_weights (version 4)" in out
    assert back.version == 4 and pool.live == {0, 1} and pool.rejoined_total == 1


async def _in_flight_is(url: str, n: int) -> bool:
    return (await _health(url)).in_flight == n


async def _is_live(pool: RemotePool, i: int) -> bool:
    return i in pool.live


def test_abandon_fails_the_calls_in_flight_as_lost_and_cancels_them_on_the_replica():
    driver = HeldDriver()
    server = serve(EngineHost(StandInEngine(), model="stand-in", driver=driver))

    async def main():
        client = RemoteEngineClient(server.url, replica=2, timeout_s=60)
        calls = [asyncio.ensure_future(client.generate([1], SAMPLING)) for _ in range(2)]
        while len(driver.futures) < 2:
            await asyncio.sleep(0.01)
        assert client.abandon("no answer to its health probe for 3.0 s") == 2
        out = await asyncio.gather(*calls, return_exceptions=True)
        while not all(f.cancelled() for f in driver.futures):  # their connections closed
            await asyncio.sleep(0.01)
        in_flight, alive = client.in_flight, client.alive
        await client.close()
        return out, in_flight, alive

    try:
        out, in_flight, alive = asyncio.run(main())
    finally:
        server.stop()
    assert all(isinstance(r, ReplicaLost) for r in out), out
    assert all(r.cause == "no answer to its health probe for 3.0 s" for r in out)
    assert "replica 2 at" in str(out[0]) and in_flight == 0 and not alive


def test_the_health_deadline_is_a_checked_setting():
    assert Processes().replica_health_timeout_s == 20.0
    with pytest.raises(ValueError, match="replica_health_timeout_s must be >= 1"):
        Processes(replica_health_timeout_s=0.5)
