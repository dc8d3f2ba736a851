"""Decoder numerics: NumPy reference, cached decode == full forward, packing, axes, configs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import model_np_reference as ref

from jaxrl_orch.models import transformer as tf
from jaxrl_orch.models.tokenizer import ByteTokenizer
from jaxrl_orch.models.transformer import (
    ModelConfig,
    RopeScaling,
    Transformer,
    get_config,
    init_cache,
    logical_specs,
)

BASE = ModelConfig(
    vocab_size=67,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    rope_theta=10000.0,
    norm_eps=1e-6,
    max_seq_len=64,
)
VARIANTS = {
    "gqa-tied": BASE,
    "mha-untied": dataclasses.replace(BASE, n_kv_heads=4, tie_embeddings=False),
    "qwen3-qknorm": dataclasses.replace(BASE, qk_norm=True, n_kv_heads=1),
    "qwen2-bias": dataclasses.replace(BASE, qkv_bias=True),
    "llama3-rope": dataclasses.replace(
        BASE,
        rope_theta=500.0,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=32
        ),
    ),
}
# Every optional feature at once: the cached path shares all of them with the full forward.
ALL_FEATURES = dataclasses.replace(
    VARIANTS["llama3-rope"], qk_norm=True, qkv_bias=True, tie_embeddings=False
)


def make_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model with O(1) random weights, so attention patterns and norms actually matter
    (the 0.02-std default init makes every position look alike). Built abstractly and filled
    from NumPy: eager jax init would compile one tiny kernel per parameter shape."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def fill(x):
        noise = rng.normal(size=x.shape).astype(np.float32)
        # Norm weights (the only 1-D params) stay near 1, as trained ones do.
        return jnp.asarray(1.0 + 0.2 * noise if x.ndim == 1 else 0.3 * noise, x.dtype)

    return nnx.merge(graphdef, jax.tree.map(fill, state))


def numpy_params(model: Transformer) -> dict:
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model)))


@functools.cache
def _compiled(cfg: ModelConfig):
    """One pair of jitted entry points per config, shared by every test (compiles dominate)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]

    @jax.jit
    def full(state, tokens, positions, segment_ids):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids)

    @jax.jit
    def cached(state, tokens, positions, cache):
        return nnx.merge(graphdef, state).forward_cached(tokens, positions, cache)

    return full, cached


def jitted(model: Transformer):
    full, cached = _compiled(model.config)
    state = nnx.state(model)
    return (
        lambda t, p, s=None: full(state, t, p, s),
        lambda t, p, c: cached(state, t, p, c),
    )


def positions_for(tokens: np.ndarray) -> np.ndarray:
    return np.broadcast_to(np.arange(tokens.shape[-1], dtype=np.int32), tokens.shape).copy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_matches_numpy_reference(name):
    cfg = VARIANTS[name]
    model = make_model(cfg)
    full, _ = jitted(model)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    positions = positions_for(tokens) + np.array([[0], [3]], np.int32)  # offset start too
    got = np.asarray(full(tokens, positions))
    params = numpy_params(model)
    for row in range(2):
        want = ref.forward(params, cfg, tokens[row], positions[row])
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", [BASE, ALL_FEATURES], ids=["base", "all-features"])
def test_cached_prefill_and_decode_equal_full_forward(cfg):
    full, cached = jitted(make_model(cfg))
    rng = np.random.default_rng(1)
    lengths = [5, 2, 7]
    steps = 4
    seqs = [rng.integers(0, cfg.vocab_size, n + steps).astype(np.int32) for n in lengths]
    # Ragged prefill: right-padded prompts, padding positions run on past the true length and
    # write junk there that the decode steps must overwrite before it is ever attended.
    width = max(lengths)
    prompt = np.full((3, width), 3, np.int32)
    for r, n in enumerate(lengths):
        prompt[r, :n] = seqs[r][:n]
    cache = init_cache(cfg, 3, 32)
    logits, cache = cached(prompt, positions_for(prompt), cache)
    got = {r: [np.asarray(logits[r, n - 1])] for r, n in enumerate(lengths)}
    for step in range(steps):
        tok = np.array([[seqs[r][n + step]] for r, n in enumerate(lengths)], np.int32)
        pos = np.array([[n + step] for n in lengths], np.int32)
        logits, cache = cached(tok, pos, cache)
        for r in range(3):
            got[r].append(np.asarray(logits[r, 0]))
    # One full forward over right-padded rows (causality makes the padding irrelevant).
    whole = np.zeros((3, width + steps), np.int32)
    for r, seq in enumerate(seqs):
        whole[r, : len(seq)] = seq
    want = np.asarray(full(whole, positions_for(whole)))
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(
            np.stack(got[r]), want[r, n - 1 : n + steps], rtol=1e-5, atol=1e-5
        )


