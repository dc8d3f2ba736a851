"""The server is safe by default: loopback unless keyed, and no request keeps a slot it gave up.

One tiny engine and host for the module. Binding refusals happen before anything binds; a
keyed server on 0.0.0.0 answers only with the key (``/health`` aside); a client that hangs up
mid-request, or a request past ``request_timeout_s``, frees its slot. The engine is held at a
decode call (``HeldEngine``) meanwhile, so the slot is provably freed by the cancellation and
not by the request running to its end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest
from support.serving import MODEL, Served, tiny_engine, until

from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.contract import GENERATE
from jaxrl_orch.serving.guard import CONTROL, Limits
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer

pytestmark = pytest.mark.timeout(120)

KEY = "s3cret-key"
BODY = {"model": MODEL, "token_ids": [3, 1, 4], "sampling_params": {"max_tokens": 48}}


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    s = Served(EngineHost(engine, model=MODEL, params=engine.load_params(seed=0)))
    yield s
    engine.release()
    s.close()


def _slots_free(host) -> bool:
    return host.in_flight == 0 and host.gauges()["inference/active_slots"] == 0


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.168.0.7", "example.org"])
def test_a_non_loopback_bind_without_a_key_is_refused_before_binding(served, address):
    with pytest.raises(ValueError, match="without an API key") as err:
        HttpServer(make_app(served.host), host=address)
    assert repr(address) in str(err.value)
    for loopback in ("127.0.0.1", "::1", "localhost"):
        HttpServer.check_bind(loopback, None)  # no error


def test_a_key_given_to_the_server_but_not_the_app_is_refused(served):
    with pytest.raises(ValueError, match="checks no API key"):
        HttpServer(make_app(served.host), host="0.0.0.0", api_key=KEY)


def test_a_keyed_server_binds_every_address_and_answers_only_with_the_key(served):
    server = HttpServer(make_app(served.host, api_key=KEY), host="0.0.0.0", api_key=KEY)
    server.start_in_thread()
    try:
        url = f"http://127.0.0.1:{server.port}"
        keyed = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/v1/models", headers=keyed).status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}).status_code == 401
        assert served.host.paused is False
        assert httpx.get(f"{url}/health").json()["status"] == "ok"  # probes need no key
    finally:
        server.stop()
    assert not any(t.name == f"http-{server.port}" for t in threading.enumerate())


def test_a_server_withholding_its_control_routes_refuses_them_key_or_not(served):
    app = make_app(served.host, api_key=KEY, withhold_control="Engine.serve_control")
    server = HttpServer(app, host="0.0.0.0", api_key=KEY).start_in_thread()
    try:
        url = f"http://127.0.0.1:{server.port}"
        keyed = {"Authorization": f"Bearer {KEY}"}
        for method, path in CONTROL:
            for headers in (keyed, {}, {"Authorization": "Bearer wrong"}):
                r = httpx.request(method, f"{url}{path}", headers=headers, json={})
                assert r.status_code == 403, (path, headers, r.text)
                message = r.json()["error"]["message"]
                assert message.startswith(f"{method} {path} is refused to every caller")
                assert "Engine.serve_control = True hands them out" in message
        assert served.host.paused is False
        assert httpx.get(f"{url}/is_paused", headers=keyed).json() == {"is_paused": False}
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key still guards the rest
        r = httpx.post(f"{url}/inference/v1/generate", headers=keyed, json=BODY)
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_every_route_that_changes_the_engine_is_a_control_route(served):
    """A state-changing route added later must be declared in ``CONTROL`` (or be one of the
    routes that only generate), so a server withholding control withholds it too."""
    generating = {GENERATE.path, "/v1/completions", "/v1/chat/completions"}
    served_routes = make_app(served.host).state.routes
    assert set(CONTROL) <= served_routes and ("POST", GENERATE.path) in served_routes
    changing = {
        (m, p) for m, p in served_routes if m not in ("GET", "HEAD") and p not in generating
    }
    assert changing == set(CONTROL)


def test_a_taken_port_fails_in_the_caller(served):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            HttpServer(make_app(served.host), port=taken.getsockname()[1]).start_in_thread()


def test_a_client_that_hangs_up_frees_its_slot(served):
    engine, host = served.host.engine, served.host
    engine.hold(after=1)
    body = json.dumps(BODY).encode()
    head = (
        f"POST /inference/v1/generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", served.server.port)) as client:
        client.sendall(head + body)
        engine.wait_held()
        assert host.in_flight == 1 and host.gauges()["inference/active_slots"] == 1
    # The engine is still held: only the cancellation can have ended the sample.
    until(lambda: host.in_flight == 0, what="the hung-up request cancelled")
    engine.release()
    until(lambda: _slots_free(host), what="its slot freed")
    assert served.generate([3, 1, 4], max_tokens=4)["choices"][0]["finish_reason"] == "length"


def test_a_request_past_the_timeout_fails_504_and_frees_its_slot(served):
    engine, host = served.host.engine, served.host
    impatient = Served(host, limits=Limits(request_timeout_s=0.5))
    try:
        engine.hold(after=0)
        r = impatient.client.post("/inference/v1/generate", json=BODY)
        assert r.status_code == 504 and "timeout_s=0.5" in r.json()["error"]["message"]
        assert host.in_flight == 0
        engine.release()
        until(lambda: _slots_free(host), what="its slot freed")
    finally:
        engine.release()
        impatient.client.close()
        impatient.server.stop()  # the host is the module's: not stopped here


def test_serve_runs_in_the_callers_loop_until_stop(served):
    server = HttpServer(make_app(served.host))
    assert server.port is None and server.url is None

    async def main():
        serving = asyncio.ensure_future(server.serve())
        while server.port is None:
            assert not serving.done(), serving
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=server.url) as client:
            health = (await client.get("/health")).json()
        server.stop()
        await asyncio.wait_for(serving, 30)
        return health

    assert asyncio.run(main())["ready"] is True
