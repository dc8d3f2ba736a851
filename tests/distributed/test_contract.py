"""The pool's client and a replica's server speak one contract (``serving.contract``).

A replica's app (``make_app`` around a stand-in host that "pulls" any offer at once) serves
every route of the contract, with its method and no other. The pool's client
(``RemoteEngineClient``) then calls it through a recorder that keeps every exchange as it
crossed the wire: each request the client sent is a route of the contract and its body
validates against the server's own model of that route; each answer holds exactly the keys of
its reply model (the generate answer is written by hand on the server, for speed). Either side
drifting from the contract fails here. The contract module and the client import no server
stack.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from support.checkout import subprocess_env
from support.standin_process import TimedDriver
from support.standin_replica import StandInEngine

from jaxrl_orch.distributed.replica_client import RemoteEngineClient
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.contract import ROUTES
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer
from jaxrl_orch.types import SamplingParams

pytestmark = pytest.mark.timeout(60)


class StandInHost(EngineHost):
    def _start_driver(self, params, version):
        return TimedDriver(version, answer=7, hold=False)


def _host() -> StandInHost:
    return StandInHost(StandInEngine(), model="stand-in", source=lambda uuid, layout, s: {})


class Recorder:
    """An ASGI wrapper keeping each exchange: method, path, request and answer bytes, status."""

    def __init__(self, app) -> None:
        self.app = app
        self.exchanges: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = {"method": scope["method"], "path": scope["path"], "request": b"", "answer": b""}
        self.exchanges.append(seen)

        async def recorded_receive():
            message = await receive()
            seen["request"] += message.get("body", b"")
            return message

        async def recorded_send(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["answer"] += message.get("body", b"")
            await send(message)

        await self.app(scope, recorded_receive, recorded_send)


def test_every_route_of_the_contract_is_served_with_its_method_only():
    server = HttpServer(make_app(_host()), port=0, grace_s=0.2).start_in_thread()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for route in ROUTES:
                own = http.request(route.method, route.path, json={})  # a bad body at most
                other = http.request("PUT", route.path, json={})
                assert own.status_code not in (404, 405), (route, own.text)
                assert other.status_code == 405, (route, other.text)
    finally:
        server.stop()


def test_what_the_client_sends_and_reads_is_what_the_server_takes_and_writes():
    recorder = Recorder(make_app(_host()))
    server = HttpServer(recorder, port=0, grace_s=0.2).start_in_thread()

    async def main():
        client = RemoteEngineClient(server.url, replica=0, timeout_s=30.0)
        try:
            assert (await client.health(5.0)).version == -1
            loaded = await client.load_weights(4, 11, 5.0, extra_s=5.0, layout={"mesh": {}})
            sampling = SamplingParams(temperature=0.5, top_k=3, max_tokens=2, seed=9)
            done = await client.generate([1, 2, 3], sampling)
            return loaded, done
        finally:
            await client.close()

    try:
        loaded, done = asyncio.run(main())
    finally:
        server.stop()
    assert loaded.version == 4 and done.token_ids == [7] and done.versions == [4]
    routes = {(r.method, r.path): r for r in ROUTES}
    called = [(x["method"], x["path"]) for x in recorder.exchanges]
    assert sorted(called) == sorted(routes), called  # each route of the contract, no other
    for seen in recorder.exchanges:
        route = routes[(seen["method"], seen["path"])]
        assert seen["status"] == 200, seen
        if route.request is not None:  # strict, unknown keys refused: as the server reads it
            route.request.model_validate_json(seen["request"])
        answer = json.loads(seen["answer"])
        as_read = route.reply.model_validate(answer).model_dump(mode="json")
        assert as_read == answer, f"{route.path}: the answer and its reply model differ"


def test_the_contract_and_the_client_need_no_server_stack():
    code = (
        "import sys\n"
        "import jaxrl_orch.serving.contract, jaxrl_orch.distributed.replica_client\n"
        "print(sorted({'fastapi', 'starlette', 'uvicorn'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