def test_stacked_cache_needs_a_scan_layers_model():
    cfg = VARIANTS["gqa-tied"]
    model = make_model(cfg)
    stacked = tf.init_cache(dataclasses.replace(cfg, scan_layers=True), 1, 8)
    tokens = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="stacked .* scan_layers"):
        model.forward_cached(tokens, positions_for(tokens), stacked)


def test_refilled_slot_ignores_previous_occupant():
    cfg = VARIANTS["gqa-tied"]
    _, cached = jitted(make_model(cfg))
    rng = np.random.default_rng(2)
    old = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    _, used = cached(old, positions_for(old), init_cache(cfg, 2, 32))
    # The new occupant: 6 real tokens, then padding (same shape, so no extra compile).
    new = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    from_used, _ = cached(new, positions_for(new), used)
    from_fresh, _ = cached(new, positions_for(new), init_cache(cfg, 2, 32))
    np.testing.assert_allclose(np.asarray(from_used), np.asarray(from_fresh), atol=1e-6)
    assert not np.allclose(np.asarray(old), np.asarray(new))


def test_cache_writes_beyond_length_are_dropped_and_cache_dtype_kept():
    cfg = VARIANTS["gqa-tied"]
    _, cached = jitted(make_model(cfg))
    tokens = np.array([[1, 2, 3]], np.int32)
    positions = np.array([[6, 7, 8]], np.int32)  # last position falls off an 8-entry cache
    cache = init_cache(cfg, 1, 8, dtype=jnp.bfloat16)
    logits, new = cached(tokens, positions, cache)
    assert len(new["k"]) == cfg.n_layers and logits.dtype == jnp.float32
    for layer, before in zip(new["k"], cache["k"], strict=True):
        assert layer.dtype == jnp.bfloat16 and layer.shape == before.shape
        k = np.asarray(layer.astype(jnp.float32))  # [batch, kv_heads, length, head_dim]
        assert np.all(k[:, :, :6] == 0) and np.all(np.any(k[:, :, 6:8] != 0, axis=(1, 3)))


