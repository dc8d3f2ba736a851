"""GSPO, GSPO-token, CISPO, the decoupled (AReaL) objective and the IcePop / MIS / geometric masks
of algorithms/corrections.py, through ``losses.policy_loss``, against a plain NumPy reference on
hand-built packed rows (several sequences per row, padding); the default settings against a frozen
copy of the loss they replace, bit for bit."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.loss_chunks import assert_rows_add_up

from jaxrl_orch.algorithms import corrections, losses
from jaxrl_orch.algorithms.loss_config import POLICY_LOSSES
from jaxrl_orch.config import train as train_config
from jaxrl_orch.config.load import make_config

R, L = 4, 12
TOL = dict(rtol=1e-5, atol=1e-6)

# Packed rows: two sequences then padding; three sequences; one sequence filling the row; one
# short sequence then padding (0 = padding).
SEG = np.array(
    [
        [1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0],
        [1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 0],
        [1] * 12,
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    ],
    np.int32,
)


def _sequences(seg):
    return [(r, s) for r in range(seg.shape[0]) for s in np.unique(seg[r]) if s > 0]


def _batch(seed=0, token_adv=False):
    """A sequence's first token is its prompt (never a loss token), as after the step's shift."""
    rng = np.random.default_rng(seed)
    first = np.concatenate([np.ones((R, 1), bool), SEG[:, 1:] != SEG[:, :-1]], axis=1)
    mask = (SEG > 0) & ~first & (rng.random((R, L)) < 0.85)
    adv = np.zeros((R, L), np.float32)
    new = np.zeros((R, L), np.float32)
    behavior = np.log(rng.uniform(0.05, 0.9, size=(R, L))).astype(np.float32)
    old = behavior + rng.normal(scale=0.4, size=(R, L)).astype(np.float32)
    for r, s in _sequences(SEG):
        sel = SEG[r] == s
        adv[r, sel] = rng.normal()
        # Each sequence drifts as a whole so that the sequence clip binds for some of them.
        new[r, sel] = old[r, sel] + rng.normal(scale=0.35) + rng.normal(scale=0.2, size=sel.sum())
    if token_adv:
        adv = adv + rng.normal(scale=0.5, size=(R, L)).astype(np.float32)
    new[SEG == 0] = 0.0
    ref = new + rng.normal(scale=0.3, size=(R, L)).astype(np.float32)
    ent = rng.uniform(0, 2, size=(R, L)).astype(np.float32)
    return dict(mask=mask, adv=adv, behavior=behavior, old=old, new=new, ref=ref, ent=ent)


# --- the NumPy reference ---------------------------------------------------------------------


def _np_seq(x, sel, mean):
    """Each token's sequence total (or mean) of ``x`` over the tokens ``sel``."""
    out = np.zeros(x.shape, np.float64)
    for r in range(x.shape[0]):
        for s in np.unique(SEG[r]):
            idx = SEG[r] == s
            tot = x[r][idx & sel[r]].sum()
            out[r, idx] = tot / max((idx & sel[r]).sum(), 1) if mean else tot
    return out


def _np_outside(log_x, bounds):
    low, high = bounds
    return (log_x < (np.log(low) if low > 0 else -np.inf)) | (log_x > np.log(high))


def _np_weights(mask, norm):
    m = mask.astype(np.float64)
    if norm == "token":
        return m / m.sum()
    seqs = [(r, s) for r, s in _sequences(SEG) if m[r, SEG[r] == s].sum()]
    w = np.zeros_like(m)
    for r, s in seqs:
        sel = SEG[r] == s
        w[r, sel] = m[r, sel] / m[r, sel].sum() / len(seqs)
    return w


def _np_masks(cfg, lrho, m, out):
    keep = m.copy()
    for name, band, x in (
        ("icepop_masked", cfg.icepop, lrho),
        ("mis_masked", cfg.mis_bounds, lrho if cfg.mis == "token" else _np_seq(lrho, m, False)),
        ("geo_masked", cfg.geo_mask, _np_seq(lrho, m, True)),
    ):
        if band is not None:
            drop = _np_outside(x, band)
            out[name] = (drop & m).sum()
            keep &= ~drop
    return keep


