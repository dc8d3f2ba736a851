"""Bad requests get a 4xx naming the bad value and what is allowed, and the server keeps serving.

One server for the module, started with an API key, a 64 KiB body limit and ``max_queued=4``
(the engine has 4 slots). Every case is followed by a good request to the same server.
"""

from __future__ import annotations

import json

import httpx
import pytest
from support.serving import MODEL, Served, tiny_engine, until

from jaxrl_orch.serving.guard import Limits
from jaxrl_orch.serving.host import EngineHost

pytestmark = pytest.mark.timeout(120)

KEY = "test-key-0123"
BODY_LIMIT = 64 * 1024
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # 8 tokens; the context is 64, a prompt at most 16


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    host = EngineHost(engine, model=MODEL, params=engine.load_params(seed=0), max_queued=4)
    s = Served(host, api_key=KEY, limits=Limits(max_body_bytes=BODY_LIMIT))
    yield s
    engine.release()
    s.close()


def _body(token_ids=PROMPT, **sampling) -> dict:
    return {
        "model": MODEL,
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": 4, **sampling},
    }


def _post(client, body, **kwargs):
    return client.post("/inference/v1/generate", json=body, **kwargs)


def _raw(client, content: bytes, **kwargs):
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return client.post("/inference/v1/generate", content=content, headers=headers, **kwargs)


def _chunks(content: bytes):
    for i in range(0, len(content), 8192):
        yield content[i : i + 8192]


BIG = json.dumps(_body(token_ids=[1] * 40_000)).encode()  # ~120 KB

