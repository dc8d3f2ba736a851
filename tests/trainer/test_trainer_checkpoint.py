"""Checkpoint round trip onto a different mesh, resume, and missing/corrupt errors."""

import os

import jax
import numpy as np
import pytest
from conftest import TINY, make_batch

from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    restore_trainer,
    save_trainer,
)
from jaxrl_orch.trainer.trainer import Trainer
from sharding.mesh import make_meshes

OPTIM = step_lib.OptimConfig(learning_rate=1e-3, eps=1e-4)
STEP = step_lib.StepConfig(chunk_rows=2)
ORCH = {"progress_step": 1, "cursor": {"reverse_text": 17}, "gate": [3, 4], "note": "x"}


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2x2-mesh trainer after one step, saved (async) at step 1."""
    _, mesh = make_meshes({"tp": 1}, {"fsdp": 2, "tp": 2})
    trainer = Trainer(TINY, mesh, row_len=32, step=STEP, optim=OPTIM, seed=1)
    trainer.train_step(make_batch(1))
    path = tmp_path_factory.mktemp("ckpt")
    ckpt = Checkpointer(path, max_to_keep=2)
    assert save_trainer(ckpt, trainer, 1, ORCH)
    ckpt.wait()
    return trainer, ckpt, path


def test_round_trip_onto_other_mesh_is_bit_equal_and_resume_continues(saved):
    src, ckpt, path = saved
    # A different mesh: 2 devices, pure tensor parallel, disjoint from the source's devices.
    devices = jax.devices()[4:6]
    _, mesh = make_meshes({"tp": 1}, {"fsdp": 1, "tp": 2}, devices=devices + jax.devices()[6:7])
    dst = Trainer(TINY, mesh, row_len=32, step=STEP, optim=OPTIM, seed=99)
    assert Checkpointer(path).latest_step() == 1
    orch = restore_trainer(Checkpointer(path), dst, step=None)

    assert orch == ORCH
    assert dst.version == 1 and dst.steps_done == 1
    np.testing.assert_array_equal(np.asarray(dst.rng), np.asarray(src.rng))
    _leaves_equal(dst.params, src.params)
    _leaves_equal(dst.opt_state, src.opt_state)
    # Restored arrays live on the destination mesh with its shardings.
    for leaf, sh in zip(
        jax.tree.leaves(dst.params), jax.tree.leaves(dst.param_shardings), strict=True
    ):
        assert leaf.sharding == sh
    assert {d.id for leaf in jax.tree.leaves(dst.params) for d in leaf.devices()} <= {
        d.id for d in devices
    }

    # Resume: the step count continues, and the next step matches the uninterrupted run.
    with pytest.raises(ValueError, match="expected step 2"):
        dst.train_step(make_batch(1))
    dst.train_step(make_batch(2, seed=5))
    src.train_step(make_batch(2, seed=5))
    assert dst.version == src.version == 2 and dst.steps_done == 2
    for x, y in zip(jax.tree.leaves(dst.params), jax.tree.leaves(src.params), strict=True):
        # Different meshes sum in a different order: float32 round-off only.
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_missing_checkpoint_names_the_path(tmp_path, saved):
    src = saved[0]
    empty = tmp_path / "nothing_here"
    with pytest.raises(CheckpointNotFoundError, match="nothing_here"):
        Checkpointer(empty).restore(src.abstract_state())
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 .*available steps: \[1\]"):
        Checkpointer(saved[2]).restore(src.abstract_state(), step=7)


def test_corrupt_checkpoint_names_the_path(tmp_path, saved):
    src, _, path = saved
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    # Truncate every array data file of the saved state.
    hit = 0
    for root, _, files in os.walk(bad / "1" / "state"):
        for f in files:
            if "metadata" not in f and not f.endswith(".json"):
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"\0garbage")
                hit += 1
    assert hit
    with pytest.raises(CheckpointError, match=str(bad)):
        Checkpointer(bad).restore(src.abstract_state())


def test_orchestrator_state_must_be_json(tmp_path, saved):
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_trainer(Checkpointer(tmp_path), saved[0], 2, {"bad": object()})
