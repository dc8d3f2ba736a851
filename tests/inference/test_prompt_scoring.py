"""Prompt scoring and top-k alternatives on a small real engine, through InferenceDriver.

The reference for prompt log-probs is the trainer's own path on the same params and tokens
(``trainer.logprobs.token_stats`` over the model's ``hidden_states`` at T = 1); the reference for
alternatives and ranks is NumPy over the model's full (uncached) logits, at the temperature the
token was sampled at.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import MAX_TOP_LOGPROBS, EngineLimits
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.trainer.logprobs import token_stats
from jaxrl_orch.types import SamplingParams

CFG = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128
)
LIMITS = EngineLimits(
    max_concurrent_decodes=4, max_target_length=48, max_prefill_length=16, steps_per_call=4
)
PROMPT = [5, 17, 99, 3, 250, 250, 7, 401, 12, 64, 9]
VERSION = 7


@pytest.fixture(scope="module")
def engine():
    return DecodeEngine(CFG, limits=LIMITS, decode_widths=(4,))


@pytest.fixture(scope="module")
def params(engine):
    return engine.load_params(seed=3)


@pytest.fixture(scope="module")
def driver(engine, params):
    d = InferenceDriver(engine, params, VERSION)
    d.start()
    yield d
    d.stop()


def model(engine, params):
    return nnx.merge(engine._graphdef, params)


def full_logits(engine, params, ids) -> np.ndarray:
    """The model's uncached forward over ``ids``: float64 ``[T, V]``."""
    tokens = np.asarray(ids, np.int32)[None]
    positions = np.arange(len(ids), dtype=np.int32)[None]
    return np.asarray(model(engine, params)(tokens, positions)[0], np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_prompt_logprobs_equal_the_trainers_logprobs_of_the_same_tokens(engine, params, driver):
    scores = driver.score(PROMPT, top_logprobs=5).result(timeout=120)
    m = model(engine, params)
    tokens = np.asarray(PROMPT, np.int32)[None]
    positions = np.arange(len(PROMPT), dtype=np.int32)[None]
    hidden = m.hidden_states(tokens, positions)[:, :-1]
    ones = np.ones((1, len(PROMPT) - 1), np.float32)
    trainer_lp, _ = token_stats(m.logits_from_hidden, hidden, tokens[:, 1:], ones, entropy=False)
    assert scores.logprobs[0] is None and scores.top[0] is None and scores.ranks[0] is None
    np.testing.assert_allclose(scores.logprobs[1:], np.asarray(trainer_lp[0]), rtol=0, atol=2e-5)
    assert scores.token_ids == PROMPT and scores.version == VERSION


def test_prompt_top_k_is_sorted_ranked_and_holds_the_token_at_its_own_value(engine, params, driver):
    k = 4
    scores = driver.score(PROMPT, top_logprobs=k).result(timeout=120)
    ref = log_softmax(full_logits(engine, params, PROMPT))[:-1]  # row t scores token t + 1
    for t, (token, lp, rank, top) in enumerate(
        zip(PROMPT[1:], scores.logprobs[1:], scores.ranks[1:], scores.top[1:], strict=True)
    ):
        ids = [i for i, _ in top]
        values = [v for _, v in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        assert ids == list(np.argsort(-ref[t], kind="stable")[:k])
        np.testing.assert_allclose(values, ref[t][ids], atol=2e-5)
        assert rank == 1 + int(np.sum(ref[t] > ref[t][token] + 1e-6))
        if token in ids:  # the same expression on the device: the same float
            assert values[ids.index(token)] == lp and rank == ids.index(token) + 1
        else:
            assert lp <= values[-1] and rank > k
    # A repeated token ranks first somewhere in this random model: the in-top branch ran.
    assert any(r <= k for r in scores.ranks[1:])


def test_scoring_leaves_the_prefix_a_completion_reuses(driver):
    prompt = [300, 301, 302, 303, 304]
    driver.score(prompt).result(timeout=120)
    before = driver.num_prefills
    out = driver.submit(prompt, SamplingParams(temperature=0.0, max_tokens=3))[0].result(60)
    assert driver.num_prefills == before and len(out.token_ids) == 3
    gauges = driver.gauges()
    assert gauges["inference/scored_prompts"] >= 1 and gauges["inference/score_s"] > 0


def test_generated_alternatives_come_from_the_sampling_distribution(engine, params, driver):
    sp = SamplingParams(temperature=0.7, max_tokens=6, seed=11)
    plain = driver.submit(PROMPT, sp)[0].result(timeout=120)
    both = driver.submit(PROMPT, [sp, dataclasses.replace(sp, top_logprobs=3)])
    alone, asked = (f.result(timeout=120) for f in both)
    # The top-k variant samples exactly as the default program does, for every slot.
    assert alone.token_ids == asked.token_ids == plain.token_ids
    assert alone.logprobs == plain.logprobs and alone.top_logprobs is None
    ref = log_softmax(full_logits(engine, params, PROMPT + asked.token_ids) / 0.7)
    ref = ref[len(PROMPT) - 1 : -1]  # row i: the distribution completion token i was drawn from
    assert len(asked.top_logprobs) == len(asked.token_ids)
    for i, (token, lp, top) in enumerate(
        zip(asked.token_ids, asked.logprobs, asked.top_logprobs, strict=True)
    ):
        ids = [a for a, _ in top]
        values = [v for _, v in top]
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert ids == list(np.argsort(-ref[i], kind="stable")[:3])
        np.testing.assert_allclose(values, ref[i][ids], atol=2e-5)
        if token in ids:
            assert values[ids.index(token)] == pytest.approx(lp, abs=1e-6)
        else:
            assert lp <= values[-1] + 1e-6


def test_greedy_alternatives_lead_with_the_sampled_token(driver):
    out = driver.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, top_logprobs=2))
    out = out[0].result(timeout=120)
    assert [top[0][0] for top in out.top_logprobs] == out.token_ids
    assert [top[0][1] for top in out.top_logprobs] == pytest.approx(out.logprobs, abs=1e-6)


def test_the_default_decode_program_computes_no_top_k(engine):
    args = (engine.abstract_params(), engine.abstract_decode_state(), np.int32(0))
    default = engine.generate_program(4).lower(*args).as_text()
    variant = engine.generate_program(4, top_logprobs=True).lower(*args).as_text()
    assert "chlo.top_k" not in default and "chlo.top_k" in variant


def test_out_of_range_asks_are_refused_by_name(driver):
    with pytest.raises(ValueError, match=rf"top_logprobs=21 .*\[0, {MAX_TOP_LOGPROBS}\]"):
        driver.score(PROMPT, top_logprobs=21)
    with pytest.raises(ValueError, match="top_logprobs=21 .*at most 20"):
        driver.submit(PROMPT, SamplingParams(top_logprobs=21))
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        driver.score(list(range(1, 18)))
