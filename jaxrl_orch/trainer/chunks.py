"""The train step's row chunks: targets shifted in, rows split into chunks, scans over them.

What it owns: ``shift_targets`` (inputs ``[R, L]``, targets ``[R, L-1]``, the mask rule of
``trainer/step.py``), ``to_chunks`` / ``take_rows`` (views of a batch), ``scan`` (``lax.scan``
with a length-1 scan inlined) and ``skip_empty``: a chunk with no loss token (all padding rows:
the trainer pads every batch to a fixed row count, so shapes never change mid-run) takes the
cheap branch of a ``lax.cond`` instead of a forward and backward pass. Skipping is exact: such a
chunk's loss weights are all zero, so its gradients and metric sums are zeros (``ratio_max``:
-inf), which the accumulation would have added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def shift_targets(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Inputs ``[R, L]`` and targets ``[R, L-1]`` (see module docstring for the mask rule)."""
    seg = batch["segment_ids"]
    same_seq = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return {
        "tokens": batch["tokens"],
        "positions": batch["positions"],
        "segment_ids": seg,
        "targets": batch["tokens"][:, 1:],
        "target_segments": seg[:, 1:],
        "mask": batch["loss_mask"][:, 1:].astype(bool) & same_seq,
        "advantages": batch["advantages"][:, 1:],
        "behavior": batch["logprobs"][:, 1:],
        "temperatures": batch["temperatures"][:, 1:],
    }


def take_rows(tree: dict[str, jax.Array], idx: jax.Array) -> dict[str, jax.Array]:
    return {k: jnp.take(v, idx, axis=0) for k, v in tree.items()}


def to_chunks(tree: dict[str, jax.Array], chunk_rows: int) -> dict[str, jax.Array]:
    return {
        k: v.reshape(v.shape[0] // chunk_rows, chunk_rows, *v.shape[1:]) for k, v in tree.items()
    }


def scan(f: Callable, init: Any, xs: Any) -> tuple[Any, Any]:
    """``lax.scan``, except a length-1 scan is inlined: the common one-chunk / one-minibatch
    step then compiles to the same graph as a hand-written step (smaller, faster program)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    if n != 1:
        return jax.lax.scan(f, init, xs)
    carry, y = f(init, jax.tree.map(lambda v: v[0], xs))
    return carry, jax.tree.map(lambda v: v[None], y)


def skip_empty(chunk: dict[str, jax.Array], work: Callable, skip: Callable, operand: Any) -> Any:
    """``work(operand)`` when ``chunk`` holds a loss token, else ``skip(operand)`` (one
    ``lax.cond``: both branches are compiled, only one runs)."""
    return jax.lax.cond(jnp.any(chunk["mask"]), work, skip, operand)
