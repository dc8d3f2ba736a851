"""The engine route verifiers' training client calls (``envs.vf.bridge``), over real HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from jaxrl_orch.envs.vf.bridge import SESSION_HEADER, BridgeError, EngineBridge, to_sampling
from jaxrl_orch.types import Completion, SamplingParams

ROLLOUT = SamplingParams(temperature=0.7, max_tokens=16, stop_token_ids=(2,), seed=11)


def test_a_request_samples_within_the_rollouts_own_sampling():
    s = to_sampling({"max_tokens": 99, "stop_token_ids": [5, 2], "logprobs": 1}, ROLLOUT)
    assert (s.temperature, s.max_tokens, s.stop_token_ids, s.seed) == (0.7, 16, (2, 5), 11)
    assert to_sampling({"max_tokens": 4, "top_k": -1}, ROLLOUT).max_tokens == 4
    with pytest.raises(BridgeError, match="temperature 1 differs from the rollout's 0.7"):
        to_sampling({"temperature": 1.0}, ROLLOUT)
    with pytest.raises(BridgeError, match=r"sampling keys \['min_p', 'repetition_penalty'\]"):
        to_sampling({"min_p": 0.1, "repetition_penalty": 1.2}, ROLLOUT)
    with pytest.raises(BridgeError, match="n=2: one sample per request"):
        to_sampling({"n": 2}, ROLLOUT)
    with pytest.raises(BridgeError, match="sampling_params: top_p must be in"):
        to_sampling({"top_p": 0.0}, ROLLOUT)


class OneReply:
    async def generate(self, prompt_ids, sampling):
        return Completion([7, 8, 2], [-0.5, float("nan"), -0.25], [3, 3, 4], "stop")


def test_only_a_running_rollouts_session_is_served_and_its_reply_kept():
    async def main():
        bridge = EngineBridge(model="m", max_model_len=64)
        url = await bridge.start()
        assert url.startswith("http://127.0.0.1:")
        session = bridge.open(OneReply(), ROLLOUT)
        bridge.bind(session, "trace-1")
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8}}
        try:
            async with aiohttp.ClientSession() as http:
                post = f"{url}/inference/v1/generate"
                async with http.post(post, json=body, headers={SESSION_HEADER: "trace-1"}) as r:
                    ok = await r.json()
                async with http.post(post, json=body, headers={SESSION_HEADER: "other"}) as r:
                    unknown = (r.status, await r.json())
                async with http.get(f"{url}/v1/models") as r:
                    models = await r.json()
                bridge.close(session)
                async with http.post(post, json=body, headers={SESSION_HEADER: "trace-1"}) as r:
                    closed = r.status
        finally:
            await bridge.stop()
        return session, ok, unknown, models, closed

    session, ok, unknown, models, closed = asyncio.run(main())
    (choice,) = ok["choices"]
    assert choice["token_ids"] == [7, 8, 2] and choice["policy_versions"] == [3, 3, 4]
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == [-0.5, None, -0.25]
    assert len(session.replies) == 1 and session.replies[0].versions == [3, 3, 4]
    status, error = unknown
    assert status == 404 and "'other' names no running rollout" in error["error"]["message"]
    assert models["data"][0]["max_model_len"] == 64
    assert closed == 404  # a closed session is no longer served
