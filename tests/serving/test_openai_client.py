"""``/v1/completions`` and ``/v1/chat/completions`` through the official ``openai`` client.

One tiny engine on a Qwen-style tokenizer directory with its jinja chat template
(``support.openai_server``), served by ``make_app`` + ``HttpServer`` on loopback for the whole
module. The reference for every comparison is the in-process ``InferenceDriver`` the host runs,
on the same engine and params, given the prompt ids the test renders itself (the checkpoint's
template, then ``encode``) and ``SamplingParams`` the test writes: what comes back over HTTP
must be exactly that decode, its text ``tokenizer.decode`` of its ids without the stop token.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest
from support.openai_server import MODEL

from jaxrl_orch.models.tokenizer import ByteTokenizer
from jaxrl_orch.serving.detokenize import IncrementalDetokenizer
from jaxrl_orch.serving.generation import Choice
from jaxrl_orch.serving.stops import StopStrings
from jaxrl_orch.types import Completion, SamplingParams

MESSAGES = [
    {"role": "system", "content": "Reverse in <answer></answer>:"},
    {"role": "user", "content": "hello world"},
]
# 44 ids, and 42 for MESSAGES: one prefill bucket (64) for the whole module.
PROMPT = "system user assistant the quick brown fox jumps over the lazy dog"


def engine_decode(host, prompt_ids, **sampling):
    """The in-process driver's completion of ``prompt_ids``: the reference."""
    return host.driver.submit(prompt_ids, SamplingParams(**sampling))[0].result(timeout=60)


def reply_text(host, completion) -> str:
    ids = completion.token_ids
    if completion.finish_reason == "stop" and ids and ids[-1] in host.tokenizer.stop_ids:
        ids = ids[:-1]
    return host.tokenizer.decode(ids, skip_special_tokens=True)


def chat_ids(host, messages=MESSAGES):
    tok = host.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def test_greedy_chat_is_the_engines_greedy_decode(host, client):
    ids = chat_ids(host)
    ref = engine_decode(
        host, ids, temperature=0.0, max_tokens=24, stop_token_ids=host.tokenizer.stop_ids
    )
    assert len(ref.token_ids) > 4  # a reply worth comparing
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    (choice,) = resp.choices
    assert resp.prompt_token_ids == ids  # the server rendered the template as the test did
    assert choice.token_ids == ref.token_ids
    assert choice.message.role == "assistant"
    assert choice.message.content == reply_text(host, ref)
    assert choice.finish_reason == ref.finish_reason
    entries = choice.logprobs.content
    np.testing.assert_allclose([e.logprob for e in entries], ref.logprobs, atol=1e-5)
    tokens = [host.tokenizer.decode([t]) for t in ref.token_ids]
    assert [e.token for e in entries] == tokens
    assert [e.bytes for e in entries] == [list(t.encode()) for t in tokens]
    assert choice.policy_versions == ref.versions == [0] * len(ref.token_ids)
    assert resp.model == MODEL
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == len(ids) + len(ref.token_ids)


