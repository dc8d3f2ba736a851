"""Rotary position embeddings: inverse frequencies (optionally Llama-3 scaled) and the rotation.

The halves layout of HF's ``rotate_half`` (the pairing HF checkpoints of the Llama / Qwen
families use), computed in float32 whatever the activations' dtype. Pure functions; the
transformer (``models/transformer.py``) is the only caller.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_orch.models.configs import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """RoPE inverse frequencies, float32 ``[head_dim // 2]``, with optional Llama-3 scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x[B,T,H,D]`` by ``positions[B,T]``; halves layout (HF ``rotate_half``)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