def _np_term(cfg, lr, new, adv, keep, out):
    if cfg.policy_loss == "cispo":
        r = np.exp(lr)
        lo, hi = 1 - cfg.eps_low_is, 1 + cfg.eps_high_is
        out["cispo_clipped"] = (((r < lo) | (r > hi)) & keep).sum()
        return -np.clip(r, lo, hi) * adv * new
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    r = np.exp(_np_seq(lr, keep, True)) if cfg.policy_loss != "ppo" else np.exp(lr)
    if cfg.policy_loss != "ppo":
        binds = ((r > hi) & (adv > 0)) | ((r < lo) & (adv < 0))
        out["seq_clipped"] = (binds & keep).sum()
    return -np.minimum(r * adv, np.clip(r, lo, hi) * adv)


def np_policy_loss(b, cfg, *, use_old, use_ref=False, use_ent=False):
    """The loss and finalized metrics, written from the papers' formulas in float64."""
    m = b["mask"]
    new, beh, old, adv = (b[k].astype(np.float64) for k in ("new", "behavior", "old", "adv"))
    lr = np.where(m, new - (old if use_old else beh), 0.0)
    lrho = np.where(m, (old if use_old else new) - beh, 0.0)
    out = {}
    keep = _np_masks(cfg, lrho, m, out)
    per = _np_term(cfg, lr, new, adv, keep, out)
    tis_capped = np.zeros((R, L))
    if use_old and cfg.tis_cap is not None:
        wt = np.exp(np.where(m, old - beh, 0.0))
        per, tis_capped = per * np.minimum(wt, cfg.tis_cap), wt > cfg.tis_cap
    per = np.where(keep, per, 0.0)
    if use_ref and cfg.kl_beta > 0:
        x = np.where(m, b["ref"] - new, 0.0)
        per = per + cfg.kl_beta * (np.exp(x) - x - 1)
        out["ref_kl"] = ((np.exp(x) - x - 1) * m).sum()
    if use_ent:
        per = per - cfg.entropy_coef * b["ent"]
        out["entropy"] = (b["ent"] * m).sum()
    ratio = np.exp(lr)
    out.update(
        clip_low=((ratio < 1 - cfg.eps_low) & (adv < 0) & m).sum(),
        clip_high=((ratio > 1 + cfg.eps_high) & (adv > 0) & m).sum(),
        approx_kl=((np.exp(lr) - lr - 1) * m).sum(),
        mismatch_kl=((np.exp(lrho) - lrho - 1) * m).sum(),
        ratio_mean=(ratio * m).sum(),
        tis_capped=(tis_capped * m).sum(),
    )
    n = m.sum()
    out = {k: v / n for k, v in out.items()}
    out.update(num_tokens=n, ratio_max=ratio[m].max(), loss=(per * _np_weights(m, cfg.norm)).sum())
    return out, keep


def _run(b, cfg, *, use_old, use_ref=False, use_ent=False, new=None, rows=slice(None), w=None):
    w = losses.loss_weights(b["mask"], SEG, cfg.norm) if w is None else w
    return losses.policy_loss(
        jnp.asarray(b["new"][rows] if new is None else new),
        b["behavior"][rows],
        b["adv"][rows],
        b["mask"][rows],
        w[rows],
        cfg,
        old_logp=jnp.asarray(b["old"][rows]) if use_old else None,
        ref_logp=jnp.asarray(b["ref"][rows]) if use_ref else None,
        entropy=jnp.asarray(b["ent"][rows]) if use_ent else None,
        segment_ids=jnp.asarray(SEG[rows]),
    )


def _check(b, cfg, **kw):
    loss, sums = _run(b, cfg, **kw)
    got = losses.finalize_metrics(sums)
    want, keep = np_policy_loss(b, cfg, **kw)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, **TOL, err_msg=k)
    np.testing.assert_allclose(float(loss), want["loss"], **TOL)
    return want, keep


