"""A LoRA trainer: only adapters train, the base stays bit-identical, checkpoints resume exactly."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from support.trainer_batches import TINY, make_batch

from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.trainer import optim as optim_lib
from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    restore_trainer,
    save_trainer,
)
from jaxrl_orch.trainer.trainer import RowLayout, Trainer
from sharding.mesh import make_meshes

LORA_TINY = dataclasses.replace(TINY, lora=LoraConfig(rank=4, alpha=8.0))
QLORA_TINY = dataclasses.replace(TINY, lora=LoraConfig(rank=4, alpha=8.0, quantize="int8"))
OPTIM = optim_lib.OptimConfig(learning_rate=1e-2, eps=1e-4)
STEP = step_lib.StepConfig(chunk_rows=2)


def _host(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def _mesh():
    return make_meshes({"tp": 1}, {"fsdp": 2, "tp": 2})[1]


def _base_params(seed: int = 7):
    """A plain model's weights: what the warm-up hands a LoRA RL trainer as its base."""
    return nnx.split(Transformer(TINY, rngs=nnx.Rngs(seed)))[1]


def _trainer(seed: int = 1, base=None, step=STEP, model=LORA_TINY) -> Trainer:
    rows = RowLayout(row_len=32)
    return Trainer(model, _mesh(), rows=rows, step=step, optim=OPTIM, seed=seed, init_params=base)


def test_only_the_adapters_train_and_the_base_stays_bit_identical():
    base = _base_params()
    trainer = _trainer(base=base)
    before_base = _host(trainer.frozen)
    before = _host(trainer.params)
    for step in (1, 2, 3):
        trainer.train_step(make_batch(step, seed=step))
    np.testing.assert_equal(_host(trainer.frozen), before_base)
    np.testing.assert_equal(_host(trainer.frozen), _host(base))
    changed = [not np.array_equal(a, b) for a, b in zip(before, _host(trainer.params), strict=True)]
    assert all(changed)  # every A and B moved (B from zero)
    # The optimizer holds state for the adapters alone: Adam's moments, adapter-shaped.
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(trainer.params))
    moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim >= 2]
    assert sorted(x.shape for x in moments) == sorted(adapter_shapes * 2)


def test_a_fresh_lora_trainer_merges_to_its_base_exactly():
    base = _base_params()
    trainer = _trainer(base=base)
    np.testing.assert_equal(_host(trainer.merged_params()), _host(base))
    trainer.train_step(make_batch(1))
    merged = _host(trainer.merged_params())
    assert any(not np.array_equal(m, b) for m, b in zip(merged, _host(base), strict=True))


def test_lora_with_the_kl_reference_trains():
    # The reference policy is the initial one: adapters with B = 0, i.e. the base itself.
    loss = dataclasses.replace(STEP.loss, kl_beta=0.1)
    trainer = _trainer(base=_base_params(), step=dataclasses.replace(STEP, loss=loss))
    first = trainer.train_step(make_batch(1))
    second = trainer.train_step(make_batch(2, seed=4))
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # on the reference: no divergence
    assert second["ref_kl"] > 0


@pytest.mark.parametrize("model", [LORA_TINY, QLORA_TINY], ids=["lora", "qlora-int8"])
def test_resume_restores_the_adapters_and_continues_every_step_once(tmp_path, model):
    base = _base_params()
    src = _trainer(base=base, model=model)
    src.train_step(make_batch(1))
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    assert save_trainer(ckpt, src, 1, {"step": 2})
    ckpt.wait()

    dst = _trainer(seed=99, base=base, model=model)  # another seed: its fresh adapters differ
    assert restore_trainer(Checkpointer(tmp_path), dst) == {"step": 2}
    assert dst.version == 1 and dst.steps_done == 1
    np.testing.assert_equal(_host(dst.params), _host(src.params))
    np.testing.assert_equal(_host(dst.opt_state), _host(src.opt_state))
    with pytest.raises(ValueError, match="expected step 2"):
        dst.train_step(make_batch(1))
    dst.train_step(make_batch(2, seed=5))
    src.train_step(make_batch(2, seed=5))
    for a, b in zip(_host(dst.params), _host(src.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_resume_onto_another_base_is_refused(tmp_path):
    src = _trainer(base=_base_params(seed=7))
    src.train_step(make_batch(1))
    ckpt = Checkpointer(tmp_path)
    save_trainer(ckpt, src, 1, {})
    ckpt.wait()
    other = _trainer(base=_base_params(seed=8))
    with pytest.raises(CheckpointError, match=r"trained over base [0-9a-f]{16}, but this run's"):
        restore_trainer(Checkpointer(tmp_path), other)
    assert other.version == 0  # nothing adopted


def test_a_base_that_does_not_fit_the_model_is_named():
    wrong = nnx.split(Transformer(dataclasses.replace(TINY, d_ff=TINY.d_ff * 2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"init_params\S*mlp\S*_proj\S* has shape \(128, 32\)"):
        _trainer(base=wrong[1])


def test_a_qlora_trainer_holds_its_base_int8_trains_adapters_and_serves_the_dequantized_base():
    base = _base_params()
    trainer = _trainer(base=base, model=QLORA_TINY)
    projections = [x for x in jax.tree.leaves(trainer.frozen) if x.dtype == jax.numpy.int8]
    assert len(projections) == 7 * TINY.n_layers
    dense = _host(trainer.dense_base())
    # The dense base is the given one up to int8 rounding, and a fresh adapter merges to it.
    assert all(a.shape == b.shape for a, b in zip(dense, _host(base), strict=True))
    np.testing.assert_allclose(
        np.concatenate([d.ravel() for d in dense]),
        np.concatenate([b.ravel() for b in _host(base)]),
        atol=0.01,
    )
    np.testing.assert_equal(_host(trainer.merged_params()), dense)
    before, frozen = _host(trainer.params), _host(trainer.frozen)
    for step in (1, 2):
        metrics = trainer.train_step(make_batch(step, seed=step))
        assert np.isfinite(metrics["loss"])
    np.testing.assert_equal(_host(trainer.frozen), frozen)  # int8 values and scales untouched
    after = _host(trainer.params)
    assert all(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
