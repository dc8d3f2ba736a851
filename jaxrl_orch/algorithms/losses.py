"""Policy-gradient and SFT losses as pure functions of jnp arrays (usable inside ``jax.jit``).

Owns the per-token maths of the trainer: log-probs at the sampling temperature, the clipped
surrogate with asymmetric clip, truncated importance sampling (TIS) for trainer/engine
mismatch, an optional k3 KL to a reference policy, entropy, masked cross-entropy, and the
diagnostics that say whether staleness is under control. The trainer step (``trainer/step.py``)
drives it; it never touches params, optimizers or devices.

Alignment: every argument is already aligned per *target* token (the caller shifts logits left
by one so ``logits[..., t, :]`` scores ``targets[..., t]``). All shapes are ``[..., T]``.

Reductions are written as weighted sums so a batch can be split into row-chunks for gradient
accumulation and still be normalised over the whole batch:

- ``loss_weights(loss_mask, segment_ids, norm)`` computes per-token weights once, over the
  whole (mini)batch: ``"token"`` gives every masked token weight ``1 / num_masked_tokens``
  (Dr.GRPO / DAPO token-level normalisation); ``"sequence"`` gives ``1 / (n_tokens_of_its
  sequence * num_sequences)`` (per-sequence mean, then mean over sequences), where a sequence is
  one ``(row, segment_id)`` pair of a packed batch; ``"constant"`` (Dr. GRPO) gives ``1 /
  (norm_constant * num_sequences)``: token losses summed per sequence and divided by a constant
  (the generation budget), then averaged over sequences, so no sequence's tokens are weighted
  by its own length and the weight does not depend on how long the batch's answers are.
- ``policy_loss`` returns ``sum(per_token_loss * weights)`` for the chunk it sees plus a dict
  of *metric sums*; chunks combine with ``merge_metric_sums`` and ``finalize_metrics`` turns
  sums into means over masked tokens.

Ratio and TIS (decoupled form): the surrogate's ratio is ``pi_new / pi_old`` where ``pi_old``
is the recomputed old log-prob when given, else the engine's behavior log-prob. When ``old``
is given and ``tis_cap`` is set, each token's loss is weighted by
``min(pi_old / pi_behavior, tis_cap)`` (a constant: no gradient flows through it). That is
AReaL's decoupled PPO objective with ``pi_old`` as its proximal policy, truncated at the cap;
``tis_cap=float("inf")`` gives it uncapped, and AReaL's own cap (tokens whose weight exceeds it
are dropped, not truncated) is ``mis="token", mis_bounds=(0.0, cap)`` on top (docs/losses.md).

Policy term (``policy_loss``): ``"ppo"`` is the clipped token surrogate above; ``"gspo"``,
``"gspo_token"`` and ``"cispo"``, and the masks on the trainer/engine ratio (``icepop``,
``mis``, ``geo_mask``), are ``algorithms/corrections.py``. A token a mask drops is off the loss
mask for the policy term (its term, TIS-weighted or not, is 0; GSPO's sequence ratio averages
over the kept tokens) but keeps its loss weight, so it still counts in the normaliser; the KL
and entropy terms, which do not depend on the behaviour policy, and every diagnostic but the
corrections' own counts still cover all loss tokens.

Invariants: padding and prompt tokens (``loss_mask == False``) contribute exactly zero to the
loss and to every diagnostic; nothing here reads the host or allocates device state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_orch.algorithms import corrections
from jaxrl_orch.algorithms.loss_config import NORMS, PolicyLossConfig

# Metric-sum keys combined by ``max`` across chunks; all others are added.
_MAX_KEYS = ("ratio_max",)


def _safe_temperature(temperatures: jax.Array) -> jax.Array:
    # Greedy samples (T == 0) have no finite tempered log-prob; score them at T = 1 instead of
    # dividing by zero. They should not be trained on, but must not poison the batch with NaN.
    t = jnp.asarray(temperatures, jnp.float32)
    return jnp.where(t > 0.0, t, 1.0)


def tempered_log_softmax(logits: jax.Array, temperatures: jax.Array) -> jax.Array:
    """``log_softmax(logits / T)`` in float32; ``T`` is per token, shape [..., T]."""
    scaled = logits.astype(jnp.float32) / _safe_temperature(temperatures)[..., None]
    return jax.nn.log_softmax(scaled, axis=-1)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperatures: jax.Array) -> jax.Array:
    """Log-prob of each target under ``softmax(logits / T)``: [..., T, V] -> [..., T]."""
    logp = tempered_log_softmax(logits, temperatures)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy(logits: jax.Array, temperatures: jax.Array) -> jax.Array:
    """Entropy (nats) of ``softmax(logits / T)`` per token; logits [..., T, V] -> [..., T]."""
    logp = tempered_log_softmax(logits, temperatures)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def logprobs_and_entropy(
    logits: jax.Array, targets: jax.Array, temperatures: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Both of the above from one log-softmax (the step's hot path)."""
    logp = tempered_log_softmax(logits, temperatures)
    lp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lp, ent