# --- each setting against NumPy ----------------------------------------------------------------

Cfg = losses.PolicyLossConfig
CASES = {
    "gspo": (Cfg(policy_loss="gspo", tis_cap=None), False),
    "gspo_seqnorm_tis": (Cfg(policy_loss="gspo", norm="sequence", tis_cap=1.3), True),
    "gspo_token": (Cfg(policy_loss="gspo_token", eps_low=0.1, eps_high=0.15), True),
    "cispo": (Cfg(policy_loss="cispo", tis_cap=None, eps_low_is=0.3, eps_high_is=0.2), False),
    "cispo_no_low_tis": (Cfg(policy_loss="cispo", eps_high_is=0.1, norm="sequence"), True),
    "ppo_icepop": (Cfg(icepop=(0.6, 1.6), tis_cap=None), True),
    "ppo_mis_token": (Cfg(mis="token", mis_bounds=(0.7, 1.4)), True),
    "ppo_mis_seq": (Cfg(mis="sequence", mis_bounds=(0.5, 2.0), norm="sequence"), True),
    "ppo_geo": (Cfg(geo_mask=(0.85, 1.2)), True),
    "ppo_masks_on_policy": (Cfg(icepop=(0.6, 1.6), geo_mask=(0.8, 1.25)), False),
    "gspo_all_masks": (
        Cfg(policy_loss="gspo", icepop=(0.6, 1.6), mis="sequence", mis_bounds=(0.3, 3.0)),
        True,
    ),
    "cispo_geo_mis": (
        Cfg(policy_loss="cispo", geo_mask=(0.85, 1.2), mis="token", mis_bounds=(0.6, 1.8)),
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_setting_matches_numpy(name):
    cfg, use_old = CASES[name]
    want, keep = _check(_batch(seed=1), cfg, use_old=use_old)
    # The case is not vacuous: whatever it clips or masks really binds somewhere, not everywhere.
    for k in ("seq_clipped", "cispo_clipped", "icepop_masked", "mis_masked", "geo_masked"):
        if k in want:
            assert 0.0 < want[k] < 1.0, (k, want[k])
    if corrections.masks_on(cfg):
        assert keep.sum() < _batch(seed=1)["mask"].sum()


def test_corrections_keep_kl_and_entropy():
    cfg = Cfg(policy_loss="gspo", icepop=(0.6, 1.6), kl_beta=0.05, entropy_coef=0.01)
    _check(_batch(seed=2), cfg, use_old=True, use_ref=True, use_ent=True)


def test_gspo_token_has_gspo_value_and_differs_only_with_token_advantages():
    cfgs = [Cfg(policy_loss=name, tis_cap=None) for name in ("gspo", "gspo_token")]
    for token_adv in (False, True):
        b = _batch(seed=3, token_adv=token_adv)
        (ls, ss), (lt, st) = (_run(b, c, use_old=True) for c in cfgs)
        assert float(ls) == float(lt) and float(ss["seq_clipped"]) == float(st["seq_clipped"])
        grads = [
            jax.grad(lambda x, c=c, b=b: _run(b, c, use_old=True, new=x)[0])(b["new"]) for c in cfgs
        ]
        # GSPO spreads a sequence's advantages over its tokens; the token variant does not.
        if token_adv:
            assert np.abs(np.asarray(grads[0] - grads[1])).max() > 1e-4
        else:
            np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def _np_grad(b, cfg, keep, w):
    """d loss / d log pi_new, from the formulas (old log-probs given, no TIS)."""
    new, old, adv = (b[k].astype(np.float64) for k in ("new", "old", "adv"))
    lr = np.where(b["mask"], new - old, 0.0)
    if cfg.policy_loss == "cispo":
        weight = np.clip(np.exp(lr), 1 - cfg.eps_low_is, 1 + cfg.eps_high_is)
        return np.where(keep, -weight * adv * w, 0.0)
    s = np.exp(_np_seq(lr, keep, True))
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    live = keep & ~(((s > hi) & (adv > 0)) | ((s < lo) & (adv < 0)))
    if cfg.policy_loss == "gspo_token":
        return np.where(live, -s * adv * w, 0.0)
    # GSPO: every kept token of the sequence moves s by s / n_kept.
    n_kept = _np_seq(np.ones((R, L)), keep, False)
    return np.where(keep, -s / np.maximum(n_kept, 1) * _np_seq(adv * w, live, False), 0.0)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "cispo"])
