"""The run's history on disk after a crash: trimmed on resume, read back whole."""

from __future__ import annotations

import json

import pytest

from jaxrl_orch.run.history import (
    BeforeRLRecorder,
    read_rows,
    rl_evals,
    rl_step_rows,
    trim_for_rl,
    trim_for_sft,
)


def _write(path, rows, torn=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)


def _crashed_run(wd):
    """Warm-up steps 1..4, then RL steps 1..5 with evals at 0, 2, 4, killed mid-row."""
    sft = [{"step": i, "sft/loss": 1.0 / i} for i in range(1, 5)]
    rl = [{"step": 0, "eval/rev/reward_mean": 0.3}]
    for step in range(1, 6):
        rl.append({"step": step, "train/reward_mean": step / 10})
        if step % 2 == 0:
            rl.append({"step": step, "eval/rev/reward_mean": 0.3 + step / 10})
    _write(wd / "metrics.jsonl", sft + rl, torn='{"step": 6, "train/rew')
    _write(wd / "gauges.jsonl", [{"step": s, "gate/capacity": 1.0} for s in (0, 1, 3, 3, 5)])
    (wd / "rollouts").mkdir()
    for step in range(1, 6):
        (wd / "rollouts" / f"step_{step:08d}.jsonl").write_text("{}\n")


def test_rl_resume_trims_rows_past_the_restored_step_and_its_re_run_eval(tmp_path):
    _crashed_run(tmp_path)
    dropped = trim_for_rl(tmp_path, start_step=3, eval_at_start=True)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "sft/loss" in r] == [1, 2, 3, 4]  # the warm-up is kept
    assert [r["step"] for r in rl_step_rows(tmp_path)] == [1, 2]
    # step 2's eval is re-measured by the resumed run (eval_at_start), so it goes too
    assert sorted(rl_evals(tmp_path)) == [0]
    assert [r["step"] for r in read_rows(tmp_path / "gauges.jsonl")] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
        "step_00000001.jsonl",
        "step_00000002.jsonl",
    ]
    assert dropped == {"metrics": 5, "gauges": 3, "rollout_files": 3}
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")  # the torn row is gone
    assert trim_for_rl(tmp_path, start_step=3, eval_at_start=True) == {
        "metrics": 0,
        "gauges": 0,
        "rollout_files": 0,
    }


def test_without_eval_at_start_the_restored_steps_eval_stays(tmp_path):
    _crashed_run(tmp_path)
    trim_for_rl(tmp_path, start_step=3, eval_at_start=False)
    assert sorted(rl_evals(tmp_path)) == [0, 2]


def test_sft_resume_trims_warm_up_rows_only(tmp_path):
    _crashed_run(tmp_path)
    assert trim_for_sft(tmp_path, done=2) == 2  # steps 3 and 4 (and the torn row)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "sft/loss" in r] == [1, 2]
    assert len(rl_step_rows(tmp_path)) == 5


def test_a_torn_line_inside_the_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not JSON"):
        read_rows(tmp_path / "metrics.jsonl")


def test_the_pre_rl_eval_is_recorded_as_soon_as_it_lands(tmp_path):
    path = tmp_path / "eval_before_rl.json"
    rec = BeforeRLRecorder(path, "rev", "rev@t1")
    rec.write(1, {"train/reward_mean": 0.5})
    rec.write(0, {"trainer/loss": 1.0})
    assert not path.exists()
    rec.write(0, {"eval/rev/reward_mean": 0.4, "eval/rev/behaviour/full": 0.25})
    assert json.loads(path.read_text()) == {
        "reward": 0.4,
        "sampled": None,
        "behaviour": {"greedy": {"full": 0.25}},
    }
    rec.write(0, {"eval/rev@t1/reward_mean": 0.3})
    assert json.loads(path.read_text())["sampled"] == 0.3
    rec.write(2, {"eval/rev/reward_mean": 0.9})  # later evals do not touch it
    assert json.loads(path.read_text())["reward"] == 0.4
