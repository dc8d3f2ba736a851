"""Faults a user meets, end to end: the train command with a faulty user environment
(``tests/support/fault_envs.py``), a signal during a drain that cannot finish, a second signal.

Each asserts what the run does and what it keeps: it finishes or stops cleanly, counts and
names each fault, and leaves a checkpoint the same command resumes from.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.checkout import helper_cmd
from support.train_cmd import checkpoints, rl_rows, train_cmd, train_env

pytestmark = pytest.mark.slow


def _cmd(workdir: Path, *params: str) -> list[str]:
    # ``python -m support.fault_envs``: registers the faulty environment, then trains.
    faulty = "Data.env = 'faulty_reverse_text'"
    return train_cmd(workdir, faulty, *params, program=tuple(helper_cmd("fault_envs")))


def _faulty_env(mode: str) -> dict[str, str]:
    return {**train_env(1), "JAXRL_TEST_FAULTS": mode}


def test_hanging_raising_nan_and_blocking_env_faults_are_counted_and_the_run_finishes(tmp_path):
    wd = tmp_path / "faulty"
    res = subprocess.run(
        _cmd(
            wd,
            "RL.steps = 4",
            "Orchestrator.env_timeout_s = 3.0",
            "Orchestrator.loop_block_warn_s = 0.5",
            # W&B as a user turns it on (offline: the run's files land in the workdir)
            "Outputs.wandb_project = 'jaxrl-faults'",
            "Outputs.wandb_mode = 'offline'",
        ),
        env=_faulty_env("mixed"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["rl_steps"] == 4
    kinds = summary["env_errors"]
    timeouts = [k for k in kinds if "EnvTimeout" in k and "env_timeout_s=#s" in k]
    crashes = [k for k in kinds if "RuntimeError: grader crashed on episode #" in k]
    nans = [k for k in kinds if ": NonFiniteReward: " in k]  # train and sampled-eval env
    assert timeouts and crashes and nans, kinds
    # The exception text reaches the console once per kind (and env), then in the digest...
    assert res.stderr.count("grader crashed on episode") == 2 * len(crashes)
    # ...and the record of every failed rollout.
    records = [json.loads(x) for x in (wd / "rollouts" / "errors.jsonl").read_text().splitlines()]
    recorded = sum("grader crashed" in r["errors"][0] for r in records)
    assert recorded == sum(kinds[k] for k in crashes)
    assert all(r["example"]["text"] for r in records)
    # NaN rewards have their own counter.
    rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    nan_counted = sum(v for r in rows for k, v in r.items() if k.endswith("nonfinite_rewards"))
    # every NaN of a counted window: those still unbatched at the end are in no row
    assert 0 < nan_counted <= sum(kinds[k] for k in nans)
    # The blocking call was named while it blocked: the env's function, file and line.
    assert "the event loop has not turned for 0.5s; it is running score (" in res.stderr
    assert "fault_envs.py:" in res.stderr
    runs = list((wd / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0  # the step and eval rows, offline
    gauges = [json.loads(x) for x in (wd / "gauges.jsonl").read_text().splitlines()]
    assert gauges[-1]["faults/loop_blocked_total"] >= 1
    assert gauges[-1]["dispatcher/env_timeouts_total"] >= sum(kinds[k] for k in timeouts) > 0


def _start_until_rl(wd: Path, *params: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        _cmd(wd, "RL.steps = 200", *params),
        env=_faulty_env("hang"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not ((wd / "metrics.jsonl").exists() and rl_rows(wd)):
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its first RL step: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    return proc


def test_a_run_whose_env_left_threads_hanging_exits_after_its_closing_line(tmp_path):
    wd = tmp_path / "threads"
    res = subprocess.run(
        _cmd(wd, "RL.steps = 2", "Orchestrator.env_timeout_s = 3.0", "RL.eval_every = 100"),
        env=_faulty_env("thread_hang"),
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: the assertion is that it exits, whenever
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((wd / "summary.json").read_text())["rl_steps"] == 2
    assert res.stdout.splitlines()[-1].startswith("outputs: ")  # the closing line came first
    assert "thread(s) still running after the run ended" in res.stderr
    assert "EnvTimeout" in res.stderr  # the hung rollouts were cut off as error rollouts


def test_sigterm_with_a_hung_env_exits_zero_once_the_drain_deadline_cancels_it(tmp_path):
    wd = tmp_path / "hung"
    # No env timeout: the hung rollouts never finish, so only the deadline ends the drain.
    proc = _start_until_rl(
        wd, "Orchestrator.env_timeout_s = 100000.0", "Orchestrator.drain_timeout_s = 3.0"
    )
    try:
        proc.send_signal(signal.SIGTERM)
        # Without the deadline this never returns: the timeout only keeps a hang from the suite.
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    # The deadline, not the hung rollouts, ended the drain: they were cancelled.
    assert "drain deadline (drain_timeout_s=3) passed: cancelled" in err
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["stopped_by_signal"] == signal.SIGTERM
    assert checkpoints(wd)[-1] == summary["rl_steps"] >= 1  # the last trained step is kept


def test_a_second_signal_exits_at_once_non_zero(tmp_path):
    wd = tmp_path / "twice"
    proc = _start_until_rl(
        wd, "Orchestrator.env_timeout_s = 100000.0", "Orchestrator.drain_timeout_s = 100000.0"
    )
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # draining: hung rollouts keep it from finishing
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM again: exiting now without the drain" in err
