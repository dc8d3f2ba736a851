"""Scoring over HTTP: completions' ``echo`` (lm-evaluation-harness's log-likelihood request),
``logprobs=k`` / chat ``top_logprobs=k`` alternatives, and the token endpoint's
``prompt_logprobs``, through the official ``openai`` client and raw HTTP.

One tiny chat engine served on loopback for the module (``support.openai_server``). The
reference for every number is the in-process driver the host runs, on the same engine, params
and version: ``driver.score`` for a prompt's scores, ``driver.submit`` with
``SamplingParams.top_logprobs`` for generated tokens' alternatives. That those equal the
trainer's log-probs is ``tests/inference/test_prompt_scoring.py``'s.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from support.openai_server import MODEL

from jaxrl_orch.serving.contract import GENERATE, GenerateResponse
from jaxrl_orch.serving.detokenize import token_text
from jaxrl_orch.types import SamplingParams

MESSAGES = [{"role": "user", "content": "Reverse: the cat sat"}]
CONTEXT = "system user the quick brown fox"
CONTINUATION = " jumps over the lazy dog"


def text(host, token: int) -> str:
    return token_text(host.tokenizer, token)


def scored(host, ids, k):
    return host.driver.score(ids, k).result(timeout=120)


def test_echo_with_max_tokens_0_returns_the_scored_prompt_only(host, client):
    ids = host.tokenizer.encode(CONTEXT)
    ref = scored(host, ids, 1)
    resp = client.completions.create(
        model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    (choice,) = resp.choices
    lp = choice.logprobs
    assert choice.text == host.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0
    assert lp.tokens == [text(host, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == ref.logprobs[1:]
    for token, value, top, alts in zip(
        ids[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], ref.top[1:], strict=True
    ):
        ((best, best_lp),) = alts
        expected = {text(host, best): best_lp}
        expected.setdefault(text(host, token), value)
        assert top == expected
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(ids))]
    assert resp.model_extra["prompt_policy_version"] == host.version


def test_lm_eval_loglikelihood_request_reads_the_continuations_scores(host, client):
    context = host.tokenizer.encode(CONTEXT)
    whole = context + host.tokenizer.encode(CONTINUATION)
    ref = scored(host, whole, 1)
    before = host.driver.num_prefills
    # lm-evaluation-harness local-completions' loglikelihood payload, batch size 1.
    resp = client.completions.create(
        model=MODEL, prompt=[whole], temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True
    )
    assert host.driver.num_prefills == before  # the scoring forward's prefix was reused
    (choice,) = resp.choices
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(whole) + 1  # the prompt, then one generated token
    greedy = host.driver.submit(whole, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert lp.tokens[-1] == text(host, greedy.result(timeout=60).token_ids[0])
    # lm-eval's parse_logprobs: the continuation's summed log-prob and whether it is greedy.
    ctxlen = len(context)
    total = sum(lp.token_logprobs[ctxlen:-1])
    is_greedy = all(
        v == max(top.values())
        for v, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1], strict=True)
    )
    assert total == pytest.approx(sum(ref.logprobs[ctxlen:]), abs=1e-4)
    assert is_greedy == all(r == 1 for r in ref.ranks[ctxlen:])
    assert choice.text.startswith(host.tokenizer.decode(whole, skip_special_tokens=False))


def test_chat_top_logprobs_are_the_engines_alternatives(host, client):
    tok = host.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    sp = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=tok.stop_ids, top_logprobs=3)
    ref = host.driver.submit(ids, sp)[0].result(timeout=60)
    ask = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    resp = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == len(ref.token_ids)
    for entry, token, alts in zip(entries, ref.token_ids, ref.top_logprobs, strict=True):
        assert [t.token for t in entry.top_logprobs] == [text(host, i) for i, _ in alts]
        assert [t.logprob for t in entry.top_logprobs] == [v for _, v in alts]
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token == text(host, token)  # greedy
    chunks = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == entries
    plain = client.chat.completions.create(**ask, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_completions_logprobs_k_hold_k_alternatives_and_the_sampled_token(host, client):
    ids = host.tokenizer.encode(CONTEXT)
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=5, top_logprobs=2)
    ref = host.driver.submit(ids, sp)[0].result(timeout=60)
    resp = client.completions.create(
        model=MODEL,
        prompt=ids,
        temperature=1.0,
        max_tokens=6,
        seed=5,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == ref.logprobs
    for token, value, top, alts in zip(
        ref.token_ids, lp.token_logprobs, lp.top_logprobs, ref.top_logprobs, strict=True
    ):
        expected: dict = {}
        for i, v in alts:  # ids sharing a text (byte pieces) keep the likelier one's value
            expected.setdefault(text(host, i), v)
        expected.setdefault(text(host, token), value)
        assert top == expected and max(top.values()) == alts[0][1] >= value


def test_token_endpoint_prompt_logprobs_in_vllms_shape(host, url):
    ids = host.tokenizer.encode(CONTEXT)
    ref = scored(host, ids, 2)
    body = {
        "model": MODEL,
        "token_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": 2},
    }
    with httpx.Client(trust_env=False) as http:
        raw = http.post(f"{url}{GENERATE.path}", json=body, timeout=120).json()
        plain = http.post(
            f"{url}{GENERATE.path}", json={**body, "sampling_params": {"max_tokens": 2}}
        ).json()
    assert GenerateResponse.model_validate(raw).prompt_logprobs is not None
    prompt = raw["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for i, entry in enumerate(prompt[1:], 1):
        expected = {
            str(t): {"logprob": v, "rank": r, "decoded_token": None}
            for r, (t, v) in enumerate(ref.top[i], 1)
        }
        expected.setdefault(
            str(ids[i]), {"logprob": ref.logprobs[i], "rank": ref.ranks[i], "decoded_token": None}
        )
        assert entry == expected
    assert raw["prompt_policy_version"] == host.version
    assert len(raw["choices"][0]["token_ids"]) == 2
    assert plain["prompt_logprobs"] is None and plain["prompt_policy_version"] is None


def test_alternatives_past_the_maximum_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match=r"logprobs=21 .*\[0, 20\]") as bad:
        client.completions.create(model=MODEL, prompt="a", echo=True, logprobs=21)
    assert bad.value.body["param"] == "logprobs"
    assert np.isfinite(client.completions.create(model=MODEL, prompt="ab", max_tokens=1).created)
