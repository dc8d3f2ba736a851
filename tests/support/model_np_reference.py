"""Plain NumPy reference of the decoder, written from the maths (not from transformer.py).

Used by the model tests as the independent numerical oracle: float64 throughout, one
sequence at a time, explicit loops over heads so grouped-query sharing is spelled out.
"""

from __future__ import annotations

import math

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    freqs = np.array([theta ** (-(2 * i) / head_dim) for i in range(head_dim // 2)])
    if scaling is None:
        return freqs
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < scaling.original_max_position / scaling.high_freq_factor:
            out.append(f)
        elif wavelen > scaling.original_max_position / scaling.low_freq_factor:
            out.append(f / scaling.factor)
        else:
            s = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            out.append((1 - s) * f / scaling.factor + s * f)
    return np.array(out)


def rope(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """x[T, D] rotated by pos[T]: pair (i, i + D/2) rotates by angle pos * freqs[i]."""
    half = x.shape[-1] // 2
    out = np.empty_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for i in range(half):
            a = pos[t] * freqs[i]
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[t, i], x[t, i + half]
            out[t, i] = x1 * c - x2 * s
            out[t, i + half] = x2 * c + x1 * s
    return out


def forward(params: dict, cfg, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal forward of one sequence ``tokens[T]`` -> ``logits[T, V]`` (float64).

    ``params`` is ``nnx.state(model).to_pure_dict()`` converted to NumPy.
    """
    p = params
    freqs = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    group = cfg.n_heads // cfg.n_kv_heads
    x = p["embed"][tokens].astype(np.float64)
    t = len(tokens)
    for li in range(cfg.n_layers):
        lp = p["layers"][li]
        a = lp["attn"]
        h = rms_norm(x, lp["input_norm"]["weight"], cfg.norm_eps)
        heads_out = []
        for hi in range(cfg.n_heads):
            kv = hi // group
            q = h @ a["q_proj"][:, hi, :]
            k = h @ a["k_proj"][:, kv, :]
            v = h @ a["v_proj"][:, kv, :]
            if cfg.qkv_bias:
                q, k, v = q + a["q_bias"][hi], k + a["k_bias"][kv], v + a["v_bias"][kv]
            if cfg.qk_norm:
                q = rms_norm(q, a["q_norm"]["weight"], cfg.norm_eps)
                k = rms_norm(k, a["k_norm"]["weight"], cfg.norm_eps)
            q, k = rope(q, positions, freqs), rope(k, positions, freqs)
            scores = q @ k.T / math.sqrt(cfg.head_dim)
            scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            heads_out.append((probs @ v) @ a["o_proj"][hi])
        x = x + sum(heads_out)
        m = lp["mlp"]
        h = rms_norm(x, lp["post_attn_norm"]["weight"], cfg.norm_eps)
        gate = h @ m["gate_proj"]
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ m["up_proj"])) @ m["down_proj"]
    x = rms_norm(x, p["final_norm"]["weight"], cfg.norm_eps)
    head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head
