"""The KV cache's layout: ``init_cache`` builds it, ``cache_logical_specs`` names its axes.

Owns the one fact every user of the cache shares (``Transformer.forward_cached`` writes and
reads it, ``inference/decode_state`` moves slot rows around in it, the engine shards it): what
the ``{"k", "v"}`` tree holds. Pure shape code; no model maths.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxrl_orch.models.configs import ModelConfig

# One array per layer, heads before positions: ``[slots, kv_heads, length, head_dim]``. A decode
# step's attention then reads each (slot, kv head)'s keys as one contiguous [length, head_dim]
# matrix straight from the layer's own buffer. Heads-first: the [.., length, kv_heads, ..]
# layout was copied transposed every step (2.6x slower per layer on CPU). Per layer: slicing
# layer i out of one [layers, ...] array made XLA copy that layer's whole cache every step
# (about 40% of a small model's decode step on CPU, measured). ``scan_layers`` models keep the
# layers stacked (``CACHE_AXES``), since their scan takes one layer's slice per iteration.
LAYER_CACHE_AXES = ("cache_batch", "kv_heads", "cache_length", "head_dim")
CACHE_AXES = ("layers", *LAYER_CACHE_AXES)


def init_cache(
    config: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Zeroed KV cache ``{"k", "v"}``: a list of ``n_layers`` arrays
    ``[batch, kv_heads, max_len, head_dim]`` each, or with ``config.scan_layers`` one stacked
    ``[layers, batch, kv_heads, max_len, head_dim]`` array (``cache_logical_specs``)."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"cache batch and max_len must be > 0, got {batch}, {max_len}")
    shape = (batch, config.n_kv_heads, max_len, config.head_dim)
    if config.scan_layers:
        stacked = (config.n_layers, *shape)
        return {"k": jnp.zeros(stacked, dtype), "v": jnp.zeros(stacked, dtype)}
    return {n: [jnp.zeros(shape, dtype) for _ in range(config.n_layers)] for n in ("k", "v")}


def cache_logical_specs(config: ModelConfig) -> dict[str, Any]:
    """Logical axis names of ``init_cache(config, ...)``'s pytree (tuples are its leaves)."""
    if config.scan_layers:
        return {"k": CACHE_AXES, "v": CACHE_AXES}
    return {n: [LAYER_CACHE_AXES] * config.n_layers for n in ("k", "v")}


def cache_slot_axis(leaf: Any) -> int:
    """The slot (batch) axis of one cache array: 1 when stacked over layers, else 0."""
    return 1 if leaf.ndim == len(CACHE_AXES) else 0
