"""A resume keeps what the workdir's run is (``run.identity``) and reads its history first:
another model, dataset or group size is refused before any checkpoint is read, naming each
difference (more steps are not); a damaged metrics line fails at start, naming the line."""

from __future__ import annotations

import json

import pytest

from jaxrl_orch import train
from jaxrl_orch.config.load import make_config
from jaxrl_orch.run.identity import FILE, check_resume, record_identity


def test_a_resume_may_continue_the_run_but_not_change_it(tmp_path):
    record_identity(tmp_path, make_config({"RL.steps": 10}))
    check_resume(tmp_path, make_config({"RL.steps": 40, "RL.learning_rate": 3e-5}))
    other = make_config({"Model.name": "small-byte", "RL.group_size": 8})
    with pytest.raises(ValueError) as exc:
        check_resume(tmp_path, other)
    message = str(exc.value)
    assert "model.name: the run has 'tiny-byte', this command 'small-byte'" in message
    assert "rl.group_size: the run has 16, this command 8" in message
    assert "rl.steps" not in message and "\n" not in message
    check_resume(tmp_path / "fresh", other)  # nothing recorded: nothing to keep


def test_the_train_command_refuses_another_model_and_leaves_the_checkpoints_intact(
    tmp_path, capsys
):
    record_identity(tmp_path, make_config({}))
    (tmp_path / "config.gin").write_text("# the first run's\n")
    step = tmp_path / "checkpoints" / "4"
    step.mkdir(parents=True)
    (step / "params").write_bytes(b"weights")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))

    rc = train.main([f"--workdir={tmp_path}", "--gin_param=Model.name = 'small-byte'"])

    err = capsys.readouterr().err
    assert rc == 2 and "model.name: the run has 'tiny-byte'" in err, err
    after = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert after == sorted([*before, "run.lock"])  # nothing moved aside, nothing written
    assert (step / "params").read_bytes() == b"weights"
    assert (tmp_path / "config.gin").read_text() == "# the first run's\n"
    assert json.loads((tmp_path / FILE).read_text())["model.name"] == "tiny-byte"


def test_a_damaged_metrics_line_fails_the_resume_at_start_naming_file_and_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n#garbage\n{"step": 2}\n')
    rc = train.main([f"--workdir={tmp_path}", "--gin_param=RL.steps = 1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{tmp_path / 'metrics.jsonl'} line 2 is not JSON" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "config.gin").exists()
