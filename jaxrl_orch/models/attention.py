"""Attention: one entry point, several backends, the einsum kept as the reference oracle.

What it owns
    ``attend(q, k, v, *, q_index, segment_ids=None, impl=...)``: grouped-query attention of
    ``q[B,T,H,D]`` over ``k, v[B,S,Hkv,D]`` where query ``t`` of row ``b`` sees key ``s`` iff
    ``s <= q_index[b, t]`` and (with ``segment_ids``, self-attention only) both sit in the same
    segment. That one rule covers the trainer's packed causal rows (``q_index = arange(T)``) and
    the engine's cache (``q_index = positions``: a query sees the cache up to its own index).
    Softmax statistics are always float32; the output has ``v``'s dtype. ``kv_heads_first``:
    k / v come as ``[B, Hkv, S, D]``, the KV cache's layout, read without a transpose by the
    einsum and length-aware paths (the others swap the axes first).

Backends (``IMPLS``)
    - ``"einsum"``: the full ``[B, Hkv, G, T, S]`` score tensor, materialised. The oracle every
      other backend is tested against (tests/models/test_attention.py).
    - ``"xla"``: ``jax.nn.dot_product_attention`` (XLA's fused attention; cuDNN flash on GPU).
    - ``"chunked"``: no ``T x S`` tensor in the trainer's path, on any backend. Causal
      self-attention (packed trainer rows) is ``models/tiled_attention.py``: flash attention's
      algorithm in plain XLA, ``block x block`` tiles with an online softmax and a hand-written
      backward, visiting only the tiles some query can see (causally and by segment). A
      non-causal call of ``T % block == 0`` runs query blocks of ``block`` rows, each
      rematerialised in the backward pass (``jax.checkpoint``); a self-attention of at most one
      block is the einsum. The CPU default (``compose/precision.py``). Cache
      calls (``self_attention=False``, ``T < block``) become length-aware instead: a
      ``while_loop`` over key blocks stops after the last block any query of the batch can see,
      so a decode step reads ``max(position)`` of the cache, not all of it (online softmax);
      caches shorter than ``LENGTH_AWARE_MIN_KEYS`` are read whole by the einsum.
    - ``"splash"``: the Pallas TPU splash-attention kernel (causal + segment ids, GQA), one
      kernel per row under ``shard_map`` when a mesh is set. Self-attention only; a cached
      (decode) call with ``"splash"`` takes the length-aware ``"chunked"`` path.
      ``interpret=True`` runs the kernel in Pallas interpret mode (CPU tests).

Invariants: every backend computes the same function up to float rounding (the masked entries
get probability 0; a fully masked row, which callers never produce, is undefined). Nothing here
resolves logical axis names: ``splash`` is given its ``PartitionSpec``s by the caller (the
trainer resolves them in ``sharding/rules.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_orch.models.matmul import dot32
from jaxrl_orch.models.tiled_attention import tiled_self_attention

IMPLS = ("einsum", "xla", "chunked", "splash")
# Below this many cache positions a cache read is the einsum over the whole cache: reading every
# key beats the length-aware loop, whose key blocks are copied out of the cache each iteration.
# A decode step of small-byte, 32 slots, on CPU (measured): 320-position cache, einsum 6.3-7.0 ms
# at every context, the loop 6.0 ms at context 40 and 9-10 ms at 280; 1024 positions, einsum
# 11 ms, the loop 6.7 ms at context 160 and 16.5 ms at 900 -- about even over a rollout whose
# contexts sweep the cache, so 1024 is where the loop starts to pay.
LENGTH_AWARE_MIN_KEYS = 1024
_NEG = jnp.finfo(jnp.float32).min


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _mask(q_index, s: int, segment_ids):
    mask = jnp.arange(s)[None, None, :] <= q_index[:, :, None]  # [B,T,S]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def _kv(kv_heads_first: bool) -> str:
    """The einsum letters of k / v: ``[B, S, Hkv, D]``, or the cache's ``[B, Hkv, S, D]``."""
    return "bksd" if kv_heads_first else "bskd"


