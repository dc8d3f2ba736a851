"""Replicas that join and leave a running pool (``membership``, ``admission``), over real HTTP.

The pool is the one a run's trainer process 0 holds, behind the run's real weight server
(``HttpWeightOffer`` with its ``JoinDesk``), and the replicas are stand-in processes
(``support.standin_process``: a replica's server, its weight-update path and its ``RunLink`` to
the run, no JAX engine). A replica started with ``--join`` asks the weight server to admit it,
and SIGTERM has it ask to be drained, as a real replica does (the real runs are in
test_join_e2e). Refusals: a wrong key, the wrong model, a replica that does not take the run's
key or does not answer, a run without a key: each refused, counted and said, the run going on.
"""

from __future__ import annotations

import asyncio
import time

import jax.numpy as jnp
import pytest
from support.standin_process import StandInProcess

from jaxrl_orch.config.runtime import ProcessesSettings as Processes
from jaxrl_orch.distributed.admission import DRAIN, JOIN, JoinDesk, JoinRefused, ask
from jaxrl_orch.distributed.offer_server import HttpWeightOffer
from jaxrl_orch.distributed.pool import RemotePool
from jaxrl_orch.types import SamplingParams

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

KEY = "the-runs-key"
SAMPLING = SamplingParams(max_tokens=4)


def _key_file(tmp_path, key: str = KEY) -> str:
    path = tmp_path / f"{key}.key"
    path.write_text(key)
    path.chmod(0o600)
    return str(path)


def _weights(v: int) -> dict:
    return {"w": jnp.full((2,), float(v))}


@pytest.fixture
def run_server():
    """The run's weight server taking joins, with the run's key: ``(offer, desk)``."""
    desk = JoinDesk(has_key=True)
    offer = HttpWeightOffer(api_key=KEY, desk=desk)
    yield offer, desk
    offer.close()


async def _started(urls, offer, desk, **deadlines: float) -> tuple[RemotePool, asyncio.Future]:
    """A pool over ``urls`` serving model 'stand-in', probing every 0.1 s, at version 3."""
    settings = Processes(replica_request_timeout_s=30, **deadlines)
    pool = RemotePool(
        urls, offer, settings, probe_interval_s=0.1, api_key=KEY, model="stand-in", desk=desk
    )
    await pool.start(3, _weights(3))
    return pool, asyncio.ensure_future(pool.watch())


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


async def _on(pool: RemotePool, replica: int):
    handle = pool.select()
    while handle.replica != replica:
        handle = pool.select()
    return handle


def test_a_replica_joins_at_the_current_version_then_serves(run_server, tmp_path, capsys):
    offer, desk = run_server
    key = _key_file(tmp_path)
    first = StandInProcess(40, False, "--key-file", key).wait_ready()
    joiner = StandInProcess(41, False, "--key-file", key, "--run", offer.address, "--join")

    async def main():
        pool, watch = await _started([first.url], offer, desk)
        await pool.load_weights(4, _weights(4))
        await asyncio.to_thread(joiner.wait_ready)
        await _until(lambda: 1 in pool.live, "the joiner is live")
        done = await (await _on(pool, 1)).generate([1, 2], SAMPLING)
        await pool.load_weights(5, _weights(5))  # it is loaded like every live replica now
        later = await (await _on(pool, 1)).generate([1, 2], SAMPLING)
        watch.cancel()
        await pool.close()
        return pool, done, later

    try:
        pool, done, later = asyncio.run(main())
    finally:
        first.kill()
        joiner.kill()
    out = capsys.readouterr().out
    assert f"== engine replica 1 ({joiner.url}) admitted: loading version 4" in out
    assert f"== engine replica 1 ({joiner.url}) joined at version 4; 2 replica(s) serve" in out
    assert done.token_ids == [41] and done.versions == [4] and later.versions == [5]
    member = pool.members()[1]
    assert member["joined_at_version"] == 4 and member["first_served_version"] == 4
    assert pool.joined_total == 1 and pool.gauges()["replicas/joined_total"] == 1.0
    assert "admitted as replica 1" in joiner.said()


