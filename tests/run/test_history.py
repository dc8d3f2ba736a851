"""The run's history on disk after a crash: trimmed on resume, read back whole; a damaged line
refused at start in one line naming the file, the line and what is wrong."""

from __future__ import annotations

import json
import re

import pytest

from jaxrl_orch import train
from jaxrl_orch.run.history import (
    BeforeRLRecorder,
    check_history,
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


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (b'{"step": 2, "x": "\xff\xfe"}', "is not UTF-8 text (byte 0xff at column 19)"),
        (b"[2, 3]", 'is an array, not a row (a row is an object with an integer "step")'),
        (b'"row"', "is a string, not a row"),
        (b'{"train/reward_mean": 1.0}', 'has no "step" (a row is an object'),
        (b'{"step": "2"}', 'has "step": "2" (a row is an object'),
        (b'{"step": 2.5}', 'has "step": 2.5 (a row'),
        (b'{"step": null}', 'has "step": null (a row'),
    ],
)
@pytest.mark.parametrize("name", ["metrics.jsonl", "gauges.jsonl"])
def test_a_line_that_is_not_a_row_is_an_error_naming_file_line_and_what(tmp_path, name, line, what):
    (tmp_path / name).write_bytes(b'{"step": 1}\n' + line + b'\n{"step": 3.0}\n')
    with pytest.raises(ValueError) as exc:
        check_history(tmp_path)
    assert str(exc.value).startswith(f"{tmp_path / name} line 2 {what}")
    assert "\n" not in str(exc.value)
    # The last line, ended by its newline: written whole, so the same error, not a torn write.
    (tmp_path / name).write_bytes(b'{"step": 1}\n' + line + b"\n")
    with pytest.raises(ValueError, match=f"line 2 {re.escape(what)}"):
        check_history(tmp_path)


def test_a_last_line_cut_inside_a_character_is_a_torn_write(tmp_path):
    (tmp_path / "gauges.jsonl").write_bytes('{"step": 1}\n{"step": 2, "x": "\u00e9'.encode()[:-1])
    assert [r["step"] for r in read_rows(tmp_path / "gauges.jsonl")] == [1]


def test_the_train_command_refuses_damaged_history_in_one_line_before_any_work(tmp_path, capsys):
    (tmp_path / "gauges.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n')
    # A model that cannot load: were the line let through, the command would fail on it instead
    # of starting a run.
    bad_model = "--gin_param=Model.name = '/no/such/model_dir'"
    assert train.main([f"--workdir={tmp_path}", "--gin_param=RL.steps = 1", bad_model]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'gauges.jsonl'} line 2 is not UTF-8 text " + (
        "(byte 0xff at column 19); fix or delete the line\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gauges.jsonl", "run.lock"]


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