def einsum_attention(q, k, v, q_index, segment_ids=None, kv_heads_first=False):
    """The reference: full scores, float32 softmax (the pre-backend ``_attend``, unchanged)."""
    b, t, h, d = q.shape
    hkv, s = (k.shape[1], k.shape[2]) if kv_heads_first else (k.shape[2], k.shape[1])
    kv = _kv(kv_heads_first)
    mask = _mask(q_index, s, segment_ids)
    qg = q.reshape(b, t, hkv, h // hkv, d)
    scores = dot32(f"btkgd,{kv}->bkgts", qg, k) / math.sqrt(d)
    # A finite floor, not -inf: a fully masked row yields a uniform average instead of NaNs.
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if kv_heads_first:
        # A cache read: with the batch axes leading in the output too, XLA:CPU runs it as its
        # fast batched dot, where the [b, t, k, g, d] output fell back to a per-batch loop
        # (~5x slower in a decode step, measured; the trainer's layout is unaffected).
        out = dot32(f"bkgts,{kv}->bkgtd", probs, v).astype(v.dtype)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d)
    out = dot32(f"bkgts,{kv}->btkgd", probs, v).astype(v.dtype)
    return out.reshape(b, t, h, d)


def xla_attention(q, k, v, q_index, segment_ids=None):
    mask = _mask(q_index, k.shape[1], segment_ids)[:, None]  # [B,1,T,S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _block_scores(qg, k, d):
    return dot32("btkgd,bskd->bkgts", qg, k) / math.sqrt(d)