def test_a_joiner_that_a_new_version_overtakes_loads_it_too_before_it_serves(
    run_server, tmp_path, capsys
):
    offer, desk = run_server
    key = _key_file(tmp_path)
    first = StandInProcess(40, False, "--key-file", key).wait_ready()
    run = ("--run", offer.address, "--join")
    joiner = StandInProcess(41, False, "--key-file", key, "--pull-delay", "1.5", *run)

    async def main():
        pool, watch = await _started([first.url], offer, desk)
        await asyncio.to_thread(joiner.wait_ready)
        await _until(lambda: len(pool.clients) == 2, "the joiner admitted")
        await pool.load_weights(4, _weights(4))  # while it loads version 3
        picked = set()
        while 1 not in pool.live:  # no group goes to it until it holds version 4
            picked.add(pool.select().replica)
            await asyncio.sleep(0.02)
        done = await (await _on(pool, 1)).generate([1], SAMPLING)
        watch.cancel()
        await pool.close()
        return pool, picked, done

    try:
        pool, picked, done = asyncio.run(main())
    finally:
        first.kill()
        joiner.kill()
    out = capsys.readouterr().out
    assert f"== engine replica 1 ({joiner.url}) admitted: loading version 3" in out
    assert f"== engine replica 1 ({joiner.url}) joined at version 4" in out
    assert picked == {0} and done.versions == [4]
    assert pool.members()[1]["joined_at_version"] == 4


def test_a_drained_replica_finishes_what_it_holds_moves_its_groups_and_exits_0(
    run_server, tmp_path, capsys
):
    offer, desk = run_server
    key = _key_file(tmp_path)
    slow = StandInProcess(40, False, "--key-file", key, "--delay", "2", "--run", offer.address)
    quick = StandInProcess(41, False, "--key-file", key)
    slow.wait_ready()
    quick.wait_ready()

    async def main():
        pool, watch = await _started([slow.url, quick.url], offer, desk, replica_health_timeout_s=1)
        handle = await _on(pool, 0)
        held = [asyncio.ensure_future(handle.generate([1, i], SAMPLING)) for i in range(3)]
        await _until(lambda: pool.clients[0].in_flight == 3, "3 requests on replica 0")
        slow.proc.terminate()  # SIGTERM: the replica asks the run to drain it
        await _until(lambda: 0 in pool.draining, "replica 0 draining")
        picked = {pool.select().replica for _ in range(20)}
        moved = await handle.generate([1, 9], SAMPLING)  # the group's next request moves
        finished = await asyncio.gather(*held)
        await _until(lambda: 0 in pool.left, "replica 0 left")
        code = await asyncio.to_thread(slow.proc.wait, 30)
        await asyncio.sleep(1.5)  # past the health deadline: a replica that left is not probed
        watch.cancel()
        await pool.close()
        return pool, picked, moved, finished, code

    try:
        pool, picked, moved, finished, code = asyncio.run(main())
    finally:
        slow.kill()
        quick.kill()
    assert picked == {1}  # no new group went to the draining replica
    assert moved.token_ids == [41]
    assert [c.token_ids for c in finished] == [[40]] * 3  # they finished there, not re-sent
    assert code == 0
    assert (pool.reissued_total, pool.moved_groups_total, pool.lost_total) == (0, 1, 0)
    assert pool.drained_total == 1 and pool.live == {1} and pool.members()[0]["state"] == "left"
    out = capsys.readouterr().out
    assert f"== engine replica 0 ({slow.url}) draining: no new groups" in out
    assert f"== engine replica 0 ({slow.url}) drained at version 3 and left; 1 replica(s)" in out
    assert "drained: it may exit" in slow.said()