@pytest.mark.parametrize("icepop", [None, (0.6, 1.6)])
def test_gradients_match_numpy(loss, icepop):
    b = _batch(seed=4, token_adv=True)
    cfg = Cfg(policy_loss=loss, tis_cap=None, icepop=icepop, eps_low_is=0.3, eps_high_is=0.2)
    w = losses.loss_weights(b["mask"], SEG, cfg.norm)
    g = jax.grad(lambda x: _run(b, cfg, use_old=True, new=x, w=w)[0])(jnp.asarray(b["new"]))
    _, keep = np_policy_loss(b, cfg, use_old=True)
    want = _np_grad(b, cfg, keep, np.asarray(w, np.float64))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    assert np.abs(want).max() > 1e-3 and (want[b["mask"] & ~keep] == 0).all()


def test_row_chunks_add_up_to_the_batch():
    """Sequences never span rows: per-row sums of sequence-level terms equal the whole batch's."""
    b = _batch(seed=5)
    cfg = Cfg(
        policy_loss="gspo",
        norm="sequence",
        mis="sequence",
        mis_bounds=(0.5, 2.0),
        geo_mask=(0.85, 1.2),
        icepop=(0.6, 1.6),
    )
    assert_rows_add_up(lambda rows: _run(b, cfg, use_old=True, rows=rows), R)


def test_off_mask_junk_and_empty_chunks_contribute_nothing():
    b = _batch(seed=6)
    masks = dict(icepop=(0.6, 1.6), mis="sequence", mis_bounds=(0.5, 2.0))
    for loss, masked in itertools.product(POLICY_LOSSES, (False, True)):
        cfg = Cfg(policy_loss=loss, **(masks if masked else {}))
        # Off the mask anything goes, even a log-prob of -inf.
        junk = np.where(b["mask"], b["new"], -np.inf).astype(np.float32)
        (la, sa), (lb, sb) = (_run(b, cfg, use_old=True, new=x) for x in (b["new"], junk))
        assert float(la) == float(lb) and all(float(sa[k]) == float(sb[k]) for k in sa)
        g = jax.grad(lambda x, c=cfg: _run(b, c, use_old=True, new=x)[0])(jnp.asarray(junk))
        assert np.isfinite(np.asarray(g)).all() and (np.asarray(g)[~b["mask"]] == 0).all()
        empty = dict(b, mask=np.zeros((R, L), bool))
        le, se = _run(empty, cfg, use_old=True)
        assert float(le) == 0.0
        assert all(np.isfinite(float(v)) for k, v in se.items() if k != "ratio_max")


# --- the decoupled objective and IcePop as the papers write them ---------------------------------


def test_decoupled_ppo_is_areal_objective():
    """AReaL: ratio against the recomputed proximal policy, times pi_prox / pi_behaviour,
    uncapped; AReaL's behav_imp_weight_cap drops (does not truncate) tokens above the cap. Here:
    tis_cap = inf, plus a token MIS band (0, cap)."""
    b = _batch(seed=7)
    cap = 1.3
    m = b["mask"]
    new, beh, prox, adv = (b[k].astype(np.float64) for k in ("new", "behavior", "old", "adv"))
    ratio = np.where(m, np.exp(new - prox), 0.0)
    surrogate = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28))
    behav_w = np.exp(prox - beh)
    assert (behav_w[m] > cap).any() and (behav_w[m] > 1).any()
    for capped in (False, True):
        kept = m & (behav_w <= cap) if capped else m
        want = (np.where(kept, surrogate * behav_w, 0.0)).sum() / m.sum()
        extra = dict(mis="token", mis_bounds=(0.0, cap)) if capped else {}
        cfg = Cfg(tis_cap=math.inf, **extra)
        loss, sums = _run(b, cfg, use_old=True)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
        assert float(sums["tis_capped"]) == 0.0


