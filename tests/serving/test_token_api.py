"""vLLM's token-in/token-out endpoint over real HTTP, against the in-process driver it fronts.

One tiny engine and one served host for the module (``support.serving``). The reference for
every HTTP answer is the same host's driver given the same prompt and ``SamplingParams``; the
client of the main test is verifiers' own (``renderers.client.generate``, what its training
client calls), so the request shape is exactly the one a training run sends.
"""

from __future__ import annotations

import asyncio
import math
import types

import numpy as np
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from renderers.client import generate as renderers_generate
from support.serving import MODEL, Served, tiny_engine

from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.rl_api import generate_response
from jaxrl_orch.types import Completion, SamplingParams

pytestmark = pytest.mark.timeout(120)

STOP = [510, 511]  # the renderer's stop ids


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    s = Served(EngineHost(engine, model=MODEL, params=engine.load_params(seed=0), version=3))
    yield s
    s.close()


class _Renderer:
    """What ``renderers.client.generate`` asks of a renderer when handed prompt ids."""

    def get_stop_token_ids(self) -> list[int]:
        return list(STOP)

    def parse_response(self, completion_ids, prompt_ids=None, tools=None):
        return types.SimpleNamespace(
            content="", reasoning_content=None, tool_calls=[], reasoning_complete=True
        )


def _verifiers_call(url: str, prompt: list[int], sampling: dict) -> dict:
    async def call():
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        try:
            return await renderers_generate(
                client=client,
                renderer=_Renderer(),
                messages=[],
                model=MODEL,
                prompt_ids=prompt,
                sampling_params=dict(sampling),
                extra_headers={"X-Session-ID": "rollout-7"},
            )
        finally:
            await client.close()

    return asyncio.run(call())


def _reference(served: Served, prompt: list[int], sampling: SamplingParams, n: int = 1):
    futures = served.host.driver.submit(prompt, sampling, n)
    return [f.result(timeout=60) for f in futures]


def test_models_card_names_the_model_and_its_context(served):
    (card,) = served.client.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == served.host.max_model_len == 64
    # the longest prompt one prefill takes: what lm-eval's max_length must not pass
    assert card["max_prompt_len"] == served.host.max_prompt_len == 16
    assert card["policy_version"] == served.host.version == 3


@pytest.mark.parametrize(
    "wire",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 12, "seed": 5},
        {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "max_tokens": 12, "seed": 1234},
    ],
    ids=["greedy", "seeded"],
)
def test_verifiers_training_request_matches_the_in_process_driver(served, wire):
    prompt = [17, 42, 7, 99, 3]
    got = _verifiers_call(served.url, prompt, wire)
    top_k = max(wire["top_k"], 0)
    sp = SamplingParams(
        temperature=wire["temperature"],
        top_k=top_k,
        top_p=wire["top_p"],
        max_tokens=wire["max_tokens"],
        stop_token_ids=tuple(STOP),
        seed=wire["seed"],
    )
    (ref,) = _reference(served, prompt, sp)
    assert got["completion_ids"] == ref.token_ids and len(ref.token_ids) > 0
    np.testing.assert_allclose(got["completion_logprobs"], ref.logprobs, rtol=0, atol=1e-5)
    assert all(math.isfinite(x) for x in got["completion_logprobs"])
    assert got["finish_reason"] == ref.finish_reason

    # The same body on the wire, read raw: per-token versions and the given request id.
    body = {
        "model": MODEL,
        "token_ids": prompt,
        "sampling_params": {**wire, "stop_token_ids": STOP, "logprobs": 1},
        "request_id": "req-1",
    }
    raw = served.client.post("/inference/v1/generate", json=body).json()
    (choice,) = raw["choices"]
    assert raw["request_id"] == "req-1"
    assert choice["token_ids"] == ref.token_ids
    assert choice["policy_versions"] == [served.host.version] * len(ref.token_ids) == ref.versions
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in ref.token_ids
    ]
    assert all(e["top_logprobs"] == [] for e in choice["logprobs"]["content"])


def test_n_samples_share_one_prefill_and_follow_the_driver_seed_rule(served):
    prompt, seed = [200, 201, 202], 77
    driver = served.host.driver
    before = driver.num_prefills
    out = served.generate(prompt, temperature=1.0, max_tokens=10, seed=seed, n=3)
    assert driver.num_prefills == before + 1  # one prefill for the three samples
    refs = _reference(served, prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=seed), 3)
    assert [c["token_ids"] for c in out["choices"]] == [r.token_ids for r in refs]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1  # seeds seed+i differ
    assert out["request_id"].startswith("gen-")  # generated when not given


def test_a_stop_id_ends_the_sample_with_stop_and_is_included(served):
    prompt = [9, 8, 7]
    first = served.generate(prompt, temperature=0.0, max_tokens=6)["choices"][0]
    assert first["finish_reason"] == "length" and len(first["token_ids"]) == 6
    stop_at = first["token_ids"][2]
    out = served.generate(prompt, temperature=0.0, max_tokens=6, stop_token_ids=[stop_at])
    (choice,) = out["choices"]
    cut = first["token_ids"].index(stop_at) + 1
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == first["token_ids"][:cut]


def test_an_engine_without_log_probs_answers_null_and_cancelled_reads_abort():
    nan = float("nan")
    out = generate_response("r", 2, [Completion([4, 5], [nan, -0.5], [1, 1], "cancelled")])
    (choice,) = out["choices"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [None, -0.5]
    assert choice["finish_reason"] == "abort"
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_health_and_metrics_report_the_host(served):
    served.generate([1, 2], temperature=0.0, max_tokens=4)
    health = served.client.get("/health").json()
    assert health["status"] == "ok" and health["ready"] is True
    assert health["version"] == served.host.version == 3
    assert health["paused"] is False and health["in_flight"] == 0 and health["queued"] == 0
    assert health["slots"] == 4 and health["engine_s"] > 0 and health["pid"] > 0

    text = served.client.get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("jaxrl_engine_policy_version", ())] == 3
    assert samples[("jaxrl_engine_paused", ())] == 0
    assert samples[("jaxrl_generated_tokens_total", ())] >= 4
    ok = (("route", "/inference/v1/generate"), ("status", "200"))
    assert samples[("jaxrl_http_requests_total", ok)] >= 1


def test_a_host_without_a_weight_source_refuses_updates_with_409(served):
    r = served.client.post("/update_weights", json={"version": 9, "uuid": 1, "timeout_s": 30})
    assert r.status_code == 409, r.text
    assert "weight source" in r.json()["error"]["message"]
    assert served.host.version == 3
