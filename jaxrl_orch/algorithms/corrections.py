"""Off-policy corrections beside the clipped token surrogate: sequence-level ratios (GSPO), clipped
stop-gradient importance weights (CISPO), and masks on the trainer/engine probability ratio
(IcePop, MIS / rejection sampling, geometric sequence masking). docs/losses.md says what each
computes, which paper it comes from and when to use it.

What it owns: the per-token maths ``losses.policy_loss`` switches to when
``PolicyLossConfig.policy_loss`` is not ``"ppo"`` or a mask is set, and the per-sequence
reductions they need (their settings: ``loss_config``). Every function is a pure
function of ``jnp`` arrays ``[R, L]`` (rows of a packed batch, or one row-chunk of them),
usable under ``jax.jit``.

Sequences are ``(row, segment_id)`` pairs, as in ``losses.loss_weights`` (0 = padding; without
``segment_ids`` each row is one sequence). A sequence never spans two rows, so a row-chunk holds
whole sequences and every per-sequence number computed on a chunk equals the one computed on the
whole batch: gradient accumulation over row-chunks stays exact.

Notation: ``log_ratio = log pi_new - log pi_old`` (pi_old: the recomputed proximal policy when
given, else the engine's behaviour policy), zero off the loss mask; ``log_rho = log pi_trainer -
log pi_behaviour`` (trainer: the recomputed old log-prob when given, else the new one under a
stop-gradient), zero off the loss mask.

Each function returns per-token values plus *metric sums* (counts of loss tokens) that
``losses.finalize_metrics`` turns into shares of the step's loss tokens: ``icepop_masked``,
``mis_masked``, ``geo_masked`` (tokens each mask dropped; a token two masks drop counts in
both), and, among the tokens the masks keep, ``seq_clipped`` (GSPO: tokens whose sequence clip
binds) and ``cispo_clipped`` (tokens whose CISPO weight was clipped).

Invariants: tokens off the loss mask count in no metric sum; masks and importance weights are
constants (no gradient flows through them); nothing here reads the host.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl_orch.algorithms.loss_config import POLICY_LOSSES

sg = jax.lax.stop_gradient


def masks_on(cfg) -> bool:
    """Whether any mask on the trainer/engine ratio is set."""
    return cfg.icepop is not None or cfg.mis is not None or cfg.geo_mask is not None


def sequence_totals(x: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``x`` ``[R, L]`` summed per sequence: ``(totals, ids)``, where ``totals[ids]`` is each
    token's sequence total (flattened). One id per (row, segment) pair: segment ids within a
    row are < L + 1."""
    if x.ndim != 2:
        raise ValueError(f"sequence-level terms need [rows, length] arrays, got shape {x.shape}")
    rows, length = x.shape
    seg = jnp.zeros(x.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    ids = jnp.arange(rows, dtype=jnp.int32)[:, None] * (length + 1) + seg.astype(jnp.int32)
    ids = ids.reshape(-1)
    return jax.ops.segment_sum(x.reshape(-1), ids, num_segments=rows * (length + 1)), ids


def sequence_sum(x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Each token's sequence total of ``x`` ``[R, L]`` (zero ``x`` off the loss mask first)."""
    totals, ids = sequence_totals(x, segment_ids)
    return totals[ids].reshape(x.shape)


def sequence_mean(x: jax.Array, maskf: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Each token's mean of ``x`` over its sequence's loss tokens (0 for a sequence without)."""
    count = sequence_sum(maskf, segment_ids)
    return sequence_sum(x * maskf, segment_ids) / jnp.maximum(count, 1.0)


def gspo(
    log_ratio: jax.Array,
    adv: jax.Array,
    maskb: jax.Array,
    segment_ids: jax.Array | None,
    eps: tuple[float, float],
    token_level: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO's per-token loss ``-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)`` with the
    sequence ratio ``s = exp(mean over the sequence's loss tokens of log_ratio)``.

    ``token_level`` (GSPO-token): the ratio is ``sg(s) * pi_new_t / sg(pi_new_t)``: the same
    value, but each token's gradient flows through its own log-prob only (token advantages).
    """
    maskf = maskb.astype(jnp.float32)
    seq_log_ratio = sequence_mean(log_ratio, maskf, segment_ids)
    if token_level:
        # log_ratio - sg(log_ratio) is exactly 0 forward: the value is sg(s) bit for bit.
        seq_log_ratio = sg(seq_log_ratio) + (log_ratio - sg(log_ratio))
    s = jnp.exp(seq_log_ratio)
    clipped = jnp.clip(s, 1.0 - eps[0], 1.0 + eps[1])
    per_token = -jnp.minimum(s * adv, clipped * adv)
    s = sg(s)
    binds = ((s > 1.0 + eps[1]) & (adv > 0)) | ((s < 1.0 - eps[0]) & (adv < 0))
    return per_token, {"seq_clipped": jnp.sum((binds & maskb) * 1.0)}


def cispo(
    new_logp: jax.Array,
    log_ratio: jax.Array,
    adv: jax.Array,
    maskb: jax.Array,
    eps_is: tuple[float, float],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO's per-token loss ``-sg(clip(r, 1 - eps_low_is, 1 + eps_high_is)) * A * log pi_new``:
    a REINFORCE term weighted by a clipped importance weight, so no token loses its gradient."""
    ratio = sg(jnp.exp(log_ratio))
    weight = jnp.clip(ratio, 1.0 - eps_is[0], 1.0 + eps_is[1])
    # Off-mask log-probs may be anything (their weight is 0): keep them out of the product.
    per_token = -weight * adv * jnp.where(maskb, new_logp, 0.0)
    outside = (ratio < 1.0 - eps_is[0]) | (ratio > 1.0 + eps_is[1])
    return per_token, {"cispo_clipped": jnp.sum((outside & maskb) * 1.0)}


def surrogate(cfg, new_logp, log_ratio, adv, maskb, segment_ids):
    """The policy term of ``cfg.policy_loss`` other than ``"ppo"``: ``(per_token, sums)``."""
    if cfg.policy_loss in ("gspo", "gspo_token"):
        eps = (cfg.eps_low, cfg.eps_high)
        token_level = cfg.policy_loss == "gspo_token"
        return gspo(log_ratio, adv, maskb, segment_ids, eps, token_level)
    if cfg.policy_loss == "cispo":
        return cispo(new_logp, log_ratio, adv, maskb, (cfg.eps_low_is, cfg.eps_high_is))
    raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {cfg.policy_loss!r}")


def _outside(log_x: jax.Array, bounds: tuple[float, float]) -> jax.Array:
    """``exp(log_x)`` outside ``[low, high]``, compared in log space (a product of many ratios
    overflows float32 long before its log does)."""
    low, high = bounds
    log_low = math.log(low) if low > 0.0 else -math.inf
    return (log_x < log_low) | (log_x > math.log(high))


def ratio_masks(
    cfg, log_rho: jax.Array, maskb: jax.Array, segment_ids: jax.Array | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Which loss tokens the configured masks keep (bool ``[R, L]``) and each mask's count.

    IcePop and token MIS drop tokens whose ``rho`` leaves their bounds; sequence MIS drops every
    token of a sequence whose ``prod rho`` (sum of ``log_rho``) leaves them; the geometric mask
    every token of a sequence whose ``exp(mean log_rho)`` leaves them.
    """
    keep = maskb
    sums: dict[str, jax.Array] = {}

    def drop(name: str, outside: jax.Array) -> None:
        nonlocal keep
        sums[name] = jnp.sum((outside & maskb) * 1.0)
        keep = keep & ~outside

    if cfg.icepop is not None:
        drop("icepop_masked", _outside(log_rho, cfg.icepop))
    if cfg.mis == "token":
        drop("mis_masked", _outside(log_rho, cfg.mis_bounds))
    elif cfg.mis == "sequence":
        drop("mis_masked", _outside(sequence_sum(log_rho, segment_ids), cfg.mis_bounds))
    if cfg.geo_mask is not None:
        geo = sequence_mean(log_rho, maskb.astype(jnp.float32), segment_ids)
        drop("geo_masked", _outside(geo, cfg.geo_mask))
    return keep, sums
