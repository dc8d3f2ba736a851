"""The jitted train step: sharded == unsharded, accumulation == big batch, minibatch loop,
optimizer schedules, and the shift/mask rule, against direct re-computation."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from support.trainer_batches import TINY, make_batch

from jaxrl_orch.algorithms import losses
from jaxrl_orch.algorithms.packing import pack_samples
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.trainer import optim as optim_lib
from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.trainer import RowLayout, Trainer

OPTIM = optim_lib.OptimConfig(learning_rate=1e-3, eps=1e-4)


def _mesh(fsdp, tp, first=0):
    devs = np.array(jax.devices()[first : first + fsdp * tp]).reshape(fsdp, tp)
    return Mesh(devs, ("fsdp", "tp"))


@pytest.fixture(scope="module")
def host_params():
    return jax.device_get(nnx.split(Transformer(TINY, rngs=nnx.Rngs(3)))[1])


@pytest.fixture(scope="module")
def packed():
    p = pack_samples(make_batch(1, seed=11, n_samples=6).samples, 32, num_rows=4)
    assert (p.segment_ids[:, 0] > 0).all()  # all 4 rows carry data; tests split them
    return p


def _trainer(mesh, params, **step_kw):
    return Trainer(
        TINY,
        mesh,
        rows=RowLayout(row_len=32),
        optim=OPTIM,
        step=step_lib.StepConfig(**step_kw),
        init_params=params,
    )


def _assert_params_close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def _adam_count(opt_state):
    return int(opt_state[1][0].count)


@pytest.mark.slow
def test_sharded_step_matches_unsharded(host_params, packed):
    kw = dict(
        chunk_rows=2,
        recompute_old_logprobs=True,
        loss=losses.PolicyLossConfig(norm="sequence", tis_cap=1.5, kl_beta=0.05),
    )
    one = _trainer(_mesh(1, 1), host_params, **kw)
    four = _trainer(_mesh(2, 2, first=4), host_params, **kw)
    # The 2x2 run really is sharded over both axes.
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(four.params)}
    assert any("fsdp" in s for s in specs) and any("tp" in s for s in specs)
    mu = four.opt_state[1][0].mu
    for m, p in zip(jax.tree.leaves(mu), jax.tree.leaves(four.params), strict=True):
        assert m.sharding == p.sharding
    m1 = one.train_packed(packed)
    m4 = four.train_packed(packed)
    # Tolerance: float32 reductions in another order (rtol 1e-5 on the loss and diagnostics,
    # atol 1e-5 on params after one AdamW step of lr 1e-3).
    for k in ("loss", "grad_norm", "entropy", "mismatch_kl", "ratio_mean"):
        np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, err_msg=k)
    assert m1["first/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    _assert_params_close(four.params, one.params, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_grad_accumulation_over_rows_equals_one_big_chunk(host_params, packed):
    mesh = _mesh(1, 1)
    small = _trainer(mesh, host_params, chunk_rows=1)
    big = _trainer(mesh, host_params, chunk_rows=4)
    ms, mb = small.train_packed(packed), big.train_packed(packed)
    np.testing.assert_allclose(ms["loss"], mb["loss"], rtol=1e-5)
    np.testing.assert_allclose(ms["grad_norm"], mb["grad_norm"], rtol=1e-5)
    assert ms["num_tokens"] == mb["num_tokens"] > 0
    _assert_params_close(small.params, big.params, rtol=1e-5, atol=1e-6)
    # The step moved the params at all (otherwise equality above would be vacuous).
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(small.params), jax.tree.leaves(host_params), strict=True)
    )
    assert moved > 1e-4


@pytest.mark.slow
def test_minibatches_are_sequential_optimizer_steps(host_params, packed):
    """minibatches=2 (unshuffled) == two one-minibatch steps on the row halves."""
    mesh = _mesh(1, 1)
    two = _trainer(mesh, host_params, minibatches=2, shuffle_minibatches=False)
    seq = _trainer(mesh, host_params, chunk_rows=2)
    two.train_packed(packed)
    for half in (slice(0, 2), slice(2, 4)):
        sub = type(packed)(
            **{
                f: getattr(packed, f)[half] if f != "placement" else packed.placement
                for f in (*step_lib.BATCH_FIELDS, "placement")
            }
        )
        seq.train_packed(sub)
    assert _adam_count(two.opt_state) == _adam_count(seq.opt_state) == 2
    _assert_params_close(two.params, seq.params, rtol=1e-5, atol=1e-6)


def test_shift_targets_masks_segment_starts():
    seg = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
    batch = {
        "tokens": np.arange(6, dtype=np.int32)[None],
        "positions": np.array([[0, 1, 2, 0, 1, 0]], np.int32),
        "segment_ids": seg,
        "loss_mask": np.array([[0, 1, 1, 1, 1, 0]], bool),
        "advantages": np.arange(6, dtype=np.float32)[None],
        "logprobs": -np.arange(6, dtype=np.float32)[None],
        "temperatures": np.ones((1, 6), np.float32),
    }
    out = step_lib.shift_targets(batch)
    np.testing.assert_array_equal(out["targets"], [[1, 2, 3, 4, 5]])
    # Token 3 opens segment 2: never scored from token 2 of segment 1.
    np.testing.assert_array_equal(out["mask"], [[True, True, False, True, False]])
    np.testing.assert_array_equal(out["advantages"], [[1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(out["behavior"], [[-1, -2, -3, -4, -5]])


def test_schedules_match_formula():
    cfg = optim_lib.OptimConfig(
        learning_rate=1e-3,
        schedule="warmup_cosine",
        warmup_steps=10,
        total_steps=110,
        end_lr_ratio=0.1,
    )
    sched = optim_lib.make_schedule(cfg)
    for s in (0, 5, 10, 60, 110, 200):
        if s < 10:
            want = 1e-3 * s / 10
        else:
            frac = min(s - 10, 100) / 100
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + np.cos(np.pi * frac))
        np.testing.assert_allclose(float(sched(s)), want, rtol=1e-5, atol=1e-9)
    const = optim_lib.make_schedule(optim_lib.OptimConfig(learning_rate=2e-4, warmup_steps=4))
    np.testing.assert_allclose([float(const(s)) for s in (0, 2, 4, 50)], [0, 1e-4, 2e-4, 2e-4])


def test_config_errors_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"\('rl', 'sft'\).*'ppo'"):
        step_lib.StepConfig(kind="ppo")
    with pytest.raises(ValueError, match=r"\('constant', 'warmup_cosine'\).*'linear'"):
        optim_lib.OptimConfig(schedule="linear")
    with pytest.raises(ValueError, match="minibatches"):
        step_lib.StepConfig(minibatches=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        Trainer(TINY, _mesh(1, 1), rows=RowLayout(row_len=1024))
    wrong = nnx.split(Transformer(dataclasses.replace(TINY, d_ff=48), rngs=nnx.Rngs(0)))[1]
    with pytest.raises(ValueError, match=r"down_proj.*\(48, 32\).*needs \(64, 32\)"):
        Trainer(TINY, _mesh(1, 1), rows=RowLayout(row_len=32), init_params=wrong)


@pytest.mark.slow
def test_ppo_epochs_times_shuffled_minibatches(host_params, packed):
    """2 epochs x 2 shuffled minibatches = 4 updates; with recomputed old log-probs the first
    update is exactly on-policy and later ones are not."""
    t = _trainer(
        _mesh(1, 1),
        host_params,
        ppo_epochs=2,
        minibatches=2,
        chunk_rows=1,
        recompute_old_logprobs=True,
        loss=losses.PolicyLossConfig(tis_cap=1.5),
    )
    m = t.train_packed(packed)
    assert _adam_count(t.opt_state) == 4
    assert m["first/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["approx_kl"] > 0 and m["ratio_max"] > 1.0
    assert m["num_tokens"] == packed.loss_mask[:, 1:].sum()


CORRECTIONS = {
    # GSPO over the packed rows' sequences (the step hands the loss each target's segment id)
    "gspo": (losses.PolicyLossConfig(policy_loss="gspo", norm="sequence"), False),
    "cispo_icepop": (losses.PolicyLossConfig(policy_loss="cispo", icepop=(0.5, 2.0)), False),
    # AReaL's decoupled objective (uncapped weight against the recomputed proximal policy)
    # with the masks on the recomputed trainer/engine ratio
    "decoupled_masks": (
        losses.PolicyLossConfig(
            tis_cap=float("inf"),
            icepop=(0.5, 2.0),
            mis="sequence",
            mis_bounds=(0.05, 20.0),
            geo_mask=(0.7, 1.4),
        ),
        True,
    ),
}
SHARES = {
    "gspo": ("seq_clipped",),
    "cispo_icepop": ("cispo_clipped", "icepop_masked"),
    "decoupled_masks": ("icepop_masked", "mis_masked", "geo_masked"),
}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_corrections_compile_train_and_report_their_shares(host_params, packed, name):
    loss, recompute = CORRECTIONS[name]
    t = _trainer(
        _mesh(1, 1), host_params, chunk_rows=2, recompute_old_logprobs=recompute, loss=loss
    )
    m = t.train_packed(packed)
    assert all(np.isfinite(v) for v in m.values()), m
    # The engine log-probs of these batches are far from the tiny model's: every mask drops
    # some tokens and every clip binds somewhere, none everywhere.
    for share in SHARES[name]:
        assert 0.0 < m[share] < 1.0, (share, m[share])
    if recompute:  # the ratio is against the proximal policy: exactly 1 on the first update
        assert m["first/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(t.params), jax.tree.leaves(host_params), strict=True)
    )
    assert moved > 1e-5
