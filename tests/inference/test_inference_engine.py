"""DecodeEngine on a small real Transformer, driven by InferenceDriver.

References are the model's full (uncached) causal forward, reduced with NumPy.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.transformer import ModelConfig, init_cache, logical_specs
from jaxrl_orch.types import SamplingParams
from sharding.mesh import make_meshes
from sharding.reshard import reshard
from sharding.rules import TRAINER_RULES, resolve_shardings

CFG = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128
)
PROMPTS = [[5, 17, 99, 3], [200, 201], [7] * 11, [42, 1, 300, 8, 8, 9, 10]]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


REF_LEN = 48  # references pad to one length (causal: padding after T never changes logits[:T])


@functools.cache
def _forward(graphdef):
    return jax.jit(lambda p, ids, pos: nnx.merge(graphdef, p)(ids, pos))


@functools.cache
def _cached_step(graphdef):
    return jax.jit(
        lambda p, tok, pos, cache: nnx.merge(graphdef, p).forward_cached(tok, pos, cache)
    )


def full_logits(engine, params, ids):
    """Uncached forward over the whole sequence: float64 numpy ``[T, V]``."""
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, : len(ids)] = ids
    pos = np.arange(REF_LEN, dtype=np.int32)[None]
    return np.asarray(_forward(engine._graphdef)(params, padded, pos)[0], np.float64)[: len(ids)]


def completion_logits(engine, params, prompt, out):
    logits = full_logits(engine, params, list(prompt) + list(out.token_ids))
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]


@pytest.fixture(scope="module")
def engine():
    limits = EngineLimits(
        max_concurrent_decodes=2, max_target_length=48, max_prefill_length=16, steps_per_call=3
    )
    return DecodeEngine(CFG, limits=limits)


@pytest.fixture(scope="module")
def params(engine):
    return engine.load_params(seed=0)


@pytest.fixture
def driver(engine, params):
    d = InferenceDriver(engine, params, 0, prefix_cache_size=0)
    d.start()
    yield d
    d.stop()


def test_greedy_equals_iterated_argmax_of_full_forward_across_slot_reuse(engine, params, driver):
    lengths = [9, 4, 13, 6]
    futs = [
        driver.submit(p, SamplingParams(temperature=0.0, max_tokens=n))[0]
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]  # 4 requests through 2 slots: refilled slots must not see their previous occupant
    for prompt, n, fut in zip(PROMPTS, lengths, futs, strict=True):
        out = fut.result(timeout=120)
        assert len(out.token_ids) == n and out.finish_reason == "length"
        ref = completion_logits(engine, params, prompt, out)
        np.testing.assert_array_equal(out.token_ids, ref.argmax(-1))
        expect = log_softmax(ref)[np.arange(n), out.token_ids]  # greedy: T = 1 log-probs
        np.testing.assert_allclose(out.logprobs, expect, atol=1e-5)
        assert out.versions == [0] * n


def test_sampled_logprobs_match_tempered_full_forward_and_respect_top_k(engine, params, driver):
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=12)
    outs = [f.result(timeout=120) for f in driver.submit(PROMPTS[0], sp, n=3)]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # independent samples per slot
    for out in outs:
        ref = completion_logits(engine, params, PROMPTS[0], out)
        expect = log_softmax(ref / 0.7)[np.arange(12), out.token_ids]
        np.testing.assert_allclose(out.logprobs, expect, atol=1e-5)
        top5 = np.argsort(-ref, axis=-1)[:, :5]
        assert all(t in row for t, row in zip(out.token_ids, top5, strict=True))


def test_prefix_shared_group_equals_separately_prefilled(engine, params, driver):
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    before = driver.num_prefills
    group = [f.result(timeout=120) for f in driver.submit(PROMPTS[3], sp, n=3)]
    short = SamplingParams(temperature=0.0, max_tokens=4)
    mixed = [f.result(timeout=120) for f in driver.submit(PROMPTS[3], [short, sp])]
    assert driver.num_prefills == before + 2
    assert mixed[0].token_ids == group[0].token_ids[:4] and mixed[1].token_ids == group[0].token_ids
    alone = [driver.submit(PROMPTS[3], sp)[0].result(timeout=120) for _ in range(2)]
    assert driver.num_prefills == before + 4  # prefix cache off: each one prefilled again
    for out in group[1:] + alone:
        assert out.token_ids == group[0].token_ids
        np.testing.assert_allclose(out.logprobs, group[0].logprobs, atol=1e-6)


def test_stop_token_finishes_on_the_real_engine(driver):
    free = driver.submit(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8))[0]
    third = free.result(timeout=120).token_ids[2]
    sp = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(third,))
    out = driver.submit(PROMPTS[1], sp)[0].result(timeout=120)
    cut = out.token_ids.index(third) + 1
    assert out.finish_reason == "stop" and len(out.token_ids) == cut <= 3


def test_swap_mid_generation_versions_and_logprobs(engine, params):
    new_params = engine.load_params(seed=1)

    class SwapOnThirdCall:
        """Forwards to the engine; asks the driver to swap after two generate calls."""

        def __init__(self):
            self.calls, self.driver = 0, None

        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, params, decode_state, *, version=0):
            self.calls += 1
            if self.calls == 3:
                self.driver.swap_params(new_params, 1)  # lands before call 4
            return engine.generate(params, decode_state, version=version)

    wrapped = SwapOnThirdCall()
    drv = wrapped.driver = InferenceDriver(wrapped, params, 0, prefix_cache_size=0)
    drv.start()
    try:
        prompt = PROMPTS[2]
        out = drv.submit(prompt, SamplingParams(temperature=0.0, max_tokens=15))[0].result(120)
    finally:
        drv.stop()
    assert out.versions == [0] * 9 + [1] * 6  # 3 calls x 3 steps ran under version 0
    # swapping params never recompiles
    assert all(fn._cache_size() == 1 for fn in engine._generate_fns.values())

    # Reference: old tokens' KV stays in the cache (no re-prefill); later queries use new
    # params. Replayed token by token with the plain cached forward of each params set.
    step = _cached_step(engine._graphdef)
    seq = list(prompt) + out.token_ids
    cache = init_cache(CFG, 1, 48)
    expect = []
    for p, tok in enumerate(seq[:-1]):
        gen_index = p - (len(prompt) - 1)
        weights = new_params if gen_index >= 9 else params
        logits, cache = step(weights, np.array([[tok]], np.int32), np.array([[p]], np.int32), cache)
        if gen_index >= 0:
            row = np.asarray(logits[0, 0], np.float64)
            assert row.argmax() == seq[p + 1]
            expect.append(log_softmax(row)[seq[p + 1]])
    np.testing.assert_allclose(out.logprobs, expect, atol=1e-5)
    with_old = completion_logits(engine, params, prompt, out)
    assert not np.allclose(
        out.logprobs[9:], log_softmax(with_old)[np.arange(9, 15), out.token_ids[9:]]
    )


def test_engine_validates_its_inputs(engine, params):
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        engine.prefill(params=params, padded_tokens=np.zeros(32, np.int32), true_length=3)
    prefix, _ = engine.prefill(params=params, padded_tokens=np.ones(8, np.int32), true_length=2)
    with pytest.raises(ValueError, match="max_stop_tokens=4"):
        sp = SamplingParams(stop_token_ids=(1, 2, 3, 4, 5))
        engine.insert(prefix, engine.init_decode_state(), 0, sampling=sp)
    with pytest.raises(ValueError, match="slot must be in"):
        engine.insert(prefix, engine.init_decode_state(), 2)
    with pytest.raises(ValueError, match="max_prefill_length=64 must be <="):
        EngineLimits(max_target_length=32, max_prefill_length=64)
    with pytest.raises(ValueError, match="steps_per_call must be a positive int, got 0"):
        EngineLimits(steps_per_call=0)
    with pytest.raises(ValueError, match="max_target_length must be a positive int, got 1.5"):
        EngineLimits(max_target_length=1.5)
    # The one default: half the cache for the prompt.
    assert EngineLimits(max_target_length=48).max_prefill_length == 24
    assert engine.max_target_length == 48 and engine.steps_per_call == 3


@pytest.mark.slow
def test_sharded_engine_on_4_devices_matches_1_device_after_a_trainer_mesh_swap():
    cfg = ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=128
    )
    kw = dict(limits=EngineLimits(2, max_target_length=32, max_prefill_length=16))
    decode_mesh, trainer_mesh = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})
    one = DecodeEngine(cfg, **kw)
    four = DecodeEngine(cfg, mesh=decode_mesh, **kw)
    p1 = one.load_params(seed=3)
    # The weight watcher's path: params live on the trainer mesh, get resharded onto the
    # engine's decode shardings and swapped in.
    on_trainer = jax.device_put(
        p1, resolve_shardings(logical_specs(p1), trainer_mesh, TRAINER_RULES, shapes=p1)
    )
    p4 = reshard(on_trainer, four.param_shardings)
    q_kernel = [x for x in jax.tree.leaves(p4) if x.ndim == 3][0]
    assert q_kernel.sharding.device_set == set(decode_mesh.devices.flat)
    assert not q_kernel.sharding.is_fully_replicated
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    outs = []
    for eng, start_params, swap in ((one, p1, None), (four, four.load_params(seed=9), p4)):
        drv = InferenceDriver(eng, start_params, 0)
        if swap is not None:
            drv.swap_params(swap, 1)
        drv.start()
        try:
            outs.append(
                [f.result(timeout=120) for f in (drv.submit(q, sp)[0] for q in PROMPTS[:3])]
            )
        finally:
            drv.stop()
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and b.versions == [1] * 10
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_requests_with_new_sampling_settings_never_recompile(engine, driver):
    settings = [
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=1.3, top_k=7, max_tokens=5, stop_token_ids=(1, 2)),
        SamplingParams(temperature=0.2, top_p=0.5, max_tokens=2, stop_token_ids=(9,)),
        SamplingParams(temperature=1.0, max_tokens=2, seed=7),  # seeds are array values
        SamplingParams(temperature=0.9, top_k=4, max_tokens=3, seed=2**31 - 1),
    ]
    driver.submit(PROMPTS[0], settings[0])[0].result(timeout=120)  # compiles the 8-token bucket

    def compiled():
        fns = [
            *engine._generate_fns.values(),
            *engine._insert_fns.values(),
            *engine._prefill_fns.values(),
        ]
        return [fn._cache_size() for fn in fns]

    before = compiled()
    for sp in settings:
        driver.submit(PROMPTS[1], sp)[0].result(timeout=120)
    assert compiled() == before
    assert all(fn._cache_size() == 1 for fn in engine._generate_fns.values())
    init_fn = engine._init_state_fn  # a fresh decode state (a driver restart) reuses it too
    engine.init_decode_state()
    assert engine._init_state_fn is init_fn and init_fn._cache_size() == 1


@pytest.fixture(scope="module")
def engine4():
    return DecodeEngine(
        CFG,
        limits=EngineLimits(4, max_target_length=48, max_prefill_length=16, steps_per_call=2),
        decode_widths=(4, 1),  # each width is one more compile of the decode program
    )


def test_drain_narrows_the_decode_width_and_moved_requests_match_full_forward(engine4):
    params = engine4.load_params(seed=0)
    widths, moves = [], []

    class Recording:
        """Forwards to the engine; records the widths and slot moves the driver asks for."""

        def __getattr__(self, name):
            return getattr(engine4, name)

        def generate(self, params, decode_state, *, version=0, width=None):
            widths.append(width)
            return engine4.generate(params, decode_state, version=version, width=width)

        def move_slot(self, decode_state, src, dst):
            moves.append((src, dst))
            return engine4.move_slot(decode_state, src, dst)

    drv = InferenceDriver(Recording(), params, 0, prefix_cache_size=0)
    prompts = [*PROMPTS[:2], [7] * 6, PROMPTS[3]]  # one prefill bucket: fewer compiles
    lengths = [3, 7, 2, 14]  # slot 3 outlives the rest: packed into slot 0 once alone
    futs = [
        drv.submit(p, SamplingParams(temperature=0.0, max_tokens=n))[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    drv.start()  # after every submission: all four start together in slots 0-3
    try:
        outs = [f.result(timeout=120) for f in futs]
    finally:
        drv.stop()
    # 2 steps per call: full width while 2+ requests run (4 calls), then slot 3 alone.
    assert widths == [None] * 4 + [1] * 3 and moves == [(3, 0)]
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        ref = completion_logits(engine4, params, prompt, out)
        assert len(out.token_ids) == n
        np.testing.assert_array_equal(out.token_ids, ref.argmax(-1))
        np.testing.assert_allclose(
            out.logprobs, log_softmax(ref)[np.arange(n), out.token_ids], 1e-5
        )


def test_narrow_generate_leaves_upper_slots_untouched_and_validates(engine4):
    params = engine4.load_params(seed=0)
    state = engine4.init_decode_state()
    prefix, _ = engine4.prefill(params=params, padded_tokens=np.ones(8, np.int32), true_length=5)
    for slot in range(4):
        state = engine4.insert(prefix, state, slot, sampling=SamplingParams(temperature=0.0))
    before = jax.tree.map(np.asarray, state)
    state, result = engine4.generate(params, state, width=1)
    after = jax.tree.map(np.asarray, state)
    assert np.asarray(result.data).shape[0] == 1
    assert np.all(np.asarray(result.data)[0, 2:4] == 1)  # the narrow slot made 2 tokens
    np.testing.assert_array_equal(after["pos"], before["pos"] + [2, 0, 0, 0])
    stack = lambda state, name: np.stack(state["cache"][name])  # [layers, slots, ...]
    np.testing.assert_array_equal(stack(after, "k")[:, 1:], stack(before, "k")[:, 1:])
    state = engine4.move_slot(state, 0, 3)
    moved = jax.tree.map(np.asarray, state)
    np.testing.assert_array_equal(stack(moved, "v")[:, 3], stack(after, "v")[:, 0])
    assert moved["pos"][3] == after["pos"][0] and list(moved["active"]) == [False, True, True, True]
    with pytest.raises(ValueError, match=r"decode_widths=\(4, 1\), got 3"):
        engine4.generate(params, state, width=3)
    with pytest.raises(ValueError, match="src slot must be in"):
        engine4.move_slot(state, 4, 0)
    with pytest.raises(ValueError, match="largest is max_concurrent_decodes=4"):
        DecodeEngine(CFG, limits=EngineLimits(max_concurrent_decodes=4), decode_widths=(2, 1))
    wide = DecodeEngine(CFG, limits=EngineLimits(max_concurrent_decodes=32))
    assert wide.decode_widths == (32, 16, 8, 4)