def test_segment_ids_packing_equals_each_sequence_alone():
    cfg = VARIANTS["qwen3-qknorm"]
    full, _ = jitted(make_model(cfg))
    rng = np.random.default_rng(3)
    a = rng.integers(0, cfg.vocab_size, 5).astype(np.int32)
    b = rng.integers(0, cfg.vocab_size, 4).astype(np.int32)
    row = np.concatenate([a, b, np.zeros(3, np.int32)])[None]
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3], np.int32)
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3], np.int32)
    packed = np.asarray(full(row, pos, seg))[0]
    # Each sequence alone, right-padded into one [2, 12] batch (causality ignores the padding).
    alone = np.zeros((2, 12), np.int32)
    alone[0, :5], alone[1, :4] = a, b
    alone = np.asarray(full(alone, positions_for(alone), np.ones((2, 12), np.int32)))
    np.testing.assert_allclose(packed[:5], alone[0, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[5:9], alone[1, :4], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(packed))
    # The split entry points (hidden states, then a chunk of the LM head) compose to the same.
    graphdef, state = nnx.split(make_model(cfg))
    hidden = jax.jit(lambda s, *a: nnx.merge(graphdef, s).hidden_states(*a))(state, row, pos, seg)
    chunk = jax.jit(lambda s, h: nnx.merge(graphdef, s).logits_from_hidden(h))(
        state, hidden[:, 5:9]
    )
    np.testing.assert_allclose(np.asarray(chunk)[0], packed[5:9], rtol=1e-5, atol=1e-5)
    # With one segment for the whole row b would attend into a: the segment mask is what makes
    # packing exact.
    unmasked = np.asarray(full(row, pos, np.ones_like(seg)))[0]
    assert not np.allclose(unmasked[5:9], alone[1, :4], atol=1e-3)


def test_rms_norm_and_rope_match_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    norm = tf.RMSNorm(16, 1e-5, jnp.float32, rngs=nnx.Rngs(0))
    norm.weight[...] = jnp.asarray(rng.normal(size=16).astype(np.float32))
    want = ref.rms_norm(x, np.asarray(norm.weight[...], np.float64), 1e-5)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)

    scaling = RopeScaling(4.0, 1.0, 4.0, original_max_position=64)
    for sc in (None, scaling):
        np.testing.assert_allclose(
            tf.rope_inv_freq(16, 1000.0, sc), ref.inv_freq(16, 1000.0, sc), rtol=1e-6
        )
    q = rng.normal(size=(1, 5, 3, 16)).astype(np.float32)
    pos = np.array([[0, 1, 2, 10, 200]], np.int32)
    freqs = tf.rope_inv_freq(16, 1000.0)
    got = np.asarray(tf._apply_rope(jnp.asarray(q), jnp.asarray(pos), freqs))
    for h in range(3):
        want = ref.rope(q[0, :, h], pos[0], ref.inv_freq(16, 1000.0))
        np.testing.assert_allclose(got[0, :, h], want, rtol=1e-5, atol=1e-5)


def test_bf16_compute_stays_close_and_returns_float32():
    cfg = VARIANTS["gqa-tied"]
    model = make_model(cfg)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 8)).astype(np.int32)
    ref32 = np.asarray(jitted(model)[0](tokens, positions_for(tokens)))
    bf = make_model(dataclasses.replace(cfg, dtype=jnp.bfloat16))
    out = jitted(bf)[0](tokens, positions_for(tokens))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref32, atol=0.1 * np.abs(ref32).max())


ALLOWED_AXES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm"}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_param_has_logical_axes_of_its_rank(name):
    state = nnx.state(make_model(VARIANTS[name]))
    specs = logical_specs(state)
    is_spec = lambda x: isinstance(x, tuple)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    arrays = jax.tree.leaves(state)
    assert len(spec_leaves) == len(arrays)
    for spec, arr in zip(spec_leaves, arrays, strict=True):
        assert len(spec) == arr.ndim and set(spec) <= ALLOWED_AXES
    assert specs["embed"] == ("vocab", "embed")
    attn = specs["layers"][0]["attn"]
    assert attn["q_proj"] == ("embed", "heads", "head_dim")
    assert attn["k_proj"] == ("embed", "kv_heads", "head_dim")
    assert attn["o_proj"] == ("heads", "head_dim", "embed")
    assert specs["layers"][0]["mlp"]["down_proj"] == ("mlp", "embed")
    # Abstract (eval_shape) states carry the same metadata: meshes are planned before allocation.
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(VARIANTS[name], rngs=nnx.Rngs(0))))
    assert jax.tree.leaves(logical_specs(abstract), is_leaf=is_spec) == spec_leaves
    per_layer = ("cache_batch", "kv_heads", "cache_length", "head_dim")
    cfg = VARIANTS[name]
    assert tf.cache_logical_specs(cfg)["k"] == [per_layer] * cfg.n_layers
    scanned = dataclasses.replace(cfg, scan_layers=True)
    assert tf.cache_logical_specs(scanned)["v"] == ("layers", *per_layer)
    # The specs describe init_cache's tree, leaf for leaf, in both layouts.
    for c in (cfg, scanned):
        cache = jax.eval_shape(lambda c=c: tf.init_cache(c, 2, 8))
        specs = jax.tree.leaves(tf.cache_logical_specs(c), is_leaf=is_spec)
        assert [len(sp) for sp in specs] == [a.ndim for a in jax.tree.leaves(cache)]
    with pytest.raises(TypeError, match="Variables"):
        logical_specs(nnx.to_pure_dict(state))


