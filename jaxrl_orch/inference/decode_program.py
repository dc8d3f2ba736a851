"""The decode program: ``steps`` decode steps of a batch of slots in one ``lax.scan``, and the
result columns it writes.

What it owns: ``decode_steps(model, state, version, ...)``, the traced body of the engine's
jitted ``generate`` (feed each slot its last token, sample the next with ``sampling``, apply
the device-side finishing rules, advance), and ``result_tokens``, the ``ResultTokens`` that
names the columns of the one int32 array it returns (``engine_api``'s layout).

Two variants, chosen when the engine builds a program, never per step:
- the default (``top=0``): ids, valid flags, the request's length, the sampled tokens'
  log-probs and the version stamp; what every rollout decodes with;
- the top-k variant (``top > 0``): the same, plus each step's ``top`` most likely ids and their
  log-probs (``sampling.top_alternatives``: the tempered distribution the sampled token's
  log-prob is read from). The driver runs it only while some running request asks for
  alternatives, so the default program (the training path) carries no top-k: it traces exactly
  what it traced before the variant existed.

Pure and traced: no host state, no Python branching on array values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_orch.inference.engine_api import ResultTokens
from jaxrl_orch.inference.sampling import row_keys, sample_tokens, top_alternatives


def decode_steps(
    model: Any,
    state: dict[str, Any],
    version: jax.Array,
    *,
    length: int,
    steps: int,
    top: int = 0,
) -> tuple[dict[str, Any], jax.Array]:
    """``steps`` decode steps of every row of ``state`` against a cache of ``length``
    positions; returns the advanced state and the result columns (``result_tokens``)."""

    def step(s: dict[str, Any], _: Any):
        logits, cache = model.forward_cached(s["tokens"][:, None], s["pos"][:, None], s["cache"])
        rng, key = jax.random.split(s["rng"])
        keys = row_keys(key, s["seed_key"], s["seeded"], s["generated"])  # token index
        tok, logprob = sample_tokens(
            logits[:, 0], None, s["temperature"], s["top_k"], s["top_p"], keys=keys
        )
        valid = s["active"]
        generated = s["generated"] + valid.astype(jnp.int32)
        done = (
            jnp.any(tok[:, None] == s["stop"], axis=-1)
            | (generated >= s["max_tokens"])
            | (s["pos"] + 1 >= length)
        )
        s = {
            **s,
            "cache": cache,
            "rng": rng,
            "generated": generated,
            "active": valid & ~done,
            "tokens": jnp.where(valid, tok, s["tokens"]),
            "pos": jnp.where(valid, s["pos"] + 1, s["pos"]),
        }
        out = (tok, valid.astype(jnp.int32), logprob)
        if top:
            out += top_alternatives(logits[:, 0], s["temperature"], top)
        return s, out

    state, out = jax.lax.scan(step, state, length=steps)
    tok, valid, logprob = out[:3]
    b = state["tokens"].shape[0]
    columns = [
        tok.T,
        valid.T,
        state["generated"][:, None],
        jax.lax.bitcast_convert_type(logprob.T.astype(jnp.float32), jnp.int32),
        jnp.broadcast_to(version.astype(jnp.int32), (b, steps)),
    ]
    if top:  # [steps, B, top] -> [B, steps * top], step-major
        top_lp, top_ids = (x.transpose(1, 0, 2).reshape(b, steps * top) for x in out[3:])
        columns += [top_ids, jax.lax.bitcast_convert_type(top_lp, jnp.int32)]
    return state, jnp.concatenate(columns, axis=1)


def result_tokens(data: Any, steps: int, top: int = 0) -> ResultTokens:
    """The ``ResultTokens`` naming ``decode_steps``' columns."""
    k = steps
    tops = {}
    if top:
        start = 4 * k + 1
        tops = {
            "top_idx": (start, start + k * top),
            "top_logprob_idx": (start + k * top, start + 2 * k * top),
        }
    return ResultTokens(
        data,
        tokens_idx=(0, k),
        valid_idx=(k, 2 * k),
        length_idx=(2 * k, 2 * k + 1),
        samples_per_slot=1,
        logprob_idx=(2 * k + 1, 3 * k + 1),
        version_idx=(3 * k + 1, 4 * k + 1),
        **tops,
    )