def loss_weights(
    loss_mask: jax.Array,
    segment_ids: jax.Array | None,
    norm: str,
    norm_constant: float | None = None,
) -> jax.Array:
    """Per-token weights such that ``sum(per_token_loss * w)`` is the normalised loss.

    ``loss_mask`` and ``segment_ids`` are [R, L] (rows of a packed batch). Sequence
    normalisation needs ``segment_ids`` (0 = padding); without them each row is one sequence.
    A batch with no masked token gets all-zero weights (loss 0, no NaN).
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    mask = jnp.asarray(loss_mask).astype(jnp.float32)
    if norm == "token":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if mask.ndim != 2:
        raise ValueError(f"{norm} norm needs [rows, length] arrays, got shape {mask.shape}")
    counts, ids = corrections.sequence_totals(mask, segment_ids)
    num_seqs = jnp.maximum(jnp.sum(counts > 0), 1).astype(jnp.float32)
    if norm == "constant":
        if norm_constant is None:
            raise ValueError("norm 'constant' needs norm_constant")
        return mask / (float(norm_constant) * num_seqs)
    per_token_count = counts[ids].reshape(mask.shape)
    return mask / jnp.maximum(per_token_count, 1.0) / num_seqs


def k3(log_ratio: jax.Array) -> jax.Array:
    """k3 estimator ``exp(x) - x - 1`` of a KL, with ``x = log(p_other / p_sampled)``; >= 0."""
    return jnp.expm1(log_ratio) - log_ratio


def _policy_term(
    new_logp, log_ratio, adv, maskb, cfg: PolicyLossConfig, segment_ids
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The per-token policy term of ``cfg.policy_loss`` (before TIS and masks) and its sums."""
    if cfg.policy_loss != "ppo":
        return corrections.surrogate(cfg, new_logp, log_ratio, adv, maskb, segment_ids)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    return -jnp.minimum(ratio * adv, clipped * adv), {}


