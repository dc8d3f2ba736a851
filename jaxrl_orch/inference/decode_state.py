"""The decode state's layout and the pure slot operations on it (build, insert, move, narrow).

Owns: what one ``DecodeEngine`` decode state holds -- the KV cache ``{"k", "v"}`` of
``init_cache`` (per layer ``[slots, kv_heads, max_target_length, head_dim]``; ``scan_layers``
models one ``[layers, slots, ...]`` array) and one row per slot of
``tokens`` (last token), ``pos`` (its position), ``active``, ``generated`` and the request's
sampling settings (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``stop [slots, m]``,
``seeded`` and its ``seed_key [slots, key words]`` = ``sampling.request_key(seed, prompt
length)``), plus one shared PRNG key ``rng`` for unseeded slots -- the jnp functions that move
slot rows around in it, and ``slot_fields`` (host side: one request's rows for ``insert``).

Invariants: every entry but ``rng`` has the slot axis (axis 0, or 1 for a stacked cache:
``cache_slot_axis``), so slot operations treat them alike by name, never by shape (a 2-slot
state and the 2-word key look the same); a moved or narrowed slot therefore keeps its
``seed_key`` and ``generated``, i.e. its seeded token stream. Functions here are pure and
shape-static; ``DecodeEngine`` jits them with donation and explicit shardings. Nothing here
knows about models, params or the driver.

Narrow decoding (why ``head`` / ``put_head`` exist): a decode step's cost is nearly proportional
to the slots it runs, so the engine can run only the first ``w`` slots. The narrow program
carries a copy of those rows (one copy in, one out per call), cheaper than attending over idle
rows once at most half the slots run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_orch.inference.sampling import request_key
from jaxrl_orch.models.kv_cache import cache_slot_axis, init_cache
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.types import SamplingParams

# Per-request settings written by insert; "token" lands in the state's "tokens" entry. The
# extra field "seed" only feeds "seed_key".
SLOT_FIELDS = ("token", "pos", "max_tokens", "temperature", "top_k", "top_p", "stop", "seeded")
STATE_KEYS = (
    "cache",
    "tokens",
    "pos",
    "active",
    "generated",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "stop",
    "seeded",
    "seed_key",
    "rng",
)


def build(
    config: ModelConfig,
    slots: int,
    max_target_length: int,
    cache_dtype: Any,
    max_stop_tokens: int,
    seed: int,
) -> dict[str, Any]:
    """An empty decode state: every slot inactive, zeroed cache."""
    zeros = lambda dt: jnp.zeros((slots,), dt)
    return {
        "cache": init_cache(config, slots, max_target_length, cache_dtype),
        "tokens": zeros(jnp.int32),
        "pos": zeros(jnp.int32),
        "active": zeros(bool),
        "generated": zeros(jnp.int32),
        "max_tokens": zeros(jnp.int32),
        "temperature": zeros(jnp.float32),
        "top_k": zeros(jnp.int32),
        "top_p": jnp.ones((slots,), jnp.float32),
        "stop": jnp.full((slots, max_stop_tokens), -1, jnp.int32),
        "seeded": zeros(bool),
        "seed_key": jax.vmap(jax.random.PRNGKey)(zeros(jnp.int32)),
        "rng": jax.random.PRNGKey(seed),
    }


def slot_fields(prefix: dict[str, Any], sampling: SamplingParams, max_stop: int) -> dict:
    """The rows ``insert`` writes for one request (host arrays: a new setting never recompiles);
    the prompt length of its seed key is ``prefix["pos"] + 1``."""
    stop = list(sampling.stop_token_ids)
    if len(stop) > max_stop:
        raise ValueError(
            f"{len(stop)} stop_token_ids {tuple(stop)}; this engine holds at most "
            f"max_stop_tokens={max_stop}"
        )
    return {
        "token": prefix["token"],
        "pos": prefix["pos"],
        "max_tokens": np.int32(sampling.max_tokens),
        "temperature": np.float32(sampling.temperature),
        "top_k": np.int32(sampling.top_k),
        "top_p": np.float32(sampling.top_p),
        "stop": np.array(stop + [-1] * (max_stop - len(stop)), np.int32),
        "seeded": np.bool_(sampling.seed is not None),
        "seed": np.int32(sampling.seed or 0),
    }


def insert(
    state: dict[str, Any], cache: Any, fields: dict[str, Any], slot: jax.Array
) -> dict[str, Any]:
    """Write a prefix's KV (``cache``, batch 1, any length) and its ``fields`` into ``slot``."""
    state = dict(state)
    state["cache"] = jax.tree.map(
        lambda dst, src: jax.lax.dynamic_update_slice_in_dim(
            dst, src.astype(dst.dtype), slot, axis=cache_slot_axis(dst)
        ),
        state["cache"],
        cache,
    )
    for name in SLOT_FIELDS:
        key = {"token": "tokens"}.get(name, name)
        state[key] = state[key].at[slot].set(fields[name])
    key = request_key(fields["seed"], fields["pos"] + 1)
    state["seed_key"] = state["seed_key"].at[slot].set(key)
    state["active"] = state["active"].at[slot].set(True)
    state["generated"] = state["generated"].at[slot].set(0)
    return state


