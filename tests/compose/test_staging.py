"""A LoRA run's engine weights (compose/staging.py): the base placed once, adapters merged there."""

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
from flax import nnx
from support.trainer_batches import TINY, make_batch

from jaxrl_orch.compose.staging import AdapterMerge, tree_nbytes
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.transformer import Transformer, logical_specs
from jaxrl_orch.trainer.trainer import RowLayout, Trainer
from sharding.mesh import make_meshes
from sharding.rules import DECODE_RULES, resolve_shardings


def test_the_engine_serves_what_the_trainer_merges_and_only_adapters_move():
    decode_mesh, trainer_mesh = make_meshes({"tp": 2}, {"fsdp": 2, "tp": 2})
    cfg = dataclasses.replace(TINY, lora=LoraConfig(rank=4, alpha=8.0))
    trainer = Trainer(cfg, trainer_mesh, rows=RowLayout(row_len=32), seed=1)
    trainer.train_step(make_batch(1))  # non-zero adapters
    base = nnx.split(nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0))))[1]
    shardings = resolve_shardings(logical_specs(base), decode_mesh, DECODE_RULES, shapes=base)
    engine = SimpleNamespace(param_shardings=shardings, param_dtype=None)

    merge = AdapterMerge(engine, trainer.frozen, cfg.lora.scale)
    served = merge.move(trainer.params)
    want = trainer.merged_params()
    for got, ref, sh in zip(
        jax.tree.leaves(served), jax.tree.leaves(want), jax.tree.leaves(shardings), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-7)
        assert got.sharding == sh  # laid out as the engine's own weights
    assert merge.bytes_moved == tree_nbytes(trainer.params) < tree_nbytes(served) / 5
