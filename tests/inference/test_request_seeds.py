"""Per-request sampling seeds (``SamplingParams.seed``) on the real DecodeEngine.

A seeded request's completion token i is drawn from ``fold_in(fold_in(PRNGKey(seed),
prompt_len), i)`` only, so it must not depend on the slot, the other requests of the batch, the
engine instance or its seed, or a slot move. The references are the model's uncached forward
plus the documented key derivation, reduced with NumPy.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.inference.requests import slot_columns
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.types import SamplingParams

CFG = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128
)
LEN = 32  # max_target_length of every engine here (one reference padding)
P = [5, 17, 99, 3, 250]  # the request under test
OTHERS = [[200, 201], [7] * 11, [42, 1, 300, 8, 8, 9, 10], [3, 1, 4, 1, 5, 9]]
R = SamplingParams(temperature=1.0, max_tokens=10, seed=11)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@functools.cache
def _forward(graphdef):
    return jax.jit(lambda p, ids, pos: nnx.merge(graphdef, p)(ids, pos))


def completion_logits(engine, params, prompt, tokens):
    """Uncached forward logits (float64 ``[n, V]``) at each of the completion's positions."""
    ids = list(prompt) + list(tokens)
    padded = np.zeros((1, LEN), np.int32)
    padded[0, : len(ids)] = ids
    pos = np.arange(LEN, dtype=np.int32)[None]
    logits = np.asarray(_forward(engine._graphdef)(params, padded, pos)[0], np.float64)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def gumbel(key):
    return np.asarray(jax.random.gumbel(key, (CFG.vocab_size,)), np.float64)


def run(engine, params, plan, width=None):
    """Insert ``(call, slot, prompt, sampling)`` requests before generate call ``call`` and
    decode until each has ``max_tokens`` tokens. Returns ``{slot: (tokens, logprobs)}``."""
    state = engine.init_decode_state()
    out, want = {}, {}
    call = 0
    while call <= max(p[0] for p in plan) or any(len(out[s][0]) < want[s] for s in out):
        for at, slot, prompt, sp in plan:
            if at == call:
                padded = np.zeros(engine.max_prefill_length, np.int32)
                padded[: len(prompt)] = prompt
                prefix, _ = engine.prefill(
                    params=params, padded_tokens=padded, true_length=len(prompt)
                )
                state = engine.insert(prefix, state, slot, sampling=sp)
                out[slot], want[slot] = ([], []), sp.max_tokens
        state, result = engine.generate(params, state, width=width)
        result = result.convert_to_numpy()
        for slot, (tokens, logprobs) in out.items():
            tok, valid, lp, _ = slot_columns(result.get_result_at_slot(slot))
            tokens.extend(int(t) for t in tok[valid])
            logprobs.extend(float(x) for x in lp[valid])
        call += 1
    return out


def same(a, b):
    assert a[0] == b[0]
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)  # batch shapes may round differently


@pytest.fixture(scope="module")
def engine():
    return DecodeEngine(
        CFG,
        limits=EngineLimits(4, max_target_length=LEN, max_prefill_length=16, steps_per_call=3),
        decode_widths=(4, 1),
        seed=0,
    )


@pytest.fixture(scope="module")
def params(engine):
    return engine.load_params(seed=0)


@pytest.fixture(scope="module")
def alone(engine, params):
    """The request under test, alone in slot 0 of a fresh state."""
    return run(engine, params, [(0, 0, P, R)])[0]


def test_seed_must_be_none_or_an_int_in_range():
    for bad in (-1, 2**31, 1.5, True, "3"):
        with pytest.raises(ValueError, match=f"seed must be None or an int.*got {bad!r}"):
            SamplingParams(seed=bad)
    for good in (None, 0, 2**31 - 1, np.int64(5)):
        assert SamplingParams(seed=good).seed == good


def test_seeded_and_unseeded_tokens_follow_their_documented_keys(engine, params):
    """One batch, both kinds: seeded slot 2 draws token i with fold_in(fold_in(PRNGKey(seed),
    prompt_len), i); unseeded slot 1 draws its first token with the b-th key of
    split(step_key, slots), step_key = split(PRNGKey(engine seed))[1] (as before seeds)."""
    t = 0.8
    seeded = SamplingParams(temperature=t, max_tokens=8, seed=1234)
    free = SamplingParams(temperature=t, max_tokens=1)
    outs = run(engine, params, [(0, 1, OTHERS[0], free), (0, 2, P, seeded)])
    tokens, logprobs = outs[2]
    ref = completion_logits(engine, params, P, tokens)
    base = jax.random.fold_in(jax.random.PRNGKey(1234), len(P))
    expect = [
        int(np.argmax(ref[i] / t + gumbel(jax.random.fold_in(base, i)))) for i in range(len(tokens))
    ]
    assert tokens == expect
    np.testing.assert_allclose(logprobs, log_softmax(ref / t)[np.arange(8), tokens], atol=1e-5)
    step_key = jax.random.split(jax.random.PRNGKey(0))[1]
    row_key = jax.random.split(step_key, 4)[1]
    first = completion_logits(engine, params, OTHERS[0], outs[1][0])[0]
    assert outs[1][0] == [int(np.argmax(first / t + gumbel(row_key)))]


