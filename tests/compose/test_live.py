"""``Engine.serve_port``: the policy being trained served over HTTP from the RL stage's own driver.

On the hand-calculable ToyEngine (greedy tokens count upwards shifted by the params version): a
response names the version that produced each token, and a weight swap by the trainer's path
(``swap_params`` on the shared driver) shows in the very next response; the live server binds
loopback only. Its control routes (pause, resume, weight updates) are refused to every caller
unless ``Engine.serve_control`` hands them out; a caller's pause is then reported (a console line
each way, the gauges, ``held()`` naming the caller).
"""

from __future__ import annotations

import httpx
import pytest
from support.toy_engine import ToyEngine

from jaxrl_orch.compose.live import serve_live_policy
from jaxrl_orch.config.load import make_config
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.serving.guard import CONTROL

UPDATE = {"version": 2, "uuid": 1, "timeout_s": 30}


@pytest.fixture
def driver():
    d = InferenceDriver(ToyEngine(slots=2, vocab=1000), 0, 0)
    d.start()
    yield d
    d.stop()


def _generate(url: str, model: str) -> dict:
    body = {
        "model": model,
        "token_ids": [5],
        "sampling_params": {"temperature": 0.0, "max_tokens": 3, "logprobs": 1},
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _control(url: str, method: str, path: str) -> httpx.Response:
    json = UPDATE if path == "/update_weights" else None
    return httpx.request(method, f"{url}{path}", json=json, timeout=30)


def test_the_live_server_answers_with_the_version_the_trainer_swapped_in(driver):
    cfg = make_config({"Engine.serve_port": 0})
    server = serve_live_policy(cfg, driver.engine, driver, tokenizer=None)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [cfg.model.name]
        assert models[0]["policy_version"] == 0
        first = _generate(server.url, cfg.model.name)
        assert first["token_ids"] == [6, 7, 8] and first["policy_versions"] == [0, 0, 0]
        driver.swap_params(1, 1).result(timeout=30)  # what the weight path does after a step
        (card,) = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert card["policy_version"] == 1  # what an eval harness labels its run with
        second = _generate(server.url, cfg.model.name)
        assert second["token_ids"] == [7, 9, 11] and second["policy_versions"] == [1, 1, 1]
    finally:
        server.stop()
    assert driver.version == 1  # the server stopped; the driver is the stage's and still runs


def test_the_control_routes_are_refused_to_every_caller_by_default(driver):
    cfg = make_config({"Engine.serve_port": 0})
    server = serve_live_policy(cfg, driver.engine, driver, tokenizer=None)
    try:
        for method, path in CONTROL:
            r = _control(server.url, method, path)
            assert r.status_code == 403, (path, r.text)
            message = r.json()["error"]["message"]
            assert f"{method} {path} is refused" in message and "Engine.serve_control" in message
        assert not driver.paused and driver.version == 0  # neither paused nor swapped
        assert server.held() is None and server.gauges()["serve/caller_pauses_total"] == 0
        assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False}
        assert _generate(server.url, cfg.model.name)["token_ids"] == [6, 7, 8]  # still serving
    finally:
        server.stop()


def test_a_pause_handed_out_is_reported_while_it_holds_the_engine(driver, capsys):
    cfg = make_config({"Engine.serve_port": 0, "Engine.serve_control": True})
    server = serve_live_policy(cfg, driver.engine, driver, tokenizer=None)
    try:
        assert "control routes handed out" in capsys.readouterr().out
        r = httpx.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=30)
        assert r.status_code == 200 and driver.paused
        (line,) = capsys.readouterr().out.splitlines()
        assert "the engine is paused (mode keep) by POST /pause from 127.0.0.1:" in line
        held = server.held()
        assert held.startswith("the engine is paused (by POST /pause from 127.0.0.1:")
        assert server.gauges() == {"serve/paused_by_caller": 1.0, "serve/caller_pauses_total": 1.0}

        assert httpx.post(f"{server.url}/resume", timeout=30).status_code == 200
        (line,) = capsys.readouterr().out.splitlines()
        assert "the engine resumed (POST /resume from 127.0.0.1:" in line
        assert not driver.paused and server.held() is None
        assert server.gauges() == {"serve/paused_by_caller": 0.0, "serve/caller_pauses_total": 1.0}
        httpx.post(f"{server.url}/resume", timeout=30)  # nothing held: nothing to report
        assert capsys.readouterr().out == ""
        # Handed out, a weight update reaches the host, which has no source of its own.
        r = httpx.post(f"{server.url}/update_weights", json=UPDATE, timeout=30)
        assert r.status_code == 409 and "weight source" in r.text
    finally:
        server.stop()


def test_no_port_no_server(driver):
    assert serve_live_policy(make_config(), driver.engine, driver, tokenizer=None) is None


def test_control_without_a_live_server_is_refused():
    with pytest.raises(ValueError, match=r"Engine.serve_control = True .* set Engine.serve_port"):
        make_config({"Engine.serve_control": True})
