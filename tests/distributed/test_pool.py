"""RemotePool: groups pinned to a replica move whole when it is lost, without failing a request;
weights reach every live replica; a lost replica that answers again gets the current weights
before it serves. Fake replica clients, then real HTTP replicas around stand-in drivers (a
real engine behind HTTP is tested in test_remote_replica.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest
from support.standin_replica import FakeOffer, HeldDriver, StandInEngine, serve

from jaxrl_orch.config.runtime import ProcessesSettings as Processes
from jaxrl_orch.distributed.pool import Deadlines, RemotePool
from jaxrl_orch.distributed.replica_client import ReplicaLost, WeightPullError
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.types import Completion, SamplingParams


class FakeReplica:
    def __init__(self, i: int) -> None:
        self.i, self.in_flight, self.up, self.loads, self.calls = i, 0, True, [], []
        self.address = f"addr{i}"
        self.fail_pull = False
        self.parts: list[tuple[str, int]] = []  # (part, version) of every load, in order

    async def generate(self, prompt_ids, sampling):
        self.calls.append(list(prompt_ids))
        self.in_flight += 1
        try:
            await asyncio.sleep(0.01)
            if not self.up:
                raise ReplicaLost(self.i, f"addr{self.i}", "connection refused")
            return Completion([self.i], [0.0], [self.loads[-1] if self.loads else -1], "stop")
        finally:
            self.in_flight -= 1

    async def health(self, timeout_s):
        version = self.loads[-1] if self.loads else -1
        return types.SimpleNamespace(engine_s=1.5, version=version) if self.up else None

    async def load_weights(self, version, uuid, timeout_s, *, extra_s, layout=None, part="weights"):
        if not self.up:
            raise ReplicaLost(self.i, f"addr{self.i}", "connection refused")
        if self.fail_pull:
            raise WeightPullError(self.i, version, "timed out")
        self.parts.append((part, version))
        if part == "base":  # kept, not served: the version stays
            return {"version": self.loads[-1] if self.loads else -1}
        self.loads.append(version)
        return {"version": version}

    def abandon(self, cause):
        return 0  # its requests fail on their own (``up``)

    async def close(self):
        pass


def make_pool(n: int = 2, **deadlines: float) -> tuple[RemotePool, list[FakeReplica]]:
    pool = RemotePool(
        [f"http://127.0.0.1:{i + 1}" for i in range(n)],
        FakeOffer(),
        Processes(replica_request_timeout_s=5, weight_pull_timeout_s=5, **deadlines),
        probe_interval_s=0.01,
    )
    fakes = [FakeReplica(i) for i in range(n)]
    pool.clients = fakes
    return pool, fakes


SAMPLING = SamplingParams(max_tokens=4)


async def _until(done, polls: int = 300) -> None:
    """Yield to the pool's watch until ``done()`` holds (the test's next assert says if not)."""
    for _ in range(polls):
        if done():
            return
        await asyncio.sleep(0.01)


def test_a_lost_replicas_group_moves_whole_and_no_request_fails():
    async def main():
        pool, fakes = make_pool()
        await pool.start(0, params="w0")
        assert [f.loads for f in fakes] == [[0], [0]] and pool.live == {0, 1}
        handle = pool.select()
        lost = fakes[handle.replica]
        lost.up = False  # dies with the group's requests in flight
        done = await asyncio.gather(*(handle.generate([1, 2], SAMPLING) for _ in range(4)))
        other = 1 - lost.i
        assert [c.token_ids for c in done] == [[other]] * 4  # all served by the other replica
        assert handle.replica == other and pool.live == {other}
        assert pool.lost_total == 1 and pool.reissued_total == 4
        assert pool.moved_groups_total == 1
        # New groups go to the live replica only.
        assert {pool.select().replica for _ in range(5)} == {other}

    asyncio.run(main())


def test_a_group_pinned_to_a_replica_lost_meanwhile_moves_before_sending_anything():
    async def main():
        pool, fakes = make_pool()
        await pool.start(0, params="w0")
        handle = pool.select()
        pinned = handle.replica
        pool._lose(pinned, "no answer to its health probe for 9.0 s")  # alive, but silent
        done = await asyncio.gather(*(handle.generate([1], SAMPLING) for _ in range(3)))
        assert [c.token_ids for c in done] == [[1 - pinned]] * 3
        assert fakes[pinned].calls == []  # nothing sent to a replica known to be lost
        assert pool.moved_groups_total == 1 and pool.reissued_total == 0

    asyncio.run(main())


def test_with_no_replica_live_a_group_waits_and_moves_once():
    async def main():
        pool, fakes = make_pool()
        await pool.start(0, params="w0")
        handle = pool.select()
        for i in (0, 1):
            pool._lose(i, "gone")
        calls = [asyncio.ensure_future(handle.generate([1], SAMPLING)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(c.done() for c in calls)  # waiting for a live replica
        pool.live.add(1)
        pool._changed.set()
        done = await asyncio.gather(*calls)
        assert [c.token_ids for c in done] == [[1]] * 3 and handle.replica == 1
        assert pool.moved_groups_total == 1  # one move for the group, not one per request

    asyncio.run(main())


def test_weights_reach_live_replicas_and_a_returning_one_loads_before_it_serves():
    async def main():
        pool, fakes = make_pool()
        await pool.start(0, params="w0")
        fakes[1].up = False
        await pool.load_weights(1, "w1")  # replica 1 is found lost here; 0 gets version 1
        assert fakes[0].loads == [0, 1] and pool.live == {0}
        watch = asyncio.ensure_future(pool.watch())
        fakes[1].up = True  # restarted
        await _until(lambda: 1 in pool.live)
        watch.cancel()
        assert pool.live == {0, 1} and pool.rejoined_total == 1
        assert fakes[1].loads == [0, 1]  # the current version, before it is live again
        assert pool.engine_seconds() == pytest.approx(3.0)  # both replicas' engine time

    asyncio.run(main())


def test_a_lora_pool_moves_the_base_once_per_replica_process_and_adapters_every_version():
    async def main():
        pool, fakes = make_pool()
        await pool.start(0, params="a0", base="base")
        await pool.load_weights(1, "a1")
        assert [f.parts for f in fakes] == [[("base", 0), ("adapters", 0), ("adapters", 1)]] * 2
        offered = list(pool.offer.offered)
        assert offered.count("base") == 2 and offered[-2:] == ["a1", "a1"]
        # Replica 1 restarts: a fresh process (version -1) pulls the base again, then the
        # adapters; replica 0, never lost, pulls only adapters.
        fakes[1].up = False
        await pool.load_weights(2, "a2")
        fakes[1].loads.clear()
        fakes[1].parts.clear()
        watch = asyncio.ensure_future(pool.watch())
        fakes[1].up = True
        await _until(lambda: 1 in pool.live)
        assert fakes[1].parts == [("base", 2), ("adapters", 2)]
        assert fakes[0].parts[-1] == ("adapters", 2) and len(fakes[0].parts) == 4
        # Replica 0 stops answering and comes back as the same process (SIGSTOP, SIGCONT): it
        # still holds the base, so it pulls only the current adapters.
        fakes[0].up = False
        await pool.load_weights(3, "a3")
        fakes[0].up = True
        await _until(lambda: 0 in pool.live)
        watch.cancel()
        assert fakes[0].parts[4:] == [("adapters", 3)] and pool.rejoined_total == 2

    asyncio.run(main())


def test_a_live_replica_silent_past_the_health_deadline_is_lost_and_rejoins_when_it_answers(
    capsys,
):
    async def main():
        pool, fakes = make_pool(replica_health_timeout_s=1.0)  # the least allowed
        await pool.start(0, params="w0")
        watch = asyncio.ensure_future(pool.watch())
        fakes[1].up = False  # no health answers (and no request in flight to fail)
        await _until(lambda: pool.live == {0})
        lost = (set(pool.live), pool.lost_total)
        await pool.load_weights(1, "w1")
        fakes[1].up = True
        await _until(lambda: 1 in pool.live)
        watch.cancel()
        return pool, fakes, lost

    pool, fakes, lost = asyncio.run(main())
    assert lost == ({0}, 1)  # replica 0, answering, stays live
    out = capsys.readouterr().out
    assert "engine replica 1 (addr1) lost: no answer to its health probe for " in out
    assert pool.live == {0, 1} and pool.rejoined_total == 1 and pool.lost_total == 1
    assert fakes[1].loads == [0, 1]  # the current version before it serves again


def test_a_failed_pull_fails_loudly_naming_replica_and_version():
    async def main():
        pool, fakes = make_pool()
        await pool.start(0, params="w0")
        fakes[0].fail_pull = True
        with pytest.raises(WeightPullError, match="replica 0.*version 3"):
            await pool.load_weights(3, "w3")

    asyncio.run(main())


def test_start_names_the_replicas_that_never_answer():
    async def main():
        pool, fakes = make_pool(replica_start_timeout_s=0.3)
        fakes[1].up = False
        with pytest.raises(TimeoutError, match=r"engine replicas 1 \(addr1\) did not answer"):
            await pool.start(0, params="w0")

    asyncio.run(main())


def test_a_replica_stopping_under_a_group_over_http_moves_it_and_no_request_fails():
    # Replica 0 holds every request until its server stops under them; replica 1 answers at once.
    held, quick = HeldDriver(version=3), HeldDriver(version=3, answer=42)
    servers = [serve(EngineHost(StandInEngine(), model="m", driver=d)) for d in (held, quick)]

    async def main():
        deadlines = Processes(replica_request_timeout_s=30, weight_pull_timeout_s=5)
        pool = RemotePool([s.url for s in servers], FakeOffer(), deadlines)
        pool.live, pool._current = {0, 1}, (3, "w3")  # as if start() had loaded version 3
        handle = pool.select()
        while handle.replica != 0:
            handle = pool.select()
        calls = [asyncio.ensure_future(handle.generate([1, 2], SAMPLING)) for _ in range(3)]
        while len(held.futures) < 3:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(servers[0].stop)
        done = await asyncio.gather(*calls)
        await pool.close()
        return pool, handle, done

    try:
        pool, handle, done = asyncio.run(main())
    finally:
        for s in servers:
            s.stop()
    assert [c.token_ids for c in done] == [[42]] * 3 and all(c.versions == [3] for c in done)
    assert handle.replica == 1 and pool.live == {1} and pool.lost_total == 1
    assert pool.reissued_total == 3 and pool.moved_groups_total == 1
    assert len(quick.futures) == 3  # each request re-issued once, on the live replica


def test_every_deadline_the_pool_reads_is_a_setting_of_the_processes_section():
    settings = {f.name: f.type for f in dataclasses.fields(Processes)}
    assert {k: settings.get(k) for k in Deadlines.__annotations__} == dict.fromkeys(
        Deadlines.__annotations__, "float"
    )