def test_streamed_chat_deltas_add_up_to_the_whole_reply(client):
    ask = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    ask["logprobs"] = True
    whole = client.chat.completions.create(**ask)
    chunks = list(
        client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, usage = chunks
    assert usage.choices == [] and usage.usage == whole.usage
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert (
        "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    versions = [v for c in body for v in c.choices[0].policy_versions]
    assert versions == whole.choices[0].policy_versions
    entries = [e for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert entries == whole.choices[0].logprobs.content


def test_completions_take_text_or_token_ids(host, client):
    ids = host.tokenizer.encode(PROMPT)
    stops = host.tokenizer.stop_ids
    ref = engine_decode(host, ids, temperature=0.0, max_tokens=12, stop_token_ids=stops)
    by_text = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=1
    )
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12)
    assert by_text.choices[0].text == by_ids.choices[0].text == reply_text(host, ref)
    assert by_text.choices[0].finish_reason == ref.finish_reason
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    lp = by_text.choices[0].logprobs
    assert lp.tokens == [host.tokenizer.decode([t]) for t in ref.token_ids]
    np.testing.assert_allclose(lp.token_logprobs, ref.logprobs, atol=1e-5)
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert by_ids.choices[0].logprobs is None


def test_n_choices_with_a_seed_are_the_seeded_samples(host, client):
    ids = host.tokenizer.encode(PROMPT)
    ask = {"model": MODEL, "prompt": PROMPT, "n": 2, "seed": 7, "temperature": 1.0}
    resp = client.completions.create(**ask, max_tokens=10, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    refs = [engine_decode(host, ids, temperature=1.0, max_tokens=10, seed=s) for s in (7, 8)]
    assert [c.text for c in resp.choices] == [reply_text(host, r) for r in refs]
    assert resp.choices[0].text != resp.choices[1].text
    assert resp.usage.completion_tokens == 20
    streamed = ["", ""]
    for chunk in client.completions.create(
        **ask, max_tokens=10, stream=True, extra_body={"ignore_eos": True}
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in resp.choices]


def test_a_stop_string_cuts_the_text_before_it(host, client):
    ask = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 24}
    full = client.completions.create(**ask, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = next(
        text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text.index(text[i : i + 2])
    )
    expected = text[: text.index(stop)]
    cut = client.completions.create(**ask, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(
        client.completions.create(**ask, stop=stop, stream=True, extra_body={"ignore_eos": True})
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_are_refused_by_name_and_the_server_keeps_serving(host, client):
    chat = client.chat.completions
    with pytest.raises(openai.BadRequestError, match="frobnicate.*accepts.*messages") as bad:
        chat.create(model=MODEL, messages=MESSAGES, extra_body={"frobnicate": 1})
    assert bad.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError, match=r"top_logprobs=21 .*\[0, 20\]"):
        chat.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs=3 needs logprobs=true"):
        chat.create(model=MODEL, messages=MESSAGES, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="'g', which is not among the tools"):
        chat.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    with pytest.raises(openai.NotFoundError, match=f"'gpt-4o'.*serves '{MODEL}'"):
        chat.create(model="gpt-4o", messages=MESSAGES)
    n_prompt = len(chat_ids(host))
    with pytest.raises(openai.BadRequestError, match=f"{n_prompt} tokens.*max_model_len=128"):
        chat.create(model=MODEL, messages=MESSAGES, max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="max_prompt_len=96"):
        client.completions.create(model=MODEL, prompt=[5] * 97, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="batch of 2 prompts"):
        client.completions.create(model=MODEL, prompt=["a", "b"])
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 .*echo=true only"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="echo=true is not streamed"):
        client.completions.create(model=MODEL, prompt="a", echo=True, stream=True)
    p_min = re.escape(repr(2.0**-126))
    t_min = re.escape(repr(2.0**-100))
    with pytest.raises(openai.BadRequestError, match=rf"top_p=1e-300 becomes 0 .*{p_min}") as bad:
        chat.create(model=MODEL, messages=MESSAGES, top_p=1e-300)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError, match=rf"temperature=1e-45 overflows .*{t_min}"):
        client.completions.create(model=MODEL, prompt="a", temperature=1e-45)
    ok = chat.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_a_client_that_leaves_mid_stream_cancels_its_request(host, url, monkeypatch):
    submitted = []
    submit = host.submit

    def spy(*args, **kwargs):
        futures = submit(*args, **kwargs)
        submitted.extend(futures)
        return futures

    monkeypatch.setattr(host, "submit", spy)
    host.driver.pause("keep").result(timeout=30)  # the request waits in the queue meanwhile
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "stream": True}
    try:
        with (
            httpx.Client(trust_env=False) as http,
            http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp,
        ):
            first = json.loads(next(resp.iter_lines()).removeprefix("data: "))
        assert first["choices"][0]["delta"]["role"] == "assistant"
        deadline = time.monotonic() + 30
        while not submitted[0].cancelled() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert submitted[0].cancelled()
    finally:
        host.driver.resume()
    deadline = time.monotonic() + 30
    while host.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host.in_flight == 0


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_text_deltas_never_split_a_character(host, which):
    tok = ByteTokenizer() if which == "byte" else host.tokenizer
    text = "héllo 漢字 🙂 wörld"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some ids ended mid-character and released nothing


def test_stop_strings_are_found_across_deltas():
    stops = StopStrings(["</a>", "zz"])
    out = [stops.feed(d) for d in ["ab<", "/", "a>cd"]]
    assert [o for o, _ in out] == ["ab", "", ""] and out[-1][1]
    assert stops.feed("more") == ("", True) and stops.flush() == ""
    held = StopStrings(["</a>"])
    assert held.feed("x</") == ("x", False)  # "</" may begin the stop string
    assert held.feed("b") == ("</b", False)
    assert held.feed("<") == ("", False) and held.flush() == "<"


def test_a_stop_string_ends_the_choice_and_frees_its_engine_request():
    tok = ByteTokenizer()
    future = concurrent.futures.Future()
    choice = Choice(0, future, tok, SamplingParams(), stops=["lo"])
    released = [choice.add(t, -0.5, 3) for t in b"hello"]
    assert "".join(released) == choice.text == "hel"
    assert choice.finish_reason == "stop" and future.cancelled()  # its slot is freed
    assert choice.token_ids == list(b"hello") and choice.versions == [3] * 5


def test_the_stop_token_stays_in_the_ids_but_never_in_the_text():
    tok = ByteTokenizer()
    future = concurrent.futures.Future()
    choice = Choice(0, future, tok, SamplingParams(stop_token_ids=(tok.eos_id,)))
    ids = [*"hé".encode(), tok.eos_id]
    for t in ids[:-2]:  # the driver's listener saw these; the rest only the completion holds
        choice.add(t, -1.0, 0)
    future.set_result(Completion(ids, [-1.0] * 4, [0] * 4, "stop"))
    assert choice.close() == "é"
    assert choice.text == "hé" and choice.finish_reason == "stop"
    assert choice.token_ids == ids and len(choice.logprobs) == 4
