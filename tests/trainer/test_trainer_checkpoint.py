"""Checkpoint round trip onto a different mesh, resume, and missing/corrupt errors."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.trainer_batches import TINY, make_batch

from jaxrl_orch.trainer import optim as optim_lib
from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    restore_newest_intact,
    restore_trainer,
    save_trainer,
)
from jaxrl_orch.trainer.params import Restoring
from jaxrl_orch.trainer.trainer import RowLayout, Trainer
from sharding.mesh import make_meshes

OPTIM = optim_lib.OptimConfig(learning_rate=1e-3, eps=1e-4)
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
    trainer = Trainer(TINY, mesh, rows=RowLayout(row_len=32), step=STEP, optim=OPTIM, seed=1)
    trainer.train_step(make_batch(1))
    path = tmp_path_factory.mktemp("ckpt")
    ckpt = Checkpointer(path, max_to_keep=2)
    assert save_trainer(ckpt, trainer, 1, ORCH)
    ckpt.wait()
    return trainer, ckpt, path


@pytest.mark.slow
def test_round_trip_onto_other_mesh_is_bit_equal_and_resume_continues(saved):
    src, ckpt, path = saved
    # A different mesh: 2 devices, pure tensor parallel, disjoint from the source's devices.
    devices = jax.devices()[4:6]
    _, mesh = make_meshes({"tp": 1}, {"fsdp": 1, "tp": 2}, devices=devices + jax.devices()[6:7])
    dst = Trainer(TINY, mesh, rows=RowLayout(row_len=32), step=STEP, optim=OPTIM, seed=99)
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


def _tiny_saved(path, steps=(1,)):
    """A checkpoint of a two-array tree per step (``w`` = arange + step - 1), no trainer."""
    ckpt = Checkpointer(path, async_save=False, max_to_keep=None)
    params = {"w": jnp.arange(8.0)}
    opt = {"mu": jnp.ones((8,)), "count": jnp.array(3)}
    for step in steps:
        ckpt.save(
            step,
            params={"w": params["w"] + step - 1},
            opt_state=opt,
            rng=jax.random.PRNGKey(0),
            meta={},
            orchestrator_state={"a": step},
        )
    ckpt.wait()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        ),
        {"params": params, "opt_state": opt},
    )
    return abstract


def test_small_tree_round_trip(tmp_path):
    abstract = _tiny_saved(tmp_path / "ok")
    out = Checkpointer(tmp_path / "ok").restore(abstract)
    np.testing.assert_array_equal(out["params"]["w"], np.arange(8.0))
    assert int(out["opt_state"]["count"]) == 3 and out["orchestrator"] == {"a": 1}
    assert out["meta"]["step"] == 1


def test_missing_checkpoint_names_the_path(tmp_path):
    abstract = _tiny_saved(tmp_path / "ok")
    empty = tmp_path / "nothing_here"
    with pytest.raises(CheckpointNotFoundError, match="nothing_here"):
        Checkpointer(empty).restore(abstract)
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 .*available steps: \[1\]"):
        Checkpointer(tmp_path / "ok").restore(abstract, step=7)


# orbax leaves its failed per-array read tasks unretrieved; that is its noise, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_checkpoint_names_the_path(tmp_path):
    bad = tmp_path / "bad"
    abstract = _tiny_saved(bad)
    # Truncate the array data files (the "d/" chunk stores); metadata stays intact.
    hit = 0
    for root, _, files in os.walk(bad / "1" / "state"):
        if os.path.basename(root) != "d":
            continue
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"\0garbage")
            hit += 1
    assert hit
    with pytest.raises(CheckpointError, match=str(bad)):
        Checkpointer(bad).restore(abstract)
    # A target of another structure (e.g. another model) is refused, naming the path too.
    other = {"params": {"w2": abstract["params"]["w"]}, "opt_state": abstract["opt_state"]}
    _tiny_saved(tmp_path / "ok")
    with pytest.raises(CheckpointError, match=str(tmp_path / "ok")):
        Checkpointer(tmp_path / "ok").restore(other)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_read_state_reads_the_json_item_alone(tmp_path):
    path = tmp_path / "ckpts"
    _tiny_saved(path, steps=(1, 2))
    _corrupt(path / "2")  # its arrays no longer restore; its JSON does, without them
    assert Checkpointer(path).read_state(2) == {"a": 2}
    (path / "1" / "orchestrator" / "metadata").unlink()
    with pytest.raises(CheckpointError, match=rf"step 1 at {path / '1'} could not be read"):
        Checkpointer(path).read_state(1)


def _corrupt(step_dir):
    """Overwrite the array chunk files of one step (metadata stays intact)."""
    hit = 0
    for root, _, files in os.walk(step_dir / "state"):
        if os.path.basename(root) == "d":
            for f in files:
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"\0garbage")
                hit += 1
    assert hit


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_intact_one(tmp_path):
    path = tmp_path / "ckpts"
    abstract = _tiny_saved(path, steps=(2, 4, 6))
    _corrupt(path / "6")
    _corrupt(path / "4")
    lines = []
    ckpt = Checkpointer(path)
    out = restore_newest_intact(ckpt, abstract, report=lines.append)
    assert out["meta"]["step"] == 2 and out["orchestrator"] == {"a": 2}
    np.testing.assert_array_equal(out["params"]["w"], np.arange(8.0) + 1)
    # One line per bad step, naming step, path and cause; each set aside, not deleted.
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith(f"!! checkpoint step 6 at {path / '6'} does not restore (")
    assert "moved to" in lines[0] and "step 4" in lines[1]
    assert ckpt.all_steps() == [2] and sorted(os.listdir(f"{path}.corrupt")) == ["4", "6"]
    # The resumed run can save those steps again.
    ckpt.save(
        4,
        params=out["params"],
        opt_state=out["opt_state"],
        rng=out["rng"],
        meta={},
        orchestrator_state={"a": 4},
    )
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_no_intact_checkpoint_says_what_to_delete(tmp_path):
    path = tmp_path / "ckpts"
    abstract = _tiny_saved(path, steps=(1,))
    _corrupt(path / "1")
    with pytest.raises(CheckpointError, match=rf"steps \[1\] all failed .*delete {path}"):
        restore_newest_intact(Checkpointer(path), abstract, report=lambda _: None)


def test_orchestrator_state_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="JSON-serialisable"):
        Checkpointer(tmp_path).save(
            2,
            params={},
            opt_state={},
            rng=np.zeros(2, np.uint32),
            meta={},
            orchestrator_state={"bad": object()},
        )


def test_busy_trainer_is_not_checkpointed(tmp_path):
    import types

    with pytest.raises(RuntimeError, match="busy; call trainer.wait_idle"):
        save_trainer(Checkpointer(tmp_path), types.SimpleNamespace(is_idle=False), 3, {})


def test_a_save_the_disk_cannot_hold_fails_before_writing_naming_the_path(tmp_path, monkeypatch):
    import errno
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    ckpt = Checkpointer(tmp_path / "full", async_save=False)
    with pytest.raises(OSError, match=r"checkpoint step 3 needs about 1\.\d MB, 0\.0 MB free") as e:
        ckpt.save(
            3,
            params={"w": jnp.zeros((1000,))},
            opt_state={},
            rng=jax.random.PRNGKey(0),
            meta={},
            orchestrator_state={},
        )
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "full")
    assert ckpt.all_steps() == [] and os.listdir(tmp_path / "full") == []


def test_a_trainer_built_to_be_restored_holds_no_arrays_until_its_restore(saved):
    _, _, path = saved
    _, mesh = make_meshes({"tp": 1}, {"fsdp": 2, "tp": 2})
    build = lambda init: Trainer(  # noqa: E731
        TINY, mesh, rows=RowLayout(row_len=32), step=STEP, optim=OPTIM, seed=1, init_params=init
    )
    restoring = build(Restoring())
    leaves = jax.tree.leaves((restoring.params, restoring.opt_state))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    with pytest.raises(RuntimeError, match="built to be restored"):
        restoring.train_step(make_batch(1))
    drawn = build(None)  # the usual way: fresh weights, then the restore replaces them
    for t in (restoring, drawn):
        assert restore_trainer(Checkpointer(path), t) == ORCH
    _leaves_equal(restoring.params, drawn.params)
    _leaves_equal(restoring.opt_state, drawn.opt_state)
    assert restoring.train_step(make_batch(2))["loss"] == drawn.train_step(make_batch(2))["loss"]
    # The reference policy of a KL penalty is the initial one: it cannot come from a restore.
    kl = dataclasses.replace(STEP, kind="rl", loss=dataclasses.replace(STEP.loss, kl_beta=0.1))
    with pytest.raises(ValueError, match="reference is the initial policy"):
        Trainer(TINY, mesh, rows=RowLayout(row_len=32), step=kl, init_params=Restoring())
