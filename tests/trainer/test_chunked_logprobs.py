"""Chunked log-probs / loss (StepConfig.logprob_chunk) give the plain path's numbers, and the
compiled step then holds no [rows, T, V] float32 tensor."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
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
from jaxrl_orch.trainer.logprobs import token_stats
from jaxrl_orch.trainer.programs import build_programs
from jaxrl_orch.trainer.trainer import RowLayout, Trainer
from sharding.rules import abstract_arrays

OPTIM = optim_lib.OptimConfig(learning_rate=1e-2)


def test_token_stats_chunks_match_full_values_and_grads():
    rng = np.random.default_rng(0)
    r, t, e, v = 3, 37, 16, 50  # 37 positions: the last chunk is padded
    hidden = jnp.asarray(rng.normal(size=(r, t, e)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(e, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (r, t)), jnp.int32)
    temps = jnp.asarray(rng.choice([0.7, 1.0, 0.0], (r, t)), jnp.float32)
    head = lambda h: h @ w

    def f(hidden, chunk):
        lp, ent = token_stats(head, hidden, targets, temps, chunk)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)

    (_, (lp0, ent0)), g0 = jax.value_and_grad(f, has_aux=True)(hidden, 0)
    np.testing.assert_allclose(
        np.asarray(lp0), np.asarray(losses.token_logprobs(head(hidden), targets, temps)), rtol=0
    )
    (_, (lp1, ent1)), g1 = jax.value_and_grad(f, has_aux=True)(hidden, 8)
    assert lp1.dtype == ent1.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent1), np.asarray(ent0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        token_stats(head, hidden, targets, temps, -4)


@pytest.fixture(scope="module")
def setup():
    params = jax.device_get(nnx.split(Transformer(TINY, rngs=nnx.Rngs(3)))[1])
    packed = pack_samples(make_batch(1, seed=11, n_samples=6).samples, 32, num_rows=4)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))
    return params, packed, mesh


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_chunked_step_matches_plain_step(setup, kind):
    params, packed, mesh = setup
    kw = dict(kind=kind, chunk_rows=2, recompute_old_logprobs=kind == "rl")
    out = {}
    for chunk in (0, 8):
        tr = Trainer(
            TINY,
            mesh,
            rows=RowLayout(row_len=32),
            optim=OPTIM,
            init_params=params,
            step=step_lib.StepConfig(logprob_chunk=chunk, **kw),
        )
        out[chunk] = (tr.train_packed(packed), jax.device_get(tr.params))
    (m0, p0), (m1, p1) = out[0], out[8]
    for k in ("loss", "grad_norm", "num_tokens", *(["entropy", "ratio_mean"] * (kind == "rl"))):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # Adam divides by sqrt(v): a near-zero gradient's rounding moves its param by up to ~lr, so
    # params are compared at a fraction of the lr (1e-2), the rest at fp32 rounding.
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


def test_chunked_step_has_no_full_logits_tensor(setup):
    """The compiled step's temporaries shrink by more than the [C, T, V] fp32 logits when the
    vocab dominates (the donation of params and optimizer state is checked alongside)."""
    params, packed, mesh = setup
    big_vocab = dataclasses.replace(TINY, vocab_size=4096)
    temps = {}
    for chunk in (0, 4):
        cfg = step_lib.StepConfig(chunk_rows=4, logprob_chunk=chunk)
        progs = build_programs(big_vocab, mesh, cfg, OPTIM, row_len=32)
        params = abstract_arrays(progs.abstract_params, progs.param_shardings)
        opt = abstract_arrays(progs.abstract_opt_state, progs.opt_shardings)
        arrays = {k: getattr(packed, k) for k in step_lib.BATCH_FIELDS}
        rng = jax.random.PRNGKey(0)
        ma = progs.step_fn.lower(params, opt, arrays, rng, None, None).compile().memory_analysis()
        temps[chunk] = ma.temp_size_in_bytes
        # params + Adam moments are donated: their outputs alias the inputs.
        leaves = jax.tree.leaves((params, opt))
        donated = sum(x.size * x.dtype.itemsize for x in leaves if x.ndim) // 2  # fsdp 2
        assert ma.alias_size_in_bytes >= 0.9 * donated
    logits_bytes = 4 * 32 * 4096 * 4 // 2  # [C=4, T=32, V] fp32, rows split over fsdp 2
    assert temps[0] - temps[4] > logits_bytes, temps