def move(state: dict[str, Any], src: jax.Array, dst: jax.Array) -> dict[str, Any]:
    """Copy slot ``src``'s rows to ``dst``; ``src`` becomes inactive (unless it is ``dst``)."""
    moved = {}
    for name, value in state.items():
        if name == "rng":
            moved[name] = value
            continue

        def copy_row(x: jax.Array, name: str = name) -> jax.Array:
            axis = _slot_axis(name, x)
            row = jax.lax.dynamic_slice_in_dim(x, src, 1, axis=axis)
            return jax.lax.dynamic_update_slice_in_dim(x, row, dst, axis=axis)

        moved[name] = jax.tree.map(copy_row, value)
    moved["active"] = moved["active"].at[src].set(moved["active"][src] & (src == dst))
    return moved


def head(state: dict[str, Any], width: int) -> dict[str, Any]:
    """The state of slots ``[0, width)`` (``rng`` shared)."""
    return {
        name: value
        if name == "rng"
        else jax.tree.map(
            lambda x, name=name: jax.lax.slice_in_dim(x, 0, width, axis=_slot_axis(name, x)),
            value,
        )
        for name, value in state.items()
    }


def put_head(state: dict[str, Any], narrow: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its first slots replaced by ``narrow`` (from ``head``); ``rng`` from it."""
    merged = {}
    for name, value in state.items():
        if name == "rng":
            merged[name] = narrow[name]
            continue
        merged[name] = jax.tree.map(
            lambda dst, src, name=name: jax.lax.dynamic_update_slice_in_dim(
                dst, src, 0, axis=_slot_axis(name, dst)
            ),
            value,
            narrow[name],
        )
    return merged


def default_widths(slots: int) -> tuple[int, ...]:
    """``slots`` and its halvings down to ``slots // 8``: a drain narrows in 3 compiled steps."""
    widths = [slots]
    while widths[-1] % 2 == 0 and widths[-1] // 2 >= max(1, slots // 8):
        widths.append(widths[-1] // 2)
    return tuple(widths)


def check_widths(decode_widths: Any, slots: int) -> tuple[int, ...]:
    """The decode widths, largest first (default ``default_widths``); the largest must be
    ``slots``."""
    widths = default_widths(slots) if decode_widths is None else decode_widths
    widths = tuple(sorted({int(w) for w in widths}, reverse=True))
    if not widths or widths[0] != slots or widths[-1] < 1:
        raise ValueError(
            f"decode_widths={decode_widths!r} must be positive ints whose largest is "
            f"max_concurrent_decodes={slots}"
        )
    return widths


def _slot_axis(name: str, leaf: jax.Array) -> int:
    return cache_slot_axis(leaf) if name == "cache" else 0