def test_same_seed_same_completion_in_any_slot_and_batch(engine, params, alone):
    """(a) another slot, (b) other requests around it (seeded, unseeded, truncated, greedy),
    inserted before or after it, with the engine stream at another point."""
    crowd = [
        (0, 0, OTHERS[0], SamplingParams(max_tokens=12)),
        (0, 1, OTHERS[1], SamplingParams(temperature=0.5, top_k=3, max_tokens=4, seed=5)),
        (0, 2, OTHERS[2], SamplingParams(temperature=0.0, max_tokens=6)),
        (0, 3, P, R),
    ]
    same(run(engine, params, crowd)[3], alone)
    later = [
        (0, 0, OTHERS[3], SamplingParams(temperature=1.3, top_p=0.7, max_tokens=14)),
        (0, 2, P, SamplingParams(temperature=1.0, max_tokens=10, seed=12)),
        (2, 1, P, R),  # joins after two calls: other slots mid-completion
    ]
    outs = run(engine, params, later)
    same(outs[1], alone)
    assert outs[2][0] != alone[0]  # another seed, same prompt, same step: another sample


def test_same_seed_same_completion_on_another_engine_with_another_seed(engine, params, alone):
    """(c) a separately built engine: other engine seed, slot count, steps per call."""
    other = DecodeEngine(
        CFG,
        limits=EngineLimits(2, max_target_length=LEN, max_prefill_length=8, steps_per_call=2),
        seed=99,
    )
    p2 = other.load_params(params)
    crowd = [(0, 0, OTHERS[0], SamplingParams(max_tokens=3)), (0, 1, P, R)]
    same(run(other, p2, crowd)[1], alone)
    # Without a seed, the two engines' streams differ: the check above is not vacuous.
    free = dataclasses.replace(R, seed=None)
    a = run(engine, params, [(0, 0, P, free)])[0]
    b = run(other, p2, [(0, 0, P, free)])[0]
    assert a[0] != b[0]


def test_driver_moves_a_seeded_request_to_a_narrow_width_and_fans_out_seeds(engine, params, alone):
    """(d) through the driver: the request starts in slot 3 and is packed into slot 0 for the
    width-1 program; a group of n seeded samples gets seeds seed, seed + 1, ..."""
    moves = []

    class Recording:
        def __getattr__(self, name):
            return getattr(engine, name)

        def move_slot(self, decode_state, src, dst):
            moves.append((src, dst))
            return engine.move_slot(decode_state, src, dst)

    drv = InferenceDriver(Recording(), params, 0, prefix_cache_size=0)
    short = SamplingParams(temperature=0.0, max_tokens=2)
    futs = [drv.submit(q, short)[0] for q in OTHERS[:3]] + drv.submit(P, R)
    drv.start()
    try:
        out = futs[-1].result(timeout=120)
        assert moves == [(3, 0)]
        group = [f.result(timeout=120) for f in drv.submit(P, R, n=2)]
    finally:
        drv.stop()
    same((out.token_ids, out.logprobs), alone)
    same((group[0].token_ids, group[0].logprobs), alone)
    next_seed = run(engine, params, [(0, 0, P, dataclasses.replace(R, seed=12))])[0]
    same((group[1].token_ids, group[1].logprobs), next_seed)
    assert group[1].token_ids != group[0].token_ids


def test_top_k_and_top_p_still_cut_seeded_samples(engine, params):
    k2 = SamplingParams(temperature=2.0, top_k=2, max_tokens=9, seed=3)
    head = SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=9, seed=3)
    plain = SamplingParams(temperature=2.0, max_tokens=9, seed=3)
    outs = run(engine, params, [(0, 0, P, k2), (0, 1, P, head), (0, 2, P, plain)])
    ref = completion_logits(engine, params, P, outs[0][0])
    top2 = np.argsort(-ref, axis=-1)[:, :2]
    assert all(t in row for t, row in zip(outs[0][0], top2, strict=True))
    ref = completion_logits(engine, params, P, outs[1][0])
    assert outs[1][0] == list(ref.argmax(-1))  # the tiny top-p head is the argmax
    # At T = 2 on these logits, untruncated draws leave the top 2 (so the cut did something).
    ref = completion_logits(engine, params, P, outs[2][0])
    top2 = np.argsort(-ref, axis=-1)[:, :2]
    assert any(t not in row for t, row in zip(outs[2][0], top2, strict=True))


def test_warm_up_compiles_every_program_the_loop_calls(engine):
    """After ``InferenceDriver.warm_up`` no prompt length or decode width compiles anything."""
    params = engine.load_params(seed=0)
    driver = InferenceDriver(engine, params, 0)
    programs = lambda: (  # noqa: E731
        sorted(engine._prefill_fns),
        sorted(engine._insert_fns),
        sorted(engine._generate_fns),
        [f._cache_size() for f in (*engine._prefill_fns.values(), *engine._generate_fns.values())],
        engine._move_fn._cache_size(),
    )
    assert driver.warm_up() > 0
    compiled = programs()
    assert compiled[0] == [8, 16] and compiled[2] == [1, 4]  # every bucket, every width
    driver.start()
    try:
        # Every bucket, a group of 4 (full width), then a lone one (narrow: moved, width 1).
        prompts = [list(range(3, 3 + n)) for n in (2, 9, 16)]
        futures = [f for p in prompts for f in driver.submit(p, SamplingParams(max_tokens=5), n=2)]
        [f.result(timeout=120) for f in futures]
        driver.submit([5, 6, 7], SamplingParams(max_tokens=9, seed=3))[0].result(timeout=120)
    finally:
        driver.stop()
    assert programs() == compiled
