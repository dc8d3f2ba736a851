"""Every loss and diagnostic in algorithms/losses.py against a plain NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.loss_chunks import assert_rows_add_up

from jaxrl_orch.algorithms import losses

R, L, V = 3, 10, 7
TOL = dict(rtol=1e-5, atol=1e-6)


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(R, L, V)).astype(np.float32) * 2
    targets = rng.integers(0, V, size=(R, L)).astype(np.int32)
    temps = rng.choice([0.7, 1.0, 1.3], size=(R, L)).astype(np.float32)
    # Packed rows: segments 1..3 then padding (segment 0).
    seg = np.array(
        [[1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 3], [1] * 10], np.int32
    )
    mask = (rng.random((R, L)) < 0.7) & (seg > 0)
    adv = np.zeros((R, L), np.float32)
    for r in range(R):
        for s in np.unique(seg[r]):
            adv[r, seg[r] == s] = rng.normal()
    behavior = np.log(rng.uniform(0.05, 0.9, size=(R, L))).astype(np.float32)
    old = behavior + rng.normal(scale=0.4, size=(R, L)).astype(np.float32)
    new = old + rng.normal(scale=0.7, size=(R, L)).astype(np.float32)
    ref = new + rng.normal(scale=0.3, size=(R, L)).astype(np.float32)
    return dict(
        logits=logits,
        targets=targets,
        temps=temps,
        seg=seg,
        mask=mask,
        adv=adv,
        behavior=behavior,
        old=old,
        new=new,
        ref=ref,
    )


def _np_weights(mask, seg, norm, constant=None):
    m = mask.astype(np.float64)
    if norm == "token":
        return m / max(m.sum(), 1)
    w = np.zeros_like(m)
    seqs = [(r, s) for r in range(m.shape[0]) for s in np.unique(seg[r]) if m[r, seg[r] == s].sum()]
    for r, s in seqs:
        sel = seg[r] == s
        # Dr. GRPO: each sequence's token losses summed, divided by a constant, mean over seqs.
        per_seq = constant if norm == "constant" else m[r, sel].sum()
        w[r, sel] = m[r, sel] / per_seq / len(seqs)
    return w


def test_token_logprobs_and_entropy_match_numpy():
    b = _batch()
    ref_lsm = _np_log_softmax(b["logits"].astype(np.float64) / b["temps"][..., None])
    ref_lp = np.take_along_axis(ref_lsm, b["targets"][..., None], -1)[..., 0]
    ref_ent = -(np.exp(ref_lsm) * ref_lsm).sum(-1)
    lp = losses.token_logprobs(b["logits"], b["targets"], b["temps"])
    ent = losses.token_entropy(b["logits"], b["temps"])
    np.testing.assert_allclose(lp, ref_lp, **TOL)
    np.testing.assert_allclose(ent, ref_ent, **TOL)
    lp2, ent2 = losses.logprobs_and_entropy(b["logits"], b["targets"], b["temps"])
    np.testing.assert_allclose(lp2, ref_lp, **TOL)
    np.testing.assert_allclose(ent2, ref_ent, **TOL)


def test_greedy_temperature_scores_at_one_without_nan():
    b = _batch()
    zero_t = np.zeros((R, L), np.float32)
    lp = losses.token_logprobs(b["logits"], b["targets"], zero_t)
    ref = np.take_along_axis(
        _np_log_softmax(b["logits"].astype(np.float64)), b["targets"][..., None], -1
    )
    np.testing.assert_allclose(lp, ref[..., 0], **TOL)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_loss_weights_match_numpy(norm):
    b = _batch()
    w = losses.loss_weights(b["mask"], b["seg"], norm)
    np.testing.assert_allclose(w, _np_weights(b["mask"], b["seg"], norm), **TOL)
    assert float(jnp.sum(w)) == pytest.approx(1.0, rel=1e-5)


def test_constant_norm_is_dr_grpo_sum_over_a_constant():
    b = _batch()
    w = losses.loss_weights(b["mask"], b["seg"], "constant", 16.0)
    np.testing.assert_allclose(w, _np_weights(b["mask"], b["seg"], "constant", 16.0), **TOL)
    # Unlike the token norm, a sequence's weight per token does not depend on the batch's
    # token count: every masked token weighs 1 / (constant * num_sequences).
    m, seg = b["mask"], b["seg"]
    n_seqs = sum(m[r, seg[r] == s].any() for r in range(R) for s in np.unique(seg[r]))
    assert len(np.unique(np.asarray(w)[b["mask"]])) == 1
    np.testing.assert_allclose(np.asarray(w)[b["mask"]], 1 / (16.0 * n_seqs), rtol=1e-6)
    with pytest.raises(ValueError, match="norm 'constant' needs norm_constant"):
        losses.loss_weights(b["mask"], b["seg"], "constant", None)
    assert losses.PolicyLossConfig(norm="constant").for_budget(12).norm_constant == 12.0
    with pytest.raises(ValueError, match="Loss.norm_constant .* with norm 'token' leave it None"):
        losses.PolicyLossConfig(norm="token", norm_constant=8.0)


def test_dr_grpo_loss_differs_from_grpo_as_the_paper_defines():
    """Same advantages, two normalisations: GRPO (token mean over the batch) and Dr. GRPO
    (per-sequence token sums over a constant), each against its NumPy reduction."""
    b = _batch(seed=4)
    per_token = -b["adv"].astype(np.float64)  # ratio 1: the surrogate is -A per token
    grpo_cfg = losses.PolicyLossConfig(norm="token", tis_cap=None)
    dr_cfg = losses.PolicyLossConfig(norm="constant", norm_constant=12.0, tis_cap=None)
    out = {}
    for name, cfg in (("grpo", grpo_cfg), ("dr", dr_cfg)):
        w = losses.loss_weights(b["mask"], b["seg"], cfg.norm, cfg.norm_constant)
        out[name], _ = losses.policy_loss(
            jnp.asarray(b["behavior"]), b["behavior"], b["adv"], b["mask"], w, cfg
        )
    m = b["mask"]
    want_grpo = (per_token * m).sum() / m.sum()
    seqs = [
        (r, s) for r in range(R) for s in np.unique(b["seg"][r]) if m[r, b["seg"][r] == s].any()
    ]
    want_dr = sum((per_token[r] * m[r] * (b["seg"][r] == s)).sum() / 12.0 for r, s in seqs)
    want_dr /= len(seqs)
    np.testing.assert_allclose(float(out["grpo"]), want_grpo, rtol=1e-5)
    np.testing.assert_allclose(float(out["dr"]), want_dr, rtol=1e-5)
    assert abs(want_grpo - want_dr) > 1e-3


def test_bad_norm_names_allowed_values():
    with pytest.raises(ValueError, match="'token', 'sequence', 'constant'.*'bogus'"):
        losses.loss_weights(np.ones((2, 3)), None, "bogus")
    with pytest.raises(ValueError, match="norm must be one of"):
        losses.PolicyLossConfig(norm="seq")
    with pytest.raises(ValueError, match="tis_cap"):
        losses.PolicyLossConfig(tis_cap=0.0)


def _np_policy_loss(b, cfg, *, use_old, use_ref, entropy=None):
    m = b["mask"].astype(np.float64)
    mb = b["mask"]
    new, beh, adv = (b[k].astype(np.float64) for k in ("new", "behavior", "adv"))
    denom = b["old"].astype(np.float64) if use_old else beh
    ratio = np.where(mb, np.exp(new - denom), 1.0)
    clipped = np.clip(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    per_tok = -np.minimum(ratio * adv, clipped * adv)
    tis_capped = np.zeros_like(m)
    if use_old and cfg.tis_cap is not None:
        w_raw = np.where(mb, np.exp(b["old"] - beh), 1.0)
        per_tok = per_tok * np.minimum(w_raw, cfg.tis_cap)
        tis_capped = (w_raw > cfg.tis_cap) * 1.0
    out = {}
    if use_ref and cfg.kl_beta > 0:
        x = np.where(mb, b["ref"] - new, 0.0)
        kl = np.exp(x) - x - 1
        per_tok = per_tok + cfg.kl_beta * kl
        out["ref_kl"] = (kl * m).sum() / m.sum()
    if entropy is not None:
        per_tok = per_tok - cfg.entropy_coef * entropy
        out["entropy"] = (entropy * m).sum() / m.sum()
    w = _np_weights(b["mask"], b["seg"], cfg.norm)
    n = m.sum()
    lr = np.log(ratio)
    trainer = b["old"] if use_old else new
    eng = np.where(mb, trainer - beh, 0.0)
    out.update(
        loss=(per_tok * w).sum(),
        num_tokens=n,
        clip_low=(((ratio < 1 - cfg.eps_low) & (adv < 0)) * m).sum() / n,
        clip_high=(((ratio > 1 + cfg.eps_high) & (adv > 0)) * m).sum() / n,
        approx_kl=((np.exp(lr) - lr - 1) * m).sum() / n,
        mismatch_kl=((np.exp(eng) - eng - 1) * m).sum() / n,
        ratio_mean=(ratio * m).sum() / n,
        ratio_max=ratio[mb].max(),
        tis_capped=(tis_capped * m).sum() / n,
    )
    return out


CASES = [
    # (cfg, use_old, use_ref, with_entropy)
    (
        losses.PolicyLossConfig(eps_low=0.2, eps_high=0.28, norm="token", tis_cap=None),
        False,
        False,
        False,
    ),
    (
        losses.PolicyLossConfig(eps_low=0.1, eps_high=0.4, norm="sequence", tis_cap=None),
        False,
        False,
        False,
    ),
    (losses.PolicyLossConfig(norm="token", tis_cap=1.2), True, False, False),
    (losses.PolicyLossConfig(norm="sequence", tis_cap=1.5, kl_beta=0.05), True, True, False),
    (
        losses.PolicyLossConfig(norm="token", tis_cap=None, kl_beta=0.1, entropy_coef=0.01),
        False,
        True,
        True,
    ),
]


@pytest.mark.parametrize("cfg,use_old,use_ref,with_entropy", CASES)
def test_policy_loss_and_diagnostics_match_numpy(cfg, use_old, use_ref, with_entropy):
    b = _batch(seed=3)
    ent = np.random.default_rng(9).uniform(0, 2, size=(R, L)) if with_entropy else None
    w = losses.loss_weights(b["mask"], b["seg"], cfg.norm)
    loss, sums = losses.policy_loss(
        jnp.asarray(b["new"]),
        b["behavior"],
        b["adv"],
        b["mask"],
        w,
        cfg,
        old_logp=jnp.asarray(b["old"]) if use_old else None,
        ref_logp=jnp.asarray(b["ref"]) if use_ref else None,
        entropy=None if ent is None else jnp.asarray(ent, jnp.float32),
    )
    got = losses.finalize_metrics(sums)
    want = _np_policy_loss(b, cfg, use_old=use_old, use_ref=use_ref, entropy=ent)
    assert set(got) == set(want), (sorted(got), sorted(want))
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5, atol=1e-6)
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
    # The inputs are far enough off-policy that the clip binds on both sides.
    assert want["clip_low"] > 0 and want["clip_high"] > 0


def test_chunked_sums_equal_whole_batch():
    """Gradient accumulation relies on this: per-row-chunk sums add up to the batch loss."""
    b = _batch(seed=5)
    cfg = losses.PolicyLossConfig(norm="sequence", tis_cap=1.3)
    w = losses.loss_weights(b["mask"], b["seg"], cfg.norm)

    def run(sl):
        return losses.policy_loss(
            jnp.asarray(b["new"][sl]),
            b["behavior"][sl],
            b["adv"][sl],
            b["mask"][sl],
            w[sl],
            cfg,
            old_logp=jnp.asarray(b["old"][sl]),
        )

    assert_rows_add_up(run, R)


def test_gradient_matches_numpy_surrogate_derivative():
    """d loss / d new_logp = -A * ratio * w where the clip does not bind, else 0."""
    b = _batch(seed=7)
    cfg = losses.PolicyLossConfig(norm="token", tis_cap=None)
    w = losses.loss_weights(b["mask"], b["seg"], "token")
    g = jax.grad(lambda x: losses.policy_loss(x, b["behavior"], b["adv"], b["mask"], w, cfg)[0])(
        jnp.asarray(b["new"])
    )
    ratio = np.exp(b["new"].astype(np.float64) - b["behavior"])
    adv = b["adv"].astype(np.float64)
    binds = ((ratio > 1 + cfg.eps_high) & (adv > 0)) | ((ratio < 1 - cfg.eps_low) & (adv < 0))
    want = np.where(binds | ~b["mask"], 0.0, -adv * ratio * np.asarray(w))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_masked_tokens_contribute_nothing():
    b = _batch(seed=11)
    cfg = losses.PolicyLossConfig(norm="token", tis_cap=2.0, kl_beta=0.1)
    w = losses.loss_weights(b["mask"], b["seg"], "token")
    junk = np.where(b["mask"], b["new"], 80.0).astype(np.float32)  # huge ratio off-mask
    loss_a, sums_a = losses.policy_loss(
        jnp.asarray(b["new"]),
        b["behavior"],
        b["adv"],
        b["mask"],
        w,
        cfg,
        old_logp=jnp.asarray(b["old"]),
        ref_logp=jnp.asarray(b["ref"]),
    )
    loss_b, sums_b = losses.policy_loss(
        jnp.asarray(junk),
        b["behavior"],
        b["adv"],
        b["mask"],
        w,
        cfg,
        old_logp=jnp.asarray(b["old"]),
        ref_logp=jnp.asarray(b["ref"]),
    )
    assert float(loss_a) == float(loss_b)
    for k in sums_a:
        assert float(sums_a[k]) == float(sums_b[k]), k


def test_sft_loss_matches_numpy():
    b = _batch(seed=2)
    ref_lsm = _np_log_softmax(b["logits"].astype(np.float64))
    nll = -np.take_along_axis(ref_lsm, b["targets"][..., None], -1)[..., 0]
    m = b["mask"].astype(np.float64)
    loss, sums = losses.sft_loss(b["logits"], b["targets"], b["mask"])
    np.testing.assert_allclose(float(loss), (nll * m).sum() / m.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(sums["nll"]), (nll * m).sum(), rtol=1e-5)
    w = losses.loss_weights(b["mask"], b["seg"], "sequence")
    loss_s, _ = losses.sft_loss(b["logits"], b["targets"], b["mask"], w)
    np.testing.assert_allclose(
        float(loss_s), (nll * _np_weights(b["mask"], b["seg"], "sequence")).sum(), rtol=1e-5
    )


def test_unreported_behaviour_logprobs_take_the_recomputed_old_ones():
    """An engine without log-probs leaves NaN behaviour log-probs: with recomputed old ones
    the loss equals the one computed with behaviour == old (TIS weight 1, mismatch 0)."""
    b = _batch(seed=4)
    cfg = losses.PolicyLossConfig(norm="token", tis_cap=2.0)
    w = losses.loss_weights(b["mask"], b["seg"], cfg.norm)
    args = (jnp.asarray(b["new"]),)
    missing = np.where(b["mask"], np.nan, b["behavior"]).astype(np.float32)
    loss, sums = losses.policy_loss(
        *args, missing, b["adv"], b["mask"], w, cfg, old_logp=jnp.asarray(b["old"])
    )
    want_loss, want = losses.policy_loss(
        *args, b["old"], b["adv"], b["mask"], w, cfg, old_logp=jnp.asarray(b["old"])
    )
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert float(sums["mismatch_kl"]) == 0.0 and float(sums["tis_capped"]) == 0.0
    # Without recomputed old log-probs nothing stands in: the NaN shows (the sink filters it).
    bad, _ = losses.policy_loss(*args, missing, b["adv"], b["mask"], w, cfg)
    assert np.isnan(float(bad))
