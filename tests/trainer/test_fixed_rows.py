"""Fixed shapes: a trainer built with ``min_rows`` pads every batch to one row count, so its
step compiles once, and skipping the padding chunks on device leaves the step's results
exactly those of the same batch packed tight."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from support.trainer_batches import TINY, make_batch

from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.trainer import RowLayout, Trainer


@pytest.mark.parametrize("recompute", [False, True])
def test_padding_chunks_change_nothing_and_the_step_compiles_once(recompute):
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))
    cfg = step_lib.StepConfig(kind="rl", chunk_rows=2, recompute_old_logprobs=recompute)

    def trainer(**kw):
        return Trainer(TINY, mesh, rows=RowLayout(row_len=32, **kw), step=cfg, seed=0)

    tight, fixed = trainer(), trainer(min_rows=12)
    batches = [make_batch(1, seed=1, n_samples=5), make_batch(2, seed=2, n_samples=9)]
    rows = [tight.pack(b).num_rows for b in batches]
    assert rows[0] < rows[1] <= 12 and all(r % 2 == 0 for r in rows)  # two tight shapes
    assert [fixed.pack(b).num_rows for b in batches] == [12, 12]  # one fixed shape
    for b in batches:
        m_tight, m_fixed = tight.train_step(b), fixed.train_step(b)
        for k in ("loss", "grad_norm", "entropy", "ratio_mean", "num_tokens", "approx_kl"):
            assert m_fixed[k] == pytest.approx(m_tight[k], rel=1e-6, abs=1e-7), k
    for a, b in zip(jax.tree.leaves(tight.params), jax.tree.leaves(fixed.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert fixed._step_fn._cache_size() == 1 and tight._step_fn._cache_size() == 2


def test_a_batch_needing_more_rows_than_min_rows_still_trains():
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))
    rows = RowLayout(row_len=32, min_rows=2)
    t = Trainer(TINY, mesh, rows=rows, step=step_lib.StepConfig(kind="rl", chunk_rows=2))
    packed = t.pack(make_batch(1, seed=3, n_samples=9))
    assert packed.num_rows > 2 and packed.num_rows % 2 == 0


def _compiled_programs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]


@pytest.mark.parametrize("precompiled", [True, False])
def test_the_first_batch_finds_the_step_already_compiled(precompiled, caplog):
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))
    cfg = step_lib.StepConfig(kind="rl", chunk_rows=2)
    t = Trainer(TINY, mesh, rows=RowLayout(row_len=32, min_rows=12), step=cfg, seed=0)
    if precompiled:  # what the worker does at start, before it takes the first batch
        assert t.precompile()
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        t.train_step(make_batch(1, seed=1, n_samples=5))
    steps = [m for m in _compiled_programs(caplog) if "jit(step)" in m]
    assert (steps == []) if precompiled else len(steps) == 1, _compiled_programs(caplog)
    # Without a row floor the batch's shape is not known before it arrives.
    assert not Trainer(TINY, mesh, rows=RowLayout(row_len=32), step=cfg, seed=0).precompile()