def test_icepop_with_tis_at_its_upper_bound_is_the_icepop_objective():
    """IcePop weights a token by M(k) = k inside [a, b], 0 outside, k = pi_train / pi_infer."""
    b = _batch(seed=8)
    a, hi = 0.6, 1.6
    m = b["mask"]
    new, beh, old, adv = (b[k].astype(np.float64) for k in ("new", "behavior", "old", "adv"))
    k = np.exp(old - beh)
    gate = np.where((k >= a) & (k <= hi) & m, k, 0.0)
    ratio = np.exp(new - old)
    surrogate = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.28) * adv)
    want = (gate * surrogate).sum() / m.sum()
    loss, sums = _run(b, Cfg(icepop=(a, hi), tis_cap=hi), use_old=True)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
    assert 0 < float(sums["icepop_masked"]) < m.sum()


# --- defaults: bit for bit the loss they replace -----------------------------------------------


def _frozen_policy_loss(new_logp, behavior_logp, advantages, loss_mask, weights, cfg, *, old_logp):
    """The token surrogate with TIS as it was before the corrections (kept verbatim)."""
    sg = jax.lax.stop_gradient
    mask = jnp.asarray(loss_mask).astype(jnp.float32)
    maskb = mask > 0
    new_logp = new_logp.astype(jnp.float32)
    behavior_logp = jnp.asarray(behavior_logp, jnp.float32)
    if old_logp is not None:
        behavior_logp = jnp.where(jnp.isnan(behavior_logp), sg(old_logp), behavior_logp)
    adv = jnp.asarray(advantages, jnp.float32)
    denom_logp = behavior_logp if old_logp is None else sg(old_logp)
    log_ratio = jnp.where(maskb, new_logp - denom_logp, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    tis_capped = jnp.zeros_like(mask)
    if old_logp is not None and cfg.tis_cap is not None:
        tis_raw = jnp.exp(jnp.where(maskb, sg(old_logp) - behavior_logp, 0.0))
        per_token = per_token * jnp.minimum(tis_raw, cfg.tis_cap)
        tis_capped = (tis_raw > cfg.tis_cap).astype(jnp.float32)
    loss = jnp.sum(per_token * weights)
    sg_ratio, sg_log_ratio = sg(ratio), sg(log_ratio)
    trainer_logp = sg(new_logp if old_logp is None else old_logp)
    engine_log_ratio = jnp.where(maskb, trainer_logp - behavior_logp, 0.0)
    return loss, dict(
        loss=sg(loss),
        num_tokens=mask.sum(),
        clip_low=jnp.sum(((sg_ratio < 1.0 - cfg.eps_low) & (adv < 0) & maskb) * 1.0),
        clip_high=jnp.sum(((sg_ratio > 1.0 + cfg.eps_high) & (adv > 0) & maskb) * 1.0),
        approx_kl=jnp.sum(losses.k3(sg_log_ratio) * mask),
        mismatch_kl=jnp.sum(losses.k3(engine_log_ratio) * mask),
        ratio=jnp.sum(sg_ratio * mask),
        ratio_max=jnp.max(jnp.where(maskb, sg_ratio, -jnp.inf), initial=-jnp.inf),
        tis_capped=jnp.sum(tis_capped * mask),
    )


@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_default_settings_are_bit_identical_to_the_token_surrogate(use_old, jit):
    b = _batch(seed=9)
    cfg = Cfg()
    w = losses.loss_weights(b["mask"], SEG, cfg.norm)
    args = (b["behavior"], b["adv"], b["mask"], w, cfg)
    old = jnp.asarray(b["old"]) if use_old else None

    def new_fn(x):
        return losses.policy_loss(x, *args, old_logp=old, segment_ids=jnp.asarray(SEG))

    def frozen_fn(x):
        return _frozen_policy_loss(x, *args, old_logp=old)

    outs = []
    for fn in (new_fn, frozen_fn):
        fn = jax.value_and_grad(fn, has_aux=True)
        (loss, sums), grad = (jax.jit(fn) if jit else fn)(jnp.asarray(b["new"]))
        outs.append((np.asarray(loss), {k: np.asarray(v) for k, v in sums.items()}, grad))
    (l1, s1, g1), (l2, s2, g2) = outs
    assert l1.tobytes() == l2.tobytes()
    assert s1.keys() == s2.keys() and all(s1[k].tobytes() == s2[k].tobytes() for k in s1)
    assert np.asarray(g1).tobytes() == np.asarray(g2).tobytes()


# --- settings ------------------------------------------------------------------------------------


def test_bad_settings_name_the_value_and_the_allowed():
    bad = {
        "policy_loss='grpo'": (dict(policy_loss="grpo"), r"'ppo', 'gspo'.*'grpo'"),
        "mis without bounds": (
            dict(mis="token"),
            r"Loss.mis \('token'\) and Loss.mis_bounds \(None",
        ),
        "bounds without mis": (dict(mis_bounds=(0.5, 2)), r"Loss.mis \(None\) and Loss.mis_bounds"),
        "mis level": (dict(mis="row", mis_bounds=(0.5, 2)), r"\(None, 'token', 'seq.*'row'"),
        "band order": (dict(icepop=(2.0, 0.5)), r"icepop must be .*0 <= low < high.*2.0"),
        "band shape": (dict(geo_mask=(0.5,)), r"geo_mask must be .*\(0.5,\)"),
        "negative": (dict(mis="token", mis_bounds=(-1, 2)), r"mis_bounds must be.*-1"),
        "eps_low_is": (dict(eps_low_is=1.5), r"eps_low_is must be in \[0, 1\].*1.5"),
    }
    for kw, msg in bad.values():
        with pytest.raises(ValueError, match=msg):
            Cfg(**kw)
        with pytest.raises(ValueError, match=msg):
            make_config({f"Loss.{k}": v for k, v in kw.items()})
    assert Cfg(icepop=[0.5, 2]).icepop == (0.5, 2.0)  # a list binding becomes a float pair


def test_rl_settings_reach_the_step_config():
    from jaxrl_orch.compose.trainers import step_config

    rl = dict(
        policy_loss="cispo",
        eps_low_is=0.5,
        eps_high_is=2.0,
        icepop=(0.5, 2.0),
        mis="sequence",
        mis_bounds=(0.1, 10.0),
        geo_mask=(0.8, 1.25),
    )
    loss = step_config(make_config({f"Loss.{k}": v for k, v in rl.items()}), "rl").loss
    assert {k: getattr(loss, k) for k in rl} == rl
    assert step_config(train_config.TrainConfig(), "rl").loss == Cfg(norm="token")


def test_gin_bindings_spell_the_bands_and_an_uncapped_weight():
    import gin

    from jaxrl_orch.compose.trainers import step_config
    from jaxrl_orch.config.load import load_config

    bindings = [
        "Loss.geo_mask = (0.9, 1.1)",
        "Loss.tis_cap = 1e999",
        "RL.recompute_old_logprobs = True",
    ]
    try:
        loss = step_config(load_config([], bindings), "rl").loss
        with pytest.raises(ValueError, match=r"Loss.mis \('sequence'\) and Loss.mis_bounds \(None"):
            load_config([], ["Loss.mis = 'sequence'"])
    finally:
        gin.clear_config()
    assert loss.geo_mask == (0.9, 1.1) and loss.tis_cap == math.inf  # AReaL's uncapped weight
