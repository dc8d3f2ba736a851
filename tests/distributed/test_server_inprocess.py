"""A replica's HTTP server (``EngineHost`` + ``make_app`` + ``HttpServer``) and
``RemoteEngineClient`` in one process, around a stand-in engine and driver
(``support.standin_replica``): the contracts a real
engine would make slow or racy to show (cancellation reaches the driver future, the queue bound,
engine errors, a server shutting down under a call, the API key, how weight updates fail)."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
import uvicorn
from aiohttp import web
from support.standin_replica import HeldDriver as _Driver
from support.standin_replica import StandInEngine as _Engine
from support.standin_replica import serve as _serve

from jaxrl_orch.config.runtime import ProcessesSettings as Processes
from jaxrl_orch.distributed.replica import replica_server
from jaxrl_orch.distributed.replica_client import (
    KEEPALIVE_S,
    RemoteEngineClient,
    ReplicaLost,
    WeightPullError,
)
from jaxrl_orch.serving.contract import GENERATE
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.types import Completion, SamplingParams

pytestmark = pytest.mark.timeout(60)

REQUEST_S = 30.0  # a generate request's deadline, past what any test here waits for
PROBE_S = 5.0  # a health probe's
EXTRA_S = 5.0  # how much longer than its pull a weight update's request may take


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_deadline_and_task_cancel_cancel_the_driver_future_and_the_bound_holds():
    driver = _Driver()
    host = EngineHost(_Engine(), model="stand-in", driver=driver, max_queued=2)
    server = _serve(host)

    async def main():
        quick = RemoteEngineClient(server.url, replica=3, timeout_s=0.3)
        with pytest.raises(RuntimeError, match="replica 3 .*no answer within timeout_s=0.3"):
            await quick.generate([1, 2], SamplingParams())
        await _until(lambda: driver.futures[0].cancelled())  # the slot would free
        client = RemoteEngineClient(server.url, replica=3, timeout_s=REQUEST_S)
        sampling = SamplingParams(temperature=0.5, top_k=7, max_tokens=9, seed=11)
        a = asyncio.ensure_future(client.generate([1], sampling))
        b = asyncio.ensure_future(client.generate([2], SamplingParams()))
        await _until(lambda: host.in_flight == 2)
        assert client.in_flight == 2
        with pytest.raises(RuntimeError, match="HTTP 429.*max_queued=2") as busy:
            await client.generate([3], SamplingParams())
        assert not isinstance(busy.value, ReplicaLost)
        a.cancel()  # the caller's task gives up: the replica's future follows
        await _until(lambda: any(f.cancelled() for f in driver.futures[1:]))
        (live,) = [f for f in driver.futures[1:] if not f.cancelled()]
        live.set_result(Completion([7, 8], [float("nan"), -0.5], [5, 6], "stop"))
        done = await b
        await _until(lambda: host.in_flight == 0)
        await quick.close()
        await client.close()
        return done, sampling

    try:
        done, sampling = asyncio.run(main())
    finally:
        server.stop()
    assert done.token_ids == [7, 8] and done.versions == [5, 6] and done.finish_reason == "stop"
    assert math.isnan(done.logprobs[0]) and done.logprobs[1] == -0.5
    assert sampling in driver.samplings  # every field the client sent arrived as it was


def test_engine_error_is_a_runtime_error_and_shutdown_is_replica_lost():
    driver = _Driver()
    host = EngineHost(_Engine(), model="stand-in", driver=driver)
    server = _serve(host)
    url = server.url

    async def main():
        client = RemoteEngineClient(url, replica=3, timeout_s=REQUEST_S)
        call = asyncio.ensure_future(client.generate([1], SamplingParams()))
        await _until(lambda: len(driver.futures) == 1)
        driver.futures[0].set_exception(ValueError("cache exploded"))
        with pytest.raises(RuntimeError, match="HTTP 500.*generation failed: ValueError: cache"):
            await call
        assert client.alive
        call = asyncio.ensure_future(client.generate([1], SamplingParams()))
        await _until(lambda: len(driver.futures) == 2)
        await asyncio.to_thread(server.stop)  # shuts down under the call
        with pytest.raises(ReplicaLost, match=f"replica 3 at {url} is lost"):
            await call
        assert not client.alive
        assert await client.health(0.5) is None
        with pytest.raises(ReplicaLost, match="ClientConnectorError"):  # refused now
            await client.generate([1], SamplingParams())
        await client.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_api_key_is_required_by_the_replica_and_sent_by_the_client():
    driver = _Driver()
    server = _serve(EngineHost(_Engine(), model="stand-in", driver=driver), api_key="s3cret")

    async def main():
        keyed = RemoteEngineClient(server.url, replica=0, timeout_s=REQUEST_S, api_key="s3cret")
        bare = RemoteEngineClient(server.url, replica=0, timeout_s=REQUEST_S)
        call = asyncio.ensure_future(keyed.generate([1], SamplingParams()))
        await _until(lambda: len(driver.futures) == 1)
        driver.futures[0].set_result(Completion([4], [-1.0], [5], "length"))
        done = await call
        with pytest.raises(RuntimeError, match="HTTP 401: missing API key") as refused:
            await bare.generate([1], SamplingParams())
        health = await bare.health(PROBE_S)  # a pool probes without the key
        await keyed.close()
        await bare.close()
        return done, refused.value, health

    try:
        done, refused, health = asyncio.run(main())
    finally:
        server.stop()
    assert done.token_ids == [4] and not isinstance(refused, ReplicaLost)
    assert health.version == 5 and len(driver.futures) == 1


def test_weight_updates_pull_only_from_the_bound_source_and_failures_are_weight_pull_errors():
    calls = []

    def source(uuid, layout, timeout_s):
        calls.append((uuid, layout, timeout_s))
        if uuid == 1:
            raise TimeoutError("nothing offered under uuid 1")
        raise OSError("transfer server gone")

    sourced = _serve(EngineHost(_Engine(), model="stand-in", source=source))
    fixed = _serve(EngineHost(_Engine(), model="stand-in", driver=_Driver()))

    async def main():
        client = RemoteEngineClient(sourced.url, replica=2, timeout_s=REQUEST_S)
        async with aiohttp.ClientSession(sourced.url) as http:
            body = {"version": 1, "uuid": 1, "timeout_s": 1.0, "address": "10.0.0.9:1234"}
            async with http.post("/update_weights", json=body) as r:
                refused = r.status, (await r.json())["error"]
        with pytest.raises(WeightPullError, match="version 1 .*HTTP 504.*uuid=1") as timed_out:
            await client.load_weights(
                1, 1, timeout_s=2.0, extra_s=EXTRA_S, layout={"mesh": {"tp": 1}}
            )
        with pytest.raises(WeightPullError, match="HTTP 500.*OSError: transfer server gone"):
            await client.load_weights(2, 2, timeout_s=3.0, extra_s=EXTRA_S)
        with pytest.raises(WeightPullError, match="HTTP 409.*without a weight source"):
            await RemoteEngineClient(fixed.url, replica=4, timeout_s=REQUEST_S).load_weights(
                6, 9, timeout_s=1.0, extra_s=EXTRA_S
            )
        health = await client.health(PROBE_S)
        await client.close()
        return refused, timed_out.value, health

    try:
        (status, error), timed_out, health = asyncio.run(main())
    finally:
        sourced.stop()
        fixed.stop()
    assert (
        status == 400
        and error["param"] == "address"
        and "unknown key 'address'" in error["message"]
    )
    assert (timed_out.replica, timed_out.version) == (2, 1)
    # The source saw the offers the updates named and nothing of the refused body.
    assert calls == [(1, {"mesh": {"tp": 1}}, 2.0), (2, None, 3.0)]
    assert health.version == -1 and not health.ready


def test_loads_without_the_key_are_refused_counted_and_never_reach_the_source():
    calls = []

    def source(uuid, layout, timeout_s):
        calls.append(uuid)
        raise TimeoutError(f"nothing offered under uuid {uuid}")

    server = _serve(EngineHost(_Engine(), model="stand-in", source=source), api_key="s3cret")

    async def main():
        outsiders = [
            RemoteEngineClient(server.url, replica=0, timeout_s=REQUEST_S),
            RemoteEngineClient(server.url, replica=0, timeout_s=REQUEST_S, api_key="a-guess"),
        ]
        for client in outsiders:
            # A far-future version with an unbounded pull: were it taken, the trainer's next
            # load would go backwards, and the load lock would be held for 11 days.
            with pytest.raises(WeightPullError, match="HTTP 401") as refused:
                await client.load_weights(10**6, 7, timeout_s=10**6, extra_s=EXTRA_S)
            assert not isinstance(refused.value, ReplicaLost)
        trainer = RemoteEngineClient(server.url, replica=0, timeout_s=REQUEST_S, api_key="s3cret")
        with pytest.raises(WeightPullError, match="HTTP 504.*uuid=8"):
            await trainer.load_weights(
                1, 8, timeout_s=0.5, extra_s=EXTRA_S
            )  # the key reaches the source
        health = await outsiders[0].health(PROBE_S)
        auth = {"Authorization": "Bearer s3cret"}
        async with (
            aiohttp.ClientSession(server.url, headers=auth) as http,
            http.get("/metrics") as r,
        ):
            text = await r.text()
        for client in [*outsiders, trainer]:
            await client.close()
        return health, text

    try:
        health, text = asyncio.run(main())
    finally:
        server.stop()
    assert calls == [8]  # only the keyed load reached the source
    assert health.version == -1 and not health.ready
    assert 'jaxrl_http_requests_total{route="/update_weights",status="401"} 2.0' in text
    assert 'jaxrl_http_requests_total{route="/update_weights",status="504"} 1.0' in text


def test_the_client_drops_idle_connections_before_the_server_does():
    # Otherwise a POST could go out on a connection uvicorn is closing, and fail as a loss.
    assert uvicorn.Config(app=None).timeout_keep_alive > KEEPALIVE_S


def test_an_answer_without_a_version_per_token_is_refused_by_name():
    """The staleness bound reads each token's version: an engine that answers without them (a
    plain vLLM server, say) must not be taken as serving version 0."""
    choice = {
        "token_ids": [5, 6],
        "logprobs": {"content": [{"token": "token_id:5", "logprob": -1.0}] * 2},
        "finish_reason": "length",
    }
    answers = [
        {"choices": [choice]},
        {"choices": [{**choice, "policy_versions": [3]}]},
        {"choices": [{**choice, "policy_versions": [3, 3]}]},
    ]

    async def generate(_request):
        return web.json_response(answers.pop(0))

    async def main():
        app = web.Application()
        app.router.add_post(GENERATE.path, generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = RemoteEngineClient(url, replica=7, timeout_s=REQUEST_S)
        try:
            errors = []
            for _ in range(2):
                with pytest.raises(RuntimeError) as err:
                    await client.generate([1], SamplingParams())
                errors.append(str(err.value))
            return errors, await client.generate([1], SamplingParams())
        finally:
            await client.close()
            await runner.cleanup()

    errors, done = asyncio.run(main())
    for err in errors:
        assert "replica 7 at http://127.0.0.1:" in err and GENERATE.path in err, err
        assert "policy_versions with one version per token" in err, err
    assert done.versions == [3, 3] and done.token_ids == [5, 6]


def test_a_replica_pulls_with_the_runs_transport_and_key_and_bounds_its_pulls_by_the_run():
    processes = Processes(
        weight_transport="jax", weight_pull_timeout_s=7.0, weight_load_extra_s=2.0
    )
    host, server = replica_server(
        _Engine(),
        replica=0,
        model="stand-in",
        bind=("127.0.0.1", 0),
        weight_source="127.0.0.2:8470",
        processes=processes,
        api_key="run key",
    )
    source = host._source
    assert (source.transport, source.address, source.host) == ("jax", "127.0.0.2:8470", "127.0.0.1")
    assert source._api_key == "run key"
    assert server.app.state.limits.max_pull_s == 9.0 == processes.max_pull_s
    default = replica_server(
        _Engine(),
        replica=0,
        model="stand-in",
        bind=("127.0.0.1", 0),
        weight_source="127.0.0.2:8470",
        processes=Processes(),
    )[0]
    assert default._source.transport == "http"
