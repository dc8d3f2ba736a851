"""Per-token log-probs and entropies from final hidden states, optionally in sequence chunks.

What it owns: ``token_stats(head, hidden, targets, temperatures, chunk)``, the trainer's one way
from ``hidden[R, T, E]`` to float32 ``(logp[R, T], entropy[R, T])`` at each token's sampling
temperature (``algorithms.losses`` maths). With ``chunk > 0`` the length is cut into chunks of
``chunk`` positions and each chunk's logits ``[R, chunk, V]`` live only inside one
``jax.checkpoint``-ed step of a ``lax.map``: the backward pass recomputes them per chunk, so no
``[R, T, V]`` float32 tensor exists in the compiled program (with a 150k vocab that tensor is
1.2 GB per 2048-token row). ``chunk == 0`` is the plain path: logits over the whole length.

Invariants: both paths compute the same numbers up to float32 rounding (each token's log-softmax
is over the full vocabulary either way; tests/trainer/test_chunked_logprobs.py); the outputs are
float32 whatever the compute dtype. ``head`` maps ``hidden[..., E]`` to float32 logits (the
model's ``logits_from_hidden``). Driven by ``trainer/step.py``; never touches params directly.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_orch.algorithms import losses


def _stats(logits, targets, temps, entropy: bool):
    if entropy:
        return losses.logprobs_and_entropy(logits, targets, temps)
    lp = losses.token_logprobs(logits, targets, temps)
    return lp, jnp.zeros_like(lp)


def token_stats(
    head: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    temperatures: jax.Array,
    chunk: int = 0,
    *,
    entropy: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``(logp, entropy)`` float32 ``[R, T]`` (entropy zeros when ``entropy=False``)."""
    if chunk < 0:
        raise ValueError(f"logprob chunk must be >= 0 (0: no chunking), got {chunk}")
    r, t = targets.shape
    if chunk == 0 or chunk >= t:
        return _stats(head(hidden), targets, temperatures, entropy)
    pad = (-t) % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        temperatures = jnp.pad(temperatures, ((0, 0), (0, pad)), constant_values=1.0)
    n = (t + pad) // chunk

    def split(x):
        return x.reshape(r, n, chunk, *x.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def one(xs):
        h, tg, tp = xs
        return _stats(head(h), tg, tp, entropy)

    lp, ent = jax.lax.map(one, (split(hidden), split(targets), split(temperatures)))
    join = lambda x: x.swapaxes(0, 1).reshape(r, n * chunk)[:, :t]
    return join(lp), join(ent)


def sft_loss_from_logprobs(lp: jax.Array, mask: jax.Array, weights: jax.Array):
    """``losses.sft_loss`` from log-probs already taken at T = 1 (the chunked path)."""
    maskf = jnp.asarray(mask).astype(jnp.float32)
    nll = -lp
    loss = jnp.sum(nll * weights)
    return loss, {
        "loss": jax.lax.stop_gradient(loss),
        "num_tokens": maskf.sum(),
        "nll": jnp.sum(jax.lax.stop_gradient(nll) * maskf),
    }