def test_named_configs():
    tiny = get_config("tiny-byte")
    assert tiny.vocab_size == ByteTokenizer().vocab_size
    assert 0.8e6 < tiny.num_params < 1.3e6
    assert 2.5e6 < get_config("small-byte").num_params < 3.6e6
    # Published parameter counts of the real checkpoints (tied embeddings).
    assert abs(get_config("qwen2.5-0.5b").num_params - 494.0e6) < 1e6
    assert abs(get_config("qwen3-0.6b").num_params - 596.0e6) < 1e6
    assert abs(get_config("llama-3.2-1b").num_params - 1235.8e6) < 1e6
    # The 7-8B presets (untied embeddings): the exact counts of their safetensors.
    assert get_config("llama-3.1-8b").num_params == 8_030_261_248
    assert get_config("qwen2.5-7b").num_params == 7_615_616_512
    assert get_config("qwen3-8b").num_params == 8_190_735_360
    built = nnx.eval_shape(lambda: Transformer(tiny, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(built))) == tiny.num_params
    assert get_config("tiny-byte", dtype="bfloat16").dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="tiny-byte"):
        get_config("gpt-5")
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(BASE, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        get_config("tiny-byte", hidden=3)


def test_bad_inputs_raise_clear_errors():
    cfg = VARIANTS["gqa-tied"]
    model = make_model(cfg)
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="batch, length"):
        model(tokens, jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, tokens, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="cache"):
        model.forward_cached(tokens, tokens, init_cache(cfg, 3, 8))


def test_output_vocab_masks_padding_rows_in_every_logprob():
    from jaxrl_orch.algorithms.losses import logprobs_and_entropy

    base = get_config("tiny-byte")
    n = ByteTokenizer().output_vocab_size
    full = tf.Transformer(base, rngs=nnx.Rngs(3))
    masked = tf.Transformer(dataclasses.replace(base, output_vocab=n), rngs=nnx.Rngs(3))
    tokens = jnp.array([[5, 72, 105, 260, 33]], jnp.int32)
    pos = jnp.arange(5, dtype=jnp.int32)[None]
    lf, lm = full(tokens, pos), masked(tokens, pos)
    # Real ids keep their logits; the padding rows get no probability at any temperature.
    np.testing.assert_array_equal(np.asarray(lm[..., :n]), np.asarray(lf[..., :n]))
    for t in (1.0, 0.3):
        temps = jnp.full((1, 5), t)
        lp, ent = logprobs_and_entropy(lm, tokens, temps)
        want = jax.nn.log_softmax(lf[..., :n] / t, axis=-1)
        got = jnp.take_along_axis(want, tokens[..., None], axis=-1)[..., 0]
        np.testing.assert_allclose(np.asarray(lp), np.asarray(got), atol=1e-5)
        assert np.isfinite(np.asarray(ent)).all()
        assert float(jax.nn.softmax(lm / t, axis=-1)[..., n:].sum()) == 0.0
    with pytest.raises(ValueError, match="output_vocab must be in"):
        dataclasses.replace(base, output_vocab=base.vocab_size + 1)
