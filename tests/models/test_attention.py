"""Attention backends vs the einsum reference (itself checked against NumPy): packed segments,
GQA, the length-aware cache path, gradients, and splash in Pallas interpret mode."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_orch.models import attention as A
from jaxrl_orch.models.tiled_attention import tile_bounds

B, T, H, KV, D = 2, 256, 4, 2, 32


def _np_attention(q, k, v, q_index, seg=None):
    """float64, one row and head at a time; query t sees key s iff s <= q_index[t] (and the same
    segment)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s, g = k.shape[1], h // k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        for hh in range(h):
            sc = q[r, :, hh] @ k[r, :, hh // g].T / math.sqrt(d)
            ok = np.arange(s)[None, :] <= np.asarray(q_index)[r][:, None]
            if seg is not None:
                ok &= np.asarray(seg)[r][:, None] == np.asarray(seg)[r][None, :]
            sc = np.where(ok, sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[r, :, hh] = (p / p.sum(-1, keepdims=True)) @ v[r, :, hh // g]
    return out


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, KV, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, KV, D)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 100:] = 2  # two packed samples in row 0
    seg[0, 230:] = 0  # and padding
    seg[1, 17:] = 3
    qi = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return q, k, v, jnp.asarray(seg), qi


def _self(q, k, v, seg, qi, impl, **kw):
    return A.attend(q, k, v, q_index=qi, segment_ids=seg, self_attention=True, impl=impl, **kw)


def test_einsum_reference_matches_numpy(qkv):
    q, k, v, seg, qi = qkv
    want = _np_attention(q, k, v, qi, seg)
    got = _self(q, k, v, seg, qi, "einsum")
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize("impl,kw", [("xla", {}), ("chunked", {"block": 64})])
def test_backends_match_einsum_with_segments_and_gqa(qkv, impl, kw):
    q, k, v, seg, qi = qkv
    ref = _self(q, k, v, seg, qi, "einsum")
    got = _self(q, k, v, seg, qi, impl, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)


def test_chunked_gradients_match_einsum(qkv):
    q, k, v, seg, qi = qkv
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(impl, q, k, v):
        return jnp.sum(_self(q, k, v, seg, qi, impl, block=64) * w)

    ref = jax.grad(lambda *a: loss("einsum", *a), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2))(q, k, v)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5)


def _rows(*runs):
    """Segment ids of one row from ``(id, length)`` runs, the same for every row of B."""
    row = np.concatenate([np.full(n, i, np.int32) for i, n in runs])
    return np.repeat(row[None], B, axis=0)


def test_tile_bounds_follow_segments_even_non_contiguous():
    seg = _rows((1, 64), (2, 128), (3, 64))  # 4 blocks of 64: [1], [2], [2], [3]
    lo, hi = tile_bounds(jnp.asarray(seg), T, 64)
    assert lo.tolist() == [0, 1, 1, 3] and hi.tolist() == [0, 2, 2, 3]
    seg[1, 200:210] = 2  # row 1: segment 2 comes back inside the last block
    lo, hi = tile_bounds(jnp.asarray(seg), T, 64)
    assert lo.tolist() == [0, 1, 1, 1] and hi.tolist() == [0, 3, 3, 3]
    seg[0, 250] = -5  # an id outside [0, T) gets the loosest bounds, never a skip
    lo, hi = tile_bounds(jnp.asarray(seg), T, 64)
    assert lo.tolist() == [0, 1, 1, 0] and hi.tolist() == [0, 3, 3, 3]
    lo, hi = tile_bounds(None, T, 64)
    assert lo.tolist() == [0] * 4 and hi.tolist() == [3] * 4


def test_non_contiguous_segments_match_einsum_forward_and_grad(qkv):
    q, k, v, _, qi = qkv
    seg = _rows((1, 64), (2, 128), (3, 64))
    seg[1, 200:210] = 2
    seg[0, 20:30] = 3
    seg = jnp.asarray(seg)
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    outs = {}
    for impl in ("einsum", "chunked"):
        fn = lambda q, k, v, impl=impl: jnp.sum(_self(q, k, v, seg, qi, impl, block=64) * w)
        outs[impl] = jax.value_and_grad(fn, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(float(outs["chunked"][0]), float(outs["einsum"][0]), rtol=1e-5)
    for r, g in zip(outs["einsum"][1], outs["chunked"][1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5)


def test_tiles_no_query_sees_are_never_read(qkv):
    """Two 128-token segments per row, blocks of 64: the second segment's queries never touch
    key block 0. NaN values there reach the einsum's output (0 * NaN) and the first segment's,
    but not the second segment's outputs or gradients: the tile is skipped, not masked."""
    q, k, v, _, qi = qkv
    seg = jnp.asarray(_rows((1, 128), (2, 128)))
    v = v.at[:, :64].set(jnp.nan)
    out = np.asarray(_self(q, k, v, seg, qi, "chunked", block=64))
    assert np.isnan(out[:, :128]).any() and np.isfinite(out[:, 128:]).all()
    assert np.isnan(np.asarray(_self(q, k, v, seg, qi, "einsum"))[:, 128:]).all()
    loss = lambda q, k, v: jnp.sum(_self(q, k, v, seg, qi, "chunked", block=64)[:, 128:] ** 2)
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g)[:, 128:]).all()


