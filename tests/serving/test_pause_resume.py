"""Pause (keep / abort / wait), resume and weight updates over HTTP, with requests in flight.

One tiny engine for the module; the host's weight source hands out params prepared here (the
same model re-initialised with another seed) or fails the way a transfer can. To act
mid-request the test holds the driver at the entry of a decode call (``HeldEngine``) and lets
calls through one at a time until the pause is answered, so a pause always lands while the
request is running, whatever the machine's speed.
"""

from __future__ import annotations

import pytest
from support.serving import MODEL, Served, tiny_engine, until

from jaxrl_orch.serving.host import EngineHost

pytestmark = pytest.mark.timeout(120)

PROMPT = [31, 41, 59, 26, 53]
LONG = 48  # tokens: 12 decode calls of 4 steps, well past the point a pause lands
OFFER_NEW, OFFER_SLOW, OFFER_BROKEN = 1, 98, 99


@pytest.fixture(scope="module")
def engine():
    e = tiny_engine()
    yield e
    e.release()


@pytest.fixture(scope="module")
def params(engine):
    return {0: engine.load_params(seed=0), 1: engine.load_params(seed=1)}


@pytest.fixture(scope="module")
def source(params):
    def pull(uuid, layout, timeout_s):
        if uuid == OFFER_SLOW:
            raise TimeoutError(f"offer {uuid} not complete after {timeout_s:g} s")
        if uuid == OFFER_BROKEN:
            raise RuntimeError("the sender went away mid-transfer")
        return params[1 if uuid == OFFER_NEW else 0]

    return pull


@pytest.fixture(scope="module")
def served(engine, params, source):
    s = Served(EngineHost(engine, model=MODEL, params=params[0], source=source))
    yield s
    s.close()


def _greedy(max_tokens: int = LONG) -> dict:
    return {
        "model": MODEL,
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens},
    }


def _pause_mid_request(served, mode: str):
    """A long greedy request in flight, paused with ``mode`` after its first decode calls:
    ``(request, pause)`` (both ``Background``; the pause has answered)."""
    engine = served.host.engine
    engine.hold(after=2)
    request = served.in_background("POST", "/inference/v1/generate", json=_greedy())
    engine.wait_held()
    pause = served.in_background("POST", "/pause", params={"mode": mode})
    engine.step_until(lambda: pause.done)
    assert pause.result().status_code == 200, pause.result().text
    engine.release()
    return request, pause


def test_keep_holds_the_request_across_a_weight_swap_and_restamps_what_follows(served):
    c = served.client
    old = served.host.version
    undisturbed = served.generate(PROMPT, temperature=0.0, max_tokens=LONG)["choices"][0]

    request, pause = _pause_mid_request(served, "keep")
    assert pause.result().json()["status"] == "paused"
    assert c.get("/is_paused").json() == {"is_paused": True}
    assert c.get("/health").json()["paused"] is True
    r = c.post("/update_weights", json={"version": old + 1, "uuid": OFFER_NEW, "timeout_s": 30})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == old + 1 and r.json()["pull_s"] >= 0 and r.json()["swap_s"] >= 0
    assert not request.done and served.host.in_flight == 1  # kept, not decoding
    assert c.post("/resume").json() == {"status": "resumed"}
    assert c.get("/is_paused").json() == {"is_paused": False}

    (choice,) = request.result().json()["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == LONG
    versions = choice["policy_versions"]
    kept = versions.count(old)
    assert 0 < kept < LONG
    assert versions == [old] * kept + [old + 1] * (LONG - kept)
    assert choice["token_ids"][:kept] == undisturbed["token_ids"][:kept]


def test_abort_ends_the_running_request_with_its_partial_tokens(served):
    request, _ = _pause_mid_request(served, "abort")
    (choice,) = request.result().json()["choices"]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < LONG
    assert len(choice["logprobs"]["content"]) == len(choice["policy_versions"])
    assert served.host.in_flight == 0
    served.client.post("/resume")
    assert served.generate(PROMPT, temperature=0.0, max_tokens=4)["choices"][0]["token_ids"]


def test_wait_answers_only_once_the_running_request_finished(served):
    engine, host = served.host.engine, served.host
    engine.hold(after=1)
    request = served.in_background("POST", "/inference/v1/generate", json=_greedy())
    engine.wait_held()
    pause = served.in_background("POST", "/pause", params={"mode": "wait"})
    engine.step_until(lambda: pause.done)  # one decode call at a time until the pause answers
    engine.release()
    assert pause.result().status_code == 200
    # By the time the pause answers, the driver has already finished the request.
    assert host.in_flight == 0 and host.gauges()["inference/active_slots"] == 0
    (choice,) = request.result().json()["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == LONG
    served.client.post("/resume")


def test_a_request_sent_while_paused_waits_and_finishes_after_resume(served):
    c = served.client
    assert c.post("/pause", params={"mode": "keep"}).json()["status"] == "paused"
    request = served.in_background("POST", "/inference/v1/generate", json=_greedy(8))
    until(lambda: c.get("/health").json()["queued"] == 1, what="the request queued")
    assert not request.done and c.get("/is_paused").json()["is_paused"] is True
    c.post("/resume")
    (choice,) = request.result().json()["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    assert choice["policy_versions"] == [served.host.version] * 8


def test_weight_update_failures_name_the_cause_and_the_host_keeps_serving(served):
    c = served.client
    v = served.host.version
    before = served.generate(PROMPT, temperature=0.0, max_tokens=6)["choices"][0]

    back = c.post("/update_weights", json={"version": v - 1, "uuid": OFFER_NEW, "timeout_s": 30})
    assert back.status_code == 400 and "backwards" in back.json()["error"]["message"]
    slow = c.post("/update_weights", json={"version": v + 1, "uuid": OFFER_SLOW, "timeout_s": 2})
    assert slow.status_code == 504, slow.text
    assert "timeout_s=2" in slow.json()["error"]["message"]
    broken = c.post(
        "/update_weights", json={"version": v + 1, "uuid": OFFER_BROKEN, "timeout_s": 30}
    )
    assert broken.status_code == 500, broken.text
    assert "the sender went away mid-transfer" in broken.json()["error"]["message"]
    address = c.post(
        "/update_weights", json={"version": v + 1, "uuid": 1, "timeout_s": 30, "address": "h:1"}
    )
    assert address.status_code == 400 and "'address'" in address.json()["error"]["message"]

    assert served.host.version == v
    after = served.generate(PROMPT, temperature=0.0, max_tokens=6)["choices"][0]
    assert after["token_ids"] == before["token_ids"] and after["policy_versions"] == [v] * 6


def test_a_host_without_weights_is_healthy_but_not_ready_until_its_first_update(engine, source):
    s = Served(EngineHost(engine, model=MODEL, source=source))
    try:
        health = s.client.get("/health").json()
        assert health["status"] == "ok" and health["ready"] is False and health["version"] == -1
        r = s.client.post("/inference/v1/generate", json=_greedy(4))
        assert r.status_code == 503 and "/update_weights" in r.json()["error"]["message"]
        assert s.client.post("/pause", params={"mode": "keep"}).status_code == 503
        update = {"version": 0, "uuid": 0, "timeout_s": 30}
        assert s.client.post("/update_weights", json=update).status_code == 200
        assert s.client.get("/health").json()["ready"] is True
        assert s.generate(PROMPT, temperature=0.0, max_tokens=4)["choices"][0]["policy_versions"]
    finally:
        s.close()
