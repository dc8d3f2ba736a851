"""``gs://`` workdirs against a real local GCS emulator: the path layer, the checkpointer, the
rollout store and the resume trim on object storage, then a whole run written, resumed and
read back through it. A URL never becomes a local path."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.gcs_emulator import BUCKET
from support.train_cmd import train_cmd, train_env

from jaxrl_orch.orchestrator.store import RolloutStore
from jaxrl_orch.paths import JsonlAppender, as_path, copy_tree, is_url, write_atomic
from jaxrl_orch.run.history import read_rows, trim_for_rl
from jaxrl_orch.trainer.checkpoint import Checkpointer, restore_newest_intact
from jaxrl_orch.types import Rollout


def test_a_url_stays_a_url_and_bad_ones_are_named(tmp_path):
    p = as_path("gs://bucket/run") / "metrics.jsonl"
    assert os.fspath(p) == "gs://bucket/run/metrics.jsonl" and is_url(p)
    assert not is_url(tmp_path / "run") and os.fspath(as_path("runs/x")) == "runs/x"
    with pytest.raises(ValueError, match=r"unsupported URL 'ftp://host/run': use a local path"):
        as_path("ftp://host/run")
    with pytest.raises(ValueError, match=r"unsupported URL 's3://bucket/run': use a local path"):
        as_path("s3://bucket/run")  # once an ImportError 45 lines deep, minutes into a run


def test_files_appends_and_trees_round_trip_through_the_emulator(gcs, tmp_path):
    root = as_path(f"gs://{BUCKET}/paths")
    out = JsonlAppender(root / "rows.jsonl")
    out.append({"step": 1})
    out.append({"step": 2})
    out.close()
    again = JsonlAppender(root / "rows.jsonl")  # a resumed writer keeps what is there
    again.append({"step": 3})
    assert [r["step"] for r in read_rows(root / "rows.jsonl")] == [1, 2, 3]
    write_atomic(root / "a" / "b.txt", "hello")
    copy_tree(root / "a", root / "copy")
    assert (root / "copy" / "b.txt").read_text() == "hello"
    assert not (tmp_path / "gs:").exists() and not Path("gs:").exists()


def test_checkpoints_save_restore_and_set_aside_on_gcs(gcs):
    path = f"gs://{BUCKET}/ckpt"
    ckpt = Checkpointer(path, async_save=False, max_to_keep=None)
    assert ckpt.directory == path  # never made absolute into a local directory
    params = {"w": jnp.arange(8.0)}
    for step in (1, 2):
        ckpt.save(step, params={"w": params["w"] + step}, opt_state={}, rng=jax.random.PRNGKey(0),
                  meta={}, orchestrator_state={"s": step})  # fmt: skip
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"params": {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)},
                "opt_state": {}}  # fmt: skip
    out = restore_newest_intact(ckpt, abstract)
    np.testing.assert_array_equal(out["params"]["w"], np.arange(8.0) + 2)
    moved = ckpt.set_aside(2)
    assert moved == f"{path}.corrupt/2" and ckpt.all_steps() == [1]
    assert as_path(moved).is_dir()


def _rollout(step):
    return Rollout("e", step, 0, {}, token_ids=[1, 2], loss_mask=[False, True],
                   logprobs=[0.0, -0.5], versions=[-1, step], reward=1.0, num_turns=1)  # fmt: skip


def test_the_rollout_store_and_the_resume_trim_on_gcs(gcs):
    wd = as_path(f"gs://{BUCKET}/trim")
    store = RolloutStore(wd / "rollouts")
    for step in (1, 2, 3):
        store.write(step, [_rollout(step)])
    assert store.steps() == [1, 2, 3] and store.read(2)[0]["versions"] == [-1, 2]
    rows = JsonlAppender(wd / "metrics.jsonl")
    for step in (1, 2, 3):
        rows.append({"step": step, "train/reward_mean": 0.5})
    rows.close()
    dropped = trim_for_rl(wd, start_step=2, eval_at_start=False)
    assert dropped == {"metrics": 2, "gauges": 0, "rollout_files": 2}
    assert store.steps() == [1] and [r["step"] for r in read_rows(wd / "metrics.jsonl")] == [1]


@pytest.mark.slow
def test_a_run_writes_resumes_and_reads_back_through_gcs(gcs, tmp_path):
    url = f"gs://{BUCKET}/runs/demo"
    env = {**train_env(1), **gcs.env}

    def train(steps):
        cmd = train_cmd(url, f"RL.steps = {steps}")
        res = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return res

    train(2)
    res = train(4)  # the same command, more steps: resumes from the gs:// checkpoint
    wd = as_path(url)
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["rl_steps"] == 4
    rows = read_rows(wd / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3, 4]
    assert summary["eval_reward_before_rl"] is not None
    assert RolloutStore(wd / "rollouts").steps() == [1, 2, 3, 4]
    assert "RL steps: 4" in (wd / "report.md").read_text() and (wd / "reward.png").exists()
    config = json.loads((wd / "export" / "config.json").read_text())
    assert config["vocab_size"] > 0 and (wd / "export" / "model.safetensors").exists()
    assert 4 in Checkpointer(f"{url}/checkpoints").all_steps()
    assert any((wd / "tb").iterdir())  # TensorBoard events, written by tensorboardX's gs://
    assert url in res.stdout  # the closing line names the URL, not a local path
    assert not (tmp_path / "gs:").exists()  # nothing was written to a local "gs:" directory


def test_the_rollout_journal_on_gcs_writes_parts_at_each_sync_and_replays_them(gcs):
    from jaxrl_orch.orchestrator.journal import RolloutJournal

    path = as_path(f"gs://{BUCKET}/journal_run/rollouts/journal")
    journal = RolloutJournal(path)
    journal.replay()
    journal.begin(0, [])
    journal.opened("sim", 0, {"id": 1})
    r = _rollout(2)
    r.slot, r.num_turns = (0, 0), 1
    journal.landed([r])
    assert RolloutJournal(path).replay().done == {}  # objects cannot be appended: not yet
    journal.sync()  # a checkpoint: the lines since the last one become one object
    replay = RolloutJournal(path).replay()
    assert list(replay.opens) == [0] and replay.done[(0, 0)]["versions"] == [-1, 2]
    again = RolloutJournal(path)
    again.replay()
    again.begin(2, [replay.opens[0]])  # the next start: its own file, the old ones gone
    again.close()
    names = sorted(p.name for p in path.iterdir())
    assert names == ["epoch_000002.part0.jsonl"] and list(RolloutJournal(path).replay().opens) == [
        0
    ]