def policy_loss(
    new_logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    weights: jax.Array,
    cfg: PolicyLossConfig,
    *,
    old_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy loss (to minimise) and metric sums for one chunk of tokens.

    Returns ``(sum(per_token_loss * weights), metric_sums)``. ``metric_sums`` keys:
    ``num_tokens`` (masked tokens), ``clip_low``/``clip_high`` (tokens where the token clip
    binds: ratio below ``1 - eps_low`` with negative advantage, above ``1 + eps_high`` with
    positive advantage; reported for every ``policy_loss``), ``approx_kl`` (k3 of old -> new),
    ``mismatch_kl`` (k3 of engine -> trainer, trainer = old if given else new), ``ratio``
    (sum), ``ratio_max``, ``tis_capped`` (tokens whose TIS weight hit the cap), ``entropy`` and
    ``ref_kl`` when given, ``loss`` (the weighted loss itself, so chunk sums add up to the batch
    loss), and the counts of ``corrections`` for the settings that are on. With ``old_logp``, a
    NaN behaviour log-prob (one the engine did not report) is replaced by ``old_logp``.
    ``segment_ids`` ``[R, L]`` (0 = padding) delimit the sequences of GSPO and the sequence
    masks; without them each row is one sequence.
    """
    mask = jnp.asarray(loss_mask).astype(jnp.float32)
    maskb = mask > 0
    new_logp = new_logp.astype(jnp.float32)
    behavior_logp = jnp.asarray(behavior_logp, jnp.float32)
    if old_logp is not None:
        # NaN marks a log-prob the engine did not report (upstream JetStream reports none):
        # the recomputed old one stands in, so its TIS weight is 1 and its mismatch 0.
        behavior_logp = jnp.where(
            jnp.isnan(behavior_logp), jax.lax.stop_gradient(old_logp), behavior_logp
        )
    adv = jnp.asarray(advantages, jnp.float32)
    denom_logp = behavior_logp if old_logp is None else jax.lax.stop_gradient(old_logp)
    # Masked tokens get log-ratio 0 so exp() cannot overflow into NaN gradients.
    log_ratio = jnp.where(maskb, new_logp - denom_logp, 0.0)
    trainer_logp = jax.lax.stop_gradient(new_logp if old_logp is None else old_logp)
    engine_log_ratio = jnp.where(maskb, trainer_logp - behavior_logp, 0.0)
    # Masked-out tokens leave the policy term as if off the loss mask (GSPO's sequence ratio
    # is over the kept tokens), but keep their loss weight.
    keep = maskb
    sums = {}
    if corrections.masks_on(cfg):
        keep, sums = corrections.ratio_masks(cfg, engine_log_ratio, maskb, segment_ids)
    per_token, term_sums = _policy_term(new_logp, log_ratio, adv, keep, cfg, segment_ids)
    sums.update(term_sums)

    tis_capped = jnp.zeros_like(mask)
    if old_logp is not None and cfg.tis_cap is not None:
        mismatch = jnp.where(maskb, jax.lax.stop_gradient(old_logp) - behavior_logp, 0.0)
        tis_raw = jnp.exp(mismatch)
        per_token = per_token * jnp.minimum(tis_raw, cfg.tis_cap)
        tis_capped = (tis_raw > cfg.tis_cap).astype(jnp.float32)
    if corrections.masks_on(cfg):
        per_token = jnp.where(keep, per_token, 0.0)

    if ref_logp is not None and cfg.kl_beta > 0.0:
        ref_kl = k3(jnp.where(maskb, jnp.asarray(ref_logp, jnp.float32) - new_logp, 0.0))
        per_token = per_token + cfg.kl_beta * ref_kl
        sums["ref_kl"] = jnp.sum(jax.lax.stop_gradient(ref_kl) * mask)
    if entropy is not None:
        if cfg.entropy_coef > 0.0:
            per_token = per_token - cfg.entropy_coef * entropy
        sums["entropy"] = jnp.sum(jax.lax.stop_gradient(entropy) * mask)

    loss = jnp.sum(per_token * weights)
    sums.update(_diagnostics(log_ratio, engine_log_ratio, adv, mask, cfg))
    sums.update(loss=jax.lax.stop_gradient(loss), tis_capped=jnp.sum(tis_capped * mask))
    return loss, sums


def _diagnostics(log_ratio, engine_log_ratio, adv, mask, cfg: PolicyLossConfig):
    """The token-ratio metric sums every ``policy_loss`` reports."""
    maskb = mask > 0
    sg_log_ratio = jax.lax.stop_gradient(log_ratio)
    sg_ratio = jnp.exp(sg_log_ratio)
    return dict(
        num_tokens=mask.sum(),
        clip_low=jnp.sum(((sg_ratio < 1.0 - cfg.eps_low) & (adv < 0) & maskb) * 1.0),
        clip_high=jnp.sum(((sg_ratio > 1.0 + cfg.eps_high) & (adv > 0) & maskb) * 1.0),
        # k3 with samples from pi_old: x = log(pi_new / pi_old).
        approx_kl=jnp.sum(k3(sg_log_ratio) * mask),
        mismatch_kl=jnp.sum(k3(engine_log_ratio) * mask),
        ratio=jnp.sum(sg_ratio * mask),
        ratio_max=jnp.max(jnp.where(maskb, sg_ratio, -jnp.inf), initial=-jnp.inf),
    )


def merge_metric_sums(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Combine two chunks' metric sums (``ratio_max`` by max, the rest by addition)."""
    if a.keys() != b.keys():
        raise ValueError(f"metric sums have different keys: {sorted(a)} vs {sorted(b)}")
    return {k: (jnp.maximum(a[k], b[k]) if k in _MAX_KEYS else a[k] + b[k]) for k in a}


def finalize_metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Turn metric sums into per-masked-token means (``loss`` and ``num_tokens`` stay totals)."""
    n = jnp.maximum(sums["num_tokens"], 1.0)
    out = {}
    for k, v in sums.items():
        if k in ("loss", "num_tokens") or k in _MAX_KEYS:
            out[k] = v
        elif k == "ratio":
            out["ratio_mean"] = v / n
        else:
            out[k] = v / n
    return out


def sft_loss(
    logits: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array,
    weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked cross-entropy at T = 1: ``sum(-log p(target) * weights)`` and metric sums.

    Without ``weights`` the loss is the mean over masked tokens of this chunk.
    """
    mask = jnp.asarray(loss_mask).astype(jnp.float32)
    if weights is None:
        weights = mask / jnp.maximum(mask.sum(), 1.0)
    nll = -token_logprobs(logits, targets, jnp.ones(targets.shape, jnp.float32))
    loss = jnp.sum(nll * weights)
    return loss, {
        "loss": jax.lax.stop_gradient(loss),
        "num_tokens": mask.sum(),
        "nll": jnp.sum(jax.lax.stop_gradient(nll) * mask),
    }
