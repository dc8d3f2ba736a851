"""Per-slot token sampling on device, with the behavior log-probability of the sampled token.

Owns: turning one decode step's logits ``[B, V]`` plus per-slot sampling parameters (arrays,
so a new request never recompiles anything) into ``(token_ids[B], logprobs[B])``.

Semantics (one rule per fact, docs/design.md section 3):
- ``temperature[b] == 0`` is greedy: the token is ``argmax(logits[b])``.
- Otherwise the token is drawn from ``softmax(logits / T)`` restricted to the top-k tokens
  (``top_k == 0`` disables) and then to the smallest head of the sorted distribution whose
  mass reaches ``top_p`` (``top_p == 1`` disables). Ties at a cut-off keep every tied token.
- The returned log-prob is ``log_softmax(logits / T)`` over the *full* vocabulary at the
  sampled id, i.e. the quantity the trainer recomputes from its own forward at the same
  temperature. Top-k/top-p truncation is deliberately not renormalised into it: the trainer
  cannot see the truncation, so a renormalised value would not be comparable. For greedy
  slots the log-prob is taken at ``T = 1`` (``log_softmax(logits)``).

Randomness (which key draws row b's Gumbel noise): a seeded request (``SamplingParams.seed``)
draws its completion's token i from ``token_key(request_key(seed, prompt_len), i)`` =
``fold_in(fold_in(PRNGKey(seed), prompt_len), i)``: nothing of the engine, the slot, the batch
or the decode width enters, so replicas agree token for token. An unseeded row draws from the
b-th key of ``split(step_key, B)`` (the engine's stream, unchanged). ``row_keys`` picks per row.

Cost: the truncation mask needs a full sort of every row, which on XLA:CPU costs more than the
rest of sampling together (2.0 of 2.7 ms for 32 x 262 logits, measured). RL rollouts usually
sample untruncated (the trainer's log-probs must match), so the mask runs under a ``lax.cond``
only when some row of the batch asks for top-k or top-p; untruncated batches skip the sort.
Both branches give identical tokens for untruncated rows (the mask keeps every token there).

Alternatives (``top_alternatives``): the k most likely tokens of the same tempered distribution
the sampled token's log-prob is read from (greedy rows: ``T = 1``), by the same
``log_softmax``, so the sampled token's value among them is the one reported for it. The engine
computes them only in its top-k decode variant, never in the default decode program.

Everything here is a pure jnp function meant to run inside the engine's jitted decode step;
it never touches the host and never branches in Python on array values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _truncation_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Boolean ``[B, V]``: tokens that survive top-k then top-p on tempered logits."""
    vocab = scaled.shape[-1]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)  # [B, 1]
    keep_sorted = ordered >= kth
    # Top-p over the top-k survivors, in sorted order: keep a token while the mass strictly
    # before it is still below top_p, so the head always holds at least one token.
    probs = jax.nn.softmax(jnp.where(keep_sorted, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = keep_sorted & (mass_before < top_p[:, None])
    # The smallest surviving sorted value is the cut-off in unsorted space.
    cutoff = jnp.min(jnp.where(keep_sorted, ordered, jnp.inf), axis=-1, keepdims=True)
    return scaled >= cutoff


def request_key(seed: jax.Array, prompt_len: jax.Array) -> jax.Array:
    """A seeded request's key: ``fold_in(PRNGKey(seed), prompt_len)`` (raw key data)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), prompt_len)


def token_key(key: jax.Array, index: jax.Array) -> jax.Array:
    """The key of completion token ``index`` (0 = the first sampled token) of a request."""
    return jax.random.fold_in(key, index)


def row_keys(
    step_key: jax.Array, request_keys: jax.Array, seeded: jax.Array, index: jax.Array
) -> jax.Array:
    """One key per row: ``token_key(request_keys[b], index[b])`` where ``seeded[b]``, else the
    b-th key of ``split(step_key, B)`` (raw keys; ``request_keys`` is ``[B, key words]``)."""
    own = jax.vmap(token_key)(request_keys, index)
    return jnp.where(seeded[:, None], own, jax.random.split(step_key, seeded.shape[0]))


def sample_tokens(
    logits: jax.Array,
    key: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    keys: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. Returns ``(tokens int32[B], logprobs float32[B])``.

    ``logits`` is ``[B, V]``; ``temperature``/``top_p`` are float ``[B]``, ``top_k`` int ``[B]``;
    ``key`` is one PRNG key (split per row inside), or ``keys`` gives each row its own
    (``row_keys``; ``key`` is then unused).
    """
    logits = logits.astype(jnp.float32)
    batch = logits.shape[0]
    greedy = temperature <= 0.0
    temp = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits / temp[:, None]
    top_p = top_p.astype(jnp.float32)
    vocab = logits.shape[-1]
    truncating = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    keep = jax.lax.cond(
        truncating,
        lambda: _truncation_mask(scaled, top_k, top_p),
        lambda: jnp.ones(scaled.shape, bool),
    )
    keys = jax.random.split(key, batch) if keys is None else keys
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],)))(keys)
    # One argmax for both kinds of row: a greedy row adds no noise to its logits (its ``scaled``
    # is the logits, T = 1), and truncation always keeps the top token, so it gets the argmax.
    noise = jnp.where(greedy[:, None], 0.0, gumbel)
    tokens = jnp.argmax(jnp.where(keep, scaled + noise, -jnp.inf), axis=-1).astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
    return tokens, logprobs[:, 0]


def top_alternatives(
    logits: jax.Array, temperature: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    """``(logprobs float32[B, k], ids int32[B, k])``, most likely first, of
    ``log_softmax(logits / T)`` per row (``T = 1`` where ``temperature`` is 0)."""
    temp = jnp.where(temperature <= 0.0, 1.0, temperature).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temp[:, None], axis=-1)
    values, ids = jax.lax.top_k(logp, k)
    return values, ids.astype(jnp.int32)