def test_the_last_replica_taking_groups_is_not_drained(run_server, tmp_path, capsys):
    offer, desk = run_server
    only = StandInProcess(40, False, "--key-file", _key_file(tmp_path)).wait_ready()

    async def main():
        pool, watch = await _started([only.url], offer, desk)
        with pytest.raises(JoinRefused) as refused:
            await ask(DRAIN, offer.address, only.url, KEY, 10)
        watch.cancel()
        await pool.close()
        return pool, refused.value

    try:
        pool, refused = asyncio.run(main())
    finally:
        only.kill()
    assert refused.status == 409 and "the only replica taking new groups" in refused.message
    assert pool.live == {0} and pool.drained_total == 0
    assert f"!! engine replica 0 ({only.url}) not drained" in capsys.readouterr().out


def test_joins_with_a_wrong_key_or_model_are_refused_counted_and_the_run_goes_on(
    run_server, tmp_path, capsys
):
    offer, desk = run_server
    key, wrong = _key_file(tmp_path), _key_file(tmp_path, "not-the-runs-key")
    serving = StandInProcess(40, False, "--key-file", key).wait_ready()
    run = ("--run", offer.address, "--join")
    wrong_key = StandInProcess(42, False, "--key-file", wrong, *run)
    wrong_model = StandInProcess(43, False, "--key-file", key, "--model", "other", *run)
    other_key = StandInProcess(44, False, "--key-file", wrong)  # takes another key

    async def main():
        pool, watch = await _started([serving.url], offer, desk)
        codes = []
        for p in (wrong_key, wrong_model, other_key):
            await asyncio.to_thread(p.wait_ready)
        for p in (wrong_key, wrong_model):
            codes.append(await asyncio.to_thread(p.proc.wait, 30))
        with pytest.raises(JoinRefused) as not_keyed:  # the run's key, a replica without it
            await ask(JOIN, offer.address, other_key.url, KEY, 10)
        with pytest.raises(JoinRefused) as silent:
            await ask(JOIN, offer.address, "http://127.0.0.1:9", KEY, 10)
        done = await pool.select().generate([1], SAMPLING)  # the run goes on
        watch.cancel()
        await pool.close()
        return pool, codes, not_keyed.value, silent.value, done

    try:
        pool, codes, not_keyed, silent, done = asyncio.run(main())
    finally:
        for p in (serving, wrong_key, wrong_model, other_key):
            p.kill()
    assert codes == [3, 3]
    assert "REFUSED HTTP 401: wrong API key" in wrong_key.said()
    said = wrong_model.said()
    assert "REFUSED HTTP 403: it serves model 'other', the run trains 'stand-in'" in said
    assert not_keyed.status == 403 and "does not take the run's API key" in not_keyed.message
    assert silent.status == 403 and "does not answer GET /health" in silent.message
    assert done.token_ids == [40] and pool.live == {0} and len(pool.clients) == 1
    assert desk.refused_total == 4 and pool.gauges()["replicas/join_refused_total"] == 4.0
    out = capsys.readouterr().out
    for url, why in [
        (wrong_key.url, "401: wrong API key"),
        (wrong_model.url, "403: it serves model 'other'"),
        (other_key.url, "403: replica -1 at"),
        ("http://127.0.0.1:9", "403: it does not answer GET /health"),
    ]:
        assert f"!! engine replica join refused: {url}: {why}" in out, (url, out)


def test_a_run_without_a_key_takes_no_joins(capsys):
    desk = JoinDesk(has_key=False)
    offer = HttpWeightOffer(desk=desk)

    async def main():
        with pytest.raises(JoinRefused) as refused:
            await ask(JOIN, offer.address, "http://127.0.0.1:9", None, 10)
        return refused.value

    try:
        refused = asyncio.run(main())
    finally:
        offer.close()
    assert refused.status == 403 and "this run has no API key" in refused.message
    assert desk.refused_total == 1
    assert "!! engine replica join refused: http://127.0.0.1:9: 403: this run has no API" in (
        capsys.readouterr().out
    )