def test_bf16_tiles_match_the_bf16_einsum(qkv):
    q, k, v, seg, qi = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in qkv)
    loss = lambda impl: (
        lambda q, k, v: jnp.sum(_self(q, k, v, seg, qi, impl, block=64).astype(jnp.float32) ** 2)
    )
    ref = jax.value_and_grad(loss("einsum"), argnums=(0, 1, 2))(q, k, v)
    got = jax.value_and_grad(loss("chunked"), argnums=(0, 1, 2))(q, k, v)
    assert got[1][0].dtype == jnp.bfloat16
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=2e-2)
    for r, g in zip(ref[1], got[1], strict=True):
        r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
        assert np.abs(g - r).max() < 0.05 * np.abs(r).max()


def test_splash_interpret_matches_einsum_forward_and_grad(qkv):
    """The TPU kernel's own code path, run by the Pallas interpreter on CPU (its deviceless
    TPU compile is checked by tests/tools/test_aot.py)."""
    q, k, v, seg, qi = qkv
    ref = _self(q, k, v, seg, qi, "einsum")
    got = _self(q, k, v, seg, qi, "splash", block=128, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    gq = lambda impl, **kw: jax.grad(lambda q: jnp.sum(_self(q, k, v, seg, qi, impl, **kw) ** 2))
    np.testing.assert_allclose(
        np.asarray(gq("splash", block=128, interpret=True)(q)),
        np.asarray(gq("einsum")(q)),
        atol=1e-4,
    )


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("s", [300, 256])
def test_length_aware_cache_attention_matches_einsum(s, heads_first):
    """Decode-shaped calls read the cache only up to the furthest visible index; entries past a
    row's position never count, and a last partial block (300 = 2 x 128 + 44) counts each key
    once although its slice overlaps the block before."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(3, 1, H, D)), jnp.float32)
    ck = jnp.asarray(rng.normal(size=(3, s, KV, D)), jnp.float32)
    cv = jnp.asarray(rng.normal(size=(3, s, KV, D)), jnp.float32)
    pos = jnp.asarray([[0], [5], [s - 1]], jnp.int32)
    ref = A.attend(q, ck, cv, q_index=pos, impl="einsum")
    np.testing.assert_allclose(np.asarray(ref), _np_attention(q, ck, cv, pos), atol=2e-5)
    lay = (lambda x: jnp.swapaxes(x, 1, 2)) if heads_first else (lambda x: x)
    got = A.length_aware_attention(q, lay(ck), lay(cv), pos, 128, kv_heads_first=heads_first)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)
    # Junk past every position changes nothing: those blocks are never read.
    junk = ck.at[:2, 6:].set(1e4)
    short = A.length_aware_attention(q[:2], junk[:2], cv[:2], pos[:2], block=64)
    np.testing.assert_allclose(np.asarray(short), np.asarray(ref[:2]), atol=2e-6)


def test_chunked_cache_reads_take_the_loop_only_for_long_caches():
    """A cache shorter than LENGTH_AWARE_MIN_KEYS is read whole (one einsum, no loop); a longer
    one by the length-aware while_loop; both equal the einsum."""
    rng = np.random.default_rng(4)
    for s, loops in ((256, False), (A.LENGTH_AWARE_MIN_KEYS + 100, True)):
        q = jnp.asarray(rng.normal(size=(2, 1, H, D)), jnp.float32)
        ck = jnp.asarray(rng.normal(size=(2, KV, s, D)), jnp.float32)
        cv = jnp.asarray(rng.normal(size=(2, KV, s, D)), jnp.float32)
        pos = jnp.asarray([[3], [s - 1]], jnp.int32)
        call = lambda impl, q=q, ck=ck, cv=cv, pos=pos: A.attend(
            q, ck, cv, q_index=pos, impl=impl, block=128, kv_heads_first=True
        )
        assert ("while" in str(jax.make_jaxpr(call, static_argnums=0)("chunked"))) == loops
        np.testing.assert_allclose(
            np.asarray(call("chunked")), np.asarray(call("einsum")), atol=2e-6
        )


def test_bad_impl_and_shapes_are_named():
    with pytest.raises(ValueError, match="einsum.*'flash'"):
        A.check_impl("flash")
    q = jnp.zeros((1, 4, 2, 8))
    k = jnp.zeros((1, 6, 1, 8))
    with pytest.raises(ValueError, match="T == S"):
        A.attend(q, k, k, q_index=jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.ones((1, 4)))