def _query_blocks(q, k, v, q_index, segment_ids, block):
    """Attention in query blocks of ``block`` rows, each rematerialised in the backward pass:
    peak memory ``O(block * S)`` (the non-causal long reads; causal rows are tiled instead)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    n = t // block
    qb = q.reshape(b, n, block, hkv, h // hkv, d).swapaxes(0, 1)
    ib = q_index.reshape(b, n, block).swapaxes(0, 1)
    sb = None if segment_ids is None else segment_ids.reshape(b, n, block).swapaxes(0, 1)

    @jax.checkpoint
    def one(qg, idx, seg, k, v, kv_seg):
        mask = jnp.arange(k.shape[1])[None, None, :] <= idx[:, :, None]
        if seg is not None:
            mask = mask & (seg[:, :, None] == kv_seg[:, None, :])
        scores = jnp.where(mask[:, None, None], _block_scores(qg, k, d), _NEG)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return dot32("bkgts,bskd->btkgd", probs, v).astype(v.dtype)

    if sb is None:
        out = jax.lax.map(lambda xs: one(xs[0], xs[1], None, k, v, None), (qb, ib))
    else:
        out = jax.lax.map(lambda xs: one(*xs, k, v, segment_ids), (qb, ib, sb))
    return out.swapaxes(0, 1).reshape(b, t, h, d)


def length_aware_attention(q, k, v, q_index, block: int = 128, kv_heads_first: bool = False):
    """Cache attention that reads key blocks only up to the furthest visible index."""
    b, t, h, d = q.shape
    axis = 2 if kv_heads_first else 1  # the keys' position axis
    s = k.shape[axis]
    hkv = k.shape[3 - axis]
    kv = _kv(kv_heads_first)
    g = h // hkv
    block = min(block, s)
    qg = q.reshape(b, t, hkv, g, d)
    n_needed = jnp.minimum(jnp.max(q_index) // block + 1, -(-s // block))

    def body(carry):
        i, m, denom, acc = carry
        # A last partial block is read as the final ``block`` keys (the slice start clamped,
        # never the cache padded: a pad would copy the whole cache every step); the keys it
        # shares with the block before are masked out, so each key counts once.
        lo = i * block
        start = jnp.minimum(lo, s - block)
        kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=axis)
        vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=axis)
        idx = start + jnp.arange(block)
        visible = (idx[None, None, :] <= q_index[:, :, None]) & (idx >= lo)[None, None, :]
        scores = jnp.einsum(f"btkgd,{kv}->bkgts", qg, kb, preferred_element_type=jnp.float32)
        sc = jnp.where(visible[:, None, None], scores / math.sqrt(d), _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.exp(sc - m_new[..., None])
        scale = jnp.exp(m - m_new)
        denom = denom * scale + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            f"bkgts,{kv}->bkgtd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32
        )
        acc = acc * scale[..., None] + pv
        return i + 1, m_new, denom, acc

    init = (
        jnp.int32(0),
        jnp.full((b, hkv, g, t), _NEG, jnp.float32),
        jnp.zeros((b, hkv, g, t), jnp.float32),
        jnp.zeros((b, hkv, g, t, d), jnp.float32),
    )
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < n_needed, body, init)
    out = (acc / denom[..., None]).astype(v.dtype)  # [B,K,G,T,D]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d)


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, t: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
    bq = min(block, t)
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bq,
        block_kv_compute=bq,
        block_q_dkv=bq,
        block_kv_dkv=bq,
        block_kv_dkv_compute=bq,
        block_q_dq=bq,
        block_kv_dq=bq,
    )
    kernel = sk.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    return kernel, sk.SegmentIds


def splash_attention(q, k, v, segment_ids, *, block=512, specs=None, interpret=False):
    """Splash kernel over ``[B,T,H,D]`` rows (causal, segment ids, GQA). ``specs``: optional
    ``(mesh, q_spec, kv_spec, seg_spec)``; the kernel then runs per shard under ``shard_map``
    (a Pallas call is not auto-partitioned)."""
    b, t, h, d = q.shape
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    scale = 1.0 / math.sqrt(d)

    def local(q, k, v, seg):
        kernel, seg_cls = _splash_kernel(q.shape[2], q.shape[1], block, interpret)
        qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)  # [b,H,T,D]
        kh = jnp.swapaxes(k, 1, 2)
        vh = jnp.swapaxes(v, 1, 2)
        ids = seg_cls(q=seg, kv=seg)
        out = jax.vmap(kernel)(qh, kh, vh, segment_ids=ids)
        return jnp.swapaxes(out, 1, 2).astype(v.dtype)

    if specs is None:
        return local(q, k, v, segment_ids.astype(jnp.int32))
    mesh, q_spec, kv_spec, seg_spec = specs
    if q_spec[2] is not None and kv_spec[2] is None:
        # kv heads do not split over the heads' axis: give every query head its kv head.
        k = jnp.repeat(k, h // k.shape[2], axis=2)
        v = jnp.repeat(v, h // v.shape[2], axis=2)
        kv_spec = q_spec
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return fn(q, k, v, segment_ids.astype(jnp.int32))


def attend(
    q,
    k,
    v,
    *,
    q_index,
    segment_ids=None,
    self_attention: bool = False,
    impl: str = "einsum",
    block: int = 512,
    splash_specs: tuple[Any, PartitionSpec, PartitionSpec, PartitionSpec] | None = None,
    interpret: bool = False,
    kv_heads_first: bool = False,
):
    """The one entry point (see the module docstring for the mask rule and the backends).
    ``self_attention``: ``q_index`` is each query's own row position (packed causal rows).
    ``kv_heads_first``: k / v are ``[B, Hkv, S, D]`` (the KV cache's layout)."""
    check_impl(impl)
    t = q.shape[1]
    s = k.shape[2 if kv_heads_first else 1]
    if segment_ids is not None and t != s:
        raise ValueError(f"segment_ids need self-attention (T == S), got T={t}, S={s}")
    if impl == "einsum":
        return einsum_attention(q, k, v, q_index, segment_ids, kv_heads_first)
    if kv_heads_first and ((t % block == 0 and t > block) or self_attention or impl == "xla"):
        # The backends below take [B, S, Hkv, D]; cache reads are long prefills here.
        k = jnp.swapaxes(k, 1, 2)
        v = jnp.swapaxes(v, 1, 2)
        kv_heads_first = False
    if impl == "xla":
        return xla_attention(q, k, v, q_index, segment_ids)
    if impl == "splash" and self_attention:
        if t % min(block, t):
            raise ValueError(f"splash attention needs T ({t}) to be a multiple of block {block}")
        return splash_attention(
            q, k, v, segment_ids, block=block, specs=splash_specs, interpret=interpret
        )
    if t % block == 0 and t > block:
        if self_attention:
            return tiled_self_attention(q, k, v, q_index, segment_ids, block)
        return _query_blocks(q, k, v, q_index, segment_ids, block)
    if not self_attention and t < block and s >= LENGTH_AWARE_MIN_KEYS:
        # A long cache read (decode / short prefill): never differentiated, so a while_loop
        # may stop at the furthest visible block.
        return length_aware_attention(
            q, k, v, q_index, block=min(block, 128), kv_heads_first=kv_heads_first
        )
    return einsum_attention(q, k, v, q_index, segment_ids, kv_heads_first)