# name -> (request, status, words the message must hold, param)
CASES = {
    "malformed json": (lambda c: _raw(c, b'{"token_ids": [1,'), 400, ["not valid JSON"], None),
    "body not an object": (lambda c: _raw(c, b"[1, 2]"), 400, ["JSON object"], None),
    "unknown sampling key": (
        lambda c: _post(c, _body(best_of=2)),
        400,
        ["'best_of'", "allowed keys", "temperature", "max_tokens", "stop_token_ids"],
        "sampling_params.best_of",
    ),
    "unknown top-level key": (
        lambda c: _post(c, {**_body(), "stream": True}),
        400,
        ["'stream'", "allowed keys", "token_ids", "sampling_params"],
        "stream",
    ),
    "top_p that float32 holds as 0": (
        lambda c: _post(c, _body(top_p=1e-300)),
        400,
        ["top_p=1e-300", "becomes 0", "float32", repr(2.0**-126)],
        "sampling_params.top_p",
    ),
    "temperature that overflows the logits": (
        lambda c: _post(c, _body(temperature=1e-40)),
        400,
        ["temperature=1e-40", "overflows the tempered logits", repr(2.0**-100)],
        "sampling_params.temperature",
    ),
    "temperature past float32": (
        lambda c: _post(c, _body(temperature=1e39)),
        400,
        ["temperature=1e+39", "float32's largest value"],
        "sampling_params.temperature",
    ),
    "max_tokens 0": (lambda c: _post(c, _body(max_tokens=0)), 400, ["max_tokens", ">= 1"], None),
    "max_tokens negative": (lambda c: _post(c, _body(max_tokens=-3)), 400, ["-3"], None),
    "max_tokens a string": (lambda c: _post(c, _body(max_tokens="8")), 400, ["integer"], None),
    "max_tokens a fraction": (lambda c: _post(c, _body(max_tokens=1.5)), 400, ["integer"], None),
    "max_tokens past the context": (
        lambda c: _post(c, _body(max_tokens=60)),
        400,
        ["8 tokens", "max_tokens=60", "max_model_len=64", "at most 56"],
        "sampling_params.max_tokens",
    ),
    "token id past the vocabulary": (
        lambda c: _post(c, _body(token_ids=[1, 2, 512])),
        400,
        ["token_ids[2]=512", "[0, 512)"],
        "token_ids",
    ),
    "a token id past any int": (
        lambda c: _post(c, _body(token_ids=[1, 2**70])),
        400,
        [f"token_ids[1]={2**70}", "[0, 512)"],
        "token_ids",
    ),
    "negative token id": (
        lambda c: _post(c, _body(token_ids=[-1])),
        400,
        ["token_ids[0]=-1", "[0, 512)"],
        "token_ids",
    ),
    "stop id past the vocabulary": (
        lambda c: _post(c, _body(stop_token_ids=[600])),
        400,
        ["600", "[0, 512)"],
        "sampling_params.stop_token_ids",
    ),
    "prompt too long": (
        lambda c: _post(c, _body(token_ids=[1] * 17)),
        400,
        ["17 tokens", "max prompt length is 16", "max_model_len=64"],
        "token_ids",
    ),
    "empty prompt": (lambda c: _post(c, _body(token_ids=[])), 400, ["token_ids"], "token_ids"),
    "top-k alternatives": (lambda c: _post(c, _body(logprobs=5)), 400, ["logprobs=5"], None),
    "prompt_logprobs past the maximum": (
        lambda c: _post(c, _body(prompt_logprobs=21)),
        400,
        ["prompt_logprobs=21", "[0, 20]"],
        "sampling_params.prompt_logprobs",
    ),
    "prompt_logprobs of the whole vocabulary": (
        lambda c: _post(c, _body(prompt_logprobs=-1)),
        400,
        ["prompt_logprobs=-1", "[0, 20]"],
        "sampling_params.prompt_logprobs",
    ),
    "a penalty": (
        lambda c: _post(c, _body(repetition_penalty=1.2)),
        400,
        ["repetition_penalty=1.2", "repetition_penalty=1.0"],
        "sampling_params.repetition_penalty",
    ),
    "ignore_eos": (lambda c: _post(c, _body(ignore_eos=True)), 400, ["ignore_eos"], None),
    "priority": (lambda c: _post(c, {**_body(), "priority": 3}), 400, ["priority=3"], None),
    "model not served": (
        lambda c: _post(c, {**_body(), "model": "gpt-9"}),
        404,
        ["'gpt-9'", f"'{MODEL}'"],
        "model",
    ),
    "missing key": (
        lambda c: httpx.post(str(c.base_url.join("/inference/v1/generate")), json=_body()),
        401,
        ["missing API key", "Authorization: Bearer"],
        None,
    ),
    "the key without Bearer": (
        lambda c: _post(c, _body(), headers={"Authorization": KEY}),
        401,
        ["wrong API key"],
        None,
    ),
    "wrong key": (
        lambda c: _post(c, _body(), headers={"Authorization": "Bearer not-the-key"}),
        401,
        ["wrong API key"],
        None,
    ),
    "body over the limit": (lambda c: _raw(c, BIG), 413, [str(BODY_LIMIT)], None),
    "chunked body over the limit": (lambda c: _raw(c, _chunks(BIG)), 413, ["over the limit"], None),
    "more samples than max_queued": (
        lambda c: _post(c, _body(n=5)),
        400,
        ["n=5", "max_queued=4"],
        "sampling_params.n",
    ),
    "more stop ids than a slot holds": (
        lambda c: _post(c, _body(stop_token_ids=[1, 2, 3, 4, 5])),
        400,
        ["5 stop_token_ids", "max_stop_tokens=4"],
        None,
    ),
    "pause mode": (lambda c: c.post("/pause", params={"mode": "later"}), 400, ["'later'"], "mode"),
    "pause with another query parameter": (
        lambda c: c.post("/pause", params={"wait_for_inflight_requests": "true"}),
        400,
        ["'wait_for_inflight_requests'", "mode="],
        "wait_for_inflight_requests",
    ),
    "weights from an address": (
        lambda c: c.post(
            "/update_weights", json={"version": 1, "uuid": 1, "timeout_s": 1, "address": "h:1"}
        ),
        400,
        ["'address'", "allowed keys", "uuid"],
        "address",
    ),
    "weights without the pull's deadline": (
        lambda c: c.post("/update_weights", json={"version": 1, "uuid": 1}),
        400,
        ["timeout_s is required"],
        "timeout_s",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_by_name_and_the_server_keeps_serving(served, case):
    request, status, words, param = CASES[case]
    r = request(served.client)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status
    for word in words:
        assert word in error["message"], (word, error["message"])
    if param is not None:
        assert error["param"] == param
    # Neutral values of the refused knobs and the keys verifiers adds pass; the server answers.
    good = _body(
        repetition_penalty=1.0,
        min_p=0.0,
        logprobs=1,
        skip_special_tokens=False,
        routed_experts_prompt_start=3,
    )
    ok = _post(served.client, {**good, "cache_salt": "run-1", "priority": 0})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["token_ids"]) == 4


def test_samples_in_flight_count_against_max_queued(served):
    engine, host = served.host.engine, served.host
    engine.hold(after=0)
    three = served.in_background("POST", "/inference/v1/generate", json=_body(n=3))
    until(lambda: host.in_flight == 3, what="three samples in flight")
    one = served.in_background("POST", "/inference/v1/generate", json=_body(n=1))  # 3 + 1 <= 4
    until(lambda: host.in_flight == 4, what="four samples in flight")
    r = _post(served.client, _body(n=1))
    assert r.status_code == 429, r.text
    assert "4 samples in flight" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    engine.release()
    assert three.result().status_code == 200 and one.result().status_code == 200
    until(lambda: host.in_flight == 0, what="the samples finished")
    assert _post(served.client, _body(n=4)).status_code == 200


def test_one_bad_request_among_those_sharing_its_prompt_fails_alone(served, monkeypatch):
    engine, host = served.host.engine, served.host
    post = lambda body: served.in_background("POST", "/inference/v1/generate", json=body)  # noqa: E731
    engine.hold(after=0)  # every request below is in flight before one token is decoded
    first = [post(_body()) for _ in range(2)]
    until(lambda: host.in_flight == 2, what="two requests of the prompt in flight")
    # The engine's loop is parked in its first decode call, so nothing posted below is inserted
    # (where the bad one would fail at once) before the test has counted it in flight.
    engine.wait_held()
    # A setting the engine's slot fields cannot hold is refused by name before it is queued.
    r = _post(served.client, _body(top_k=2**31))
    assert r.status_code == 400, r.text
    assert "top_k=2147483648" in r.json()["error"]["message"]
    # One the engine itself refuses when its sample is inserted (an engine's own limit): the
    # requests sharing its prompt, decoding or queued with it, go on.
    insert = engine.insert

    def refusing(prefix, state, slot, sampling=None):
        if sampling is not None and sampling.seed == 4242:
            raise ValueError("this engine cannot hold seed=4242")
        return insert(prefix, state, slot, sampling=sampling)

    monkeypatch.setattr(engine, "insert", refusing, raising=False)
    bad = post(_body(seed=4242))
    after = post(_body())
    until(lambda: host.in_flight == 4, what="the bad request and one more queued")
    engine.release()
    refused = bad.result()
    assert refused.status_code == 500, refused.text
    assert "ValueError: this engine cannot hold seed=4242" in refused.json()["error"]["message"]
    for r in [*first, after]:
        ok = r.result()
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"][0]["token_ids"]) == 4
    until(lambda: host.in_flight == 0, what="every slot free")
