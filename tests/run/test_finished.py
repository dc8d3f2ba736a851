"""A finished run is not run again (``run.finished``): the same command on a workdir whose run
is complete leaves every file as it was and prints the closing lines; a stopped run, a torn
summary or more steps asked for resume as usual; a command describing another run is refused."""

from __future__ import annotations

import json

import pytest

from jaxrl_orch import train
from jaxrl_orch.config.load import make_config
from jaxrl_orch.run.finished import finished_summary
from jaxrl_orch.run.identity import record_identity

# Were the finished run let through, this warm-up source would fail the command (2) instead of
# starting a run; it is no part of what the run is (run.identity).
NO_WARMUP = "--gin_param=Warmup.from_workdir = '/no/such/run'"


def _finish(workdir, **summary) -> None:
    record_identity(workdir, make_config({"RL.steps": 3}))
    done = {"rl_steps": 3, "stopped_by_signal": None, "eval_reward_final": 0.5, **summary}
    (workdir / "summary.json").write_text(json.dumps(done))


def test_a_complete_run_is_finished_for_as_many_steps_or_fewer(tmp_path):
    three = make_config({"RL.steps": 3})
    assert finished_summary(tmp_path, three) is None  # no summary yet
    _finish(tmp_path)
    assert finished_summary(tmp_path, three)["eval_reward_final"] == 0.5
    assert finished_summary(tmp_path, make_config({"RL.steps": 2})) is not None
    assert finished_summary(tmp_path, make_config({"RL.steps": 4})) is None  # continue it


@pytest.mark.parametrize(
    "summary",
    [
        '{"rl_steps": 3, "stopped_by_signal": 15}',  # SIGTERM: drained, not finished
        '{"sft_steps": 2.0, "stopped_by_signal": null}',  # stopped in the warm-up
        '{"rl_steps": 3, "stopped_by',  # cut short by a crash
        "[3]",
    ],
)
def test_a_stopped_or_unreadable_run_is_not_finished(tmp_path, summary):
    (tmp_path / "summary.json").write_text(summary)
    assert finished_summary(tmp_path, make_config({"RL.steps": 3})) is None


def test_the_same_command_on_a_finished_run_writes_nothing(tmp_path, capsys):
    _finish(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "eval/x/reward_mean": 0.5}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert train.main([f"--workdir={tmp_path}", "--gin_param=RL.steps = 3", NO_WARMUP]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"== finished: workdir {tmp_path} holds a complete run of 3 RL")
    assert json.loads(out[1]) == {
        "eval_reward_final": 0.5,
        "rl_steps": 3,
        "stopped_by_signal": None,
    }
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after.pop("run.lock") and after == before  # only the owner record, as every claim


def test_a_command_describing_another_run_is_refused_even_when_it_finished(tmp_path, capsys):
    _finish(tmp_path)
    other = "--gin_param=RL.group_size = 8"
    assert train.main([f"--workdir={tmp_path}", "--gin_param=RL.steps = 3", other]) == 2
    assert "rl.group_size: the run has 16, this command 8" in capsys.readouterr().err
