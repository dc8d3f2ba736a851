"""The train command on a verifiers taskset (``Data.env = 'verifiers'``), as a user runs it.

``jaxrl_vf_testkit`` (two model turns a rollout) on the tiny untrained model: the run trains
through verifiers, the taskset's named reward and metric reach ``metrics.jsonl`` and the report,
and verifiers' serving context (its ``Env.stop`` writes the marker file) is closed before the
process exits, whether a SIGTERM drained the run or the run failed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from support.train_cmd import all_rows, checkpoints, rl_rows, train_cmd, train_env

pytestmark = pytest.mark.slow

KIT = "{'taskset': {'id': 'jaxrl-vf-testkit', 'turns': 2, 'repeat': 20}}"
VERIFIERS = [
    "Data.env = 'verifiers'",
    f"Verifiers.env = {KIT}",
    "Warmup.steps = 0",
    "RL.max_new_tokens = 8",
]


def test_sigterm_drains_a_verifiers_run_and_closes_its_serving_context(tmp_path):
    wd, marker = tmp_path / "run", tmp_path / "serving_closed"
    env = {**train_env(1), "JAXRL_VF_STOP_MARKER": str(marker)}
    proc = subprocess.Popen(
        train_cmd(wd, *VERIFIERS, "RL.steps = 200"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not ((wd / "metrics.jsonl").exists() and rl_rows(wd)):
            if proc.poll() is not None:
                pytest.fail(f"the run ended before its first RL step: {proc.stderr.read()[-3000:]}")
            time.sleep(0.2)
        assert not marker.exists()  # serving is open while the run trains
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert marker.read_text() == "closed"
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["stopped_by_signal"] == signal.SIGTERM
    assert checkpoints(wd)[-1] == summary["rl_steps"] >= 1
    rows = all_rows(wd)
    train = [r for r in rows if "train/reward_mean" in r]
    assert all("train/reward/answer_length" in r for r in train)
    assert {r["train/metric/turns_played"] for r in train} == {2.0}  # both turns, every rollout
    evals = [r for r in rows if "eval/jaxrl-vf-testkit/reward_mean" in r]
    assert evals and "eval/jaxrl-vf-testkit/reward/answer_length" in evals[0]
    assert "eval/jaxrl-vf-testkit/metric/turns_played" in err + out  # the console shows it
    report = (wd / "report.md").read_text()
    assert "## Environment scores" in report and "| metric/turns_played | 2 |" in report


def test_a_crashing_verifiers_run_still_closes_its_serving_context(tmp_path):
    wd, marker = tmp_path / "run", tmp_path / "serving_closed"
    # Every harness exits 1: no group is trainable, and the loop's empty-batch guard ends the
    # RL stage with an error, the way any failure of the stage does.
    kit = "{'taskset': {'id': 'jaxrl-vf-testkit', 'modes': ['exit_1'], 'repeat': 20}}"
    res = subprocess.run(
        train_cmd(wd, *VERIFIERS, f"Verifiers.env = {kit}"),
        env={**train_env(1), "JAXRL_VF_STOP_MARKER": str(marker)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode != 0 and "EmptyBatchError" in res.stderr, res.stderr[-3000:]
    assert marker.read_text() == "closed"
