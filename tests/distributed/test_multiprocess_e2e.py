"""End-to-end: multi-process runs (docs/design.md section 8), started by ``jaxrl-launch-local``.

A trainer group of 2 processes (``jax.distributed`` on 127.0.0.1, 2 fake CPU devices each)
and 2 engine replicas (own processes, HTTP, weights pulled with ``jax.experimental.transfer``)
run the tiny scenario; with ``max_staleness = 0`` its losses and rewards equal the
single-process run of the same config and seed (per-request sampling seeds make the samples
independent of which replica drew them). A replica killed with SIGKILL mid-run loses no
rollout: its groups move to the other replica and the launcher restarts it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.multiprocess import (
    assert_each_rollout_once,
    assert_same_run,
    env,
    params,
    rl_rows,
    single_run,
    wait_single,
)

pytestmark = pytest.mark.slow


def _launch(workdir: Path, *extra: str, replicas: int = 2, trainers: int = 2, **kw):
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_orch.distributed.launch_local",
        f"--trainer_processes={trainers}",
        f"--engine_replicas={replicas}",
        "--devices_per_process=2",
        f"--workdir={workdir}",
        *params(*extra),
    ]
    return subprocess.Popen(
        cmd, env=env(None), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
    )


def _finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"launch_local did not finish within {timeout} s:\n{out[-4000:]}")
    return out


def _kill_process(launcher: subprocess.Popen, index: int) -> None:
    """SIGKILL process ``index`` of this launch only: a machine-wide ``pgrep`` would also kill
    the process of that index of any other run on the machine."""
    found = [
        p
        for p in psutil.Process(launcher.pid).children(recursive=True)
        if p.cmdline()[-1:] == [f"--process_index={index}"]
    ]
    assert len(found) == 1, [p.cmdline() for p in found]
    found[0].send_signal(signal.SIGKILL)


def _logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (workdir / "logs").glob("*"))


def _single(workdir: Path, *extra: str) -> None:
    wait_single(single_run(workdir, *extra))


def test_group_of_two_with_two_replicas_matches_one_process(tmp_path: Path) -> None:
    steps = ["RL.steps = 5", "Orchestrator.max_staleness = 0"]
    single = tmp_path / "single"
    _single(single, *steps)

    multi = tmp_path / "multi"
    out = _finish(_launch(multi, *steps))
    assert "exited with" not in out, out[-4000:] + _logs(multi)
    assert_same_run(single, multi, 5, _logs(multi))
    sb = json.loads((multi / "summary.json").read_text())
    # The same outputs as the single-process command, plus one log per process.
    for name in ("summary.json", "report.md", "config.gin", "export/config.json"):
        assert (multi / name).exists(), name
    logs = sorted(p.name for p in (multi / "logs").iterdir())
    assert logs == [
        "engine.key",  # this launch's secret: the replicas answered only the run's own calls
        "process_0_trainer.log",
        "process_1_trainer.log",
        "process_2_engine.log",
        "process_3_engine.log",
    ]
    assert sb["replicas"]["live"] == 2 and sb["replicas"]["lost_total"] == 0
    # Every replica pulled every version, the last one included.
    for k in (2, 3):
        log = (multi / "logs" / f"process_{k}_engine.log").read_text()
        assert [f"serving version {v} " in log for v in range(6)] == [True] * 6


def test_a_lora_group_with_a_replica_matches_one_process_and_moves_only_adapters(tmp_path):
    lora = ["RL.steps = 4", "Orchestrator.max_staleness = 0", "Lora.rank = 2"]
    lora += ["RL.learning_rate = 1e-3"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    _single(single, *lora)
    out = _finish(_launch(multi, *lora, replicas=1))
    assert "exited with" not in out, out[-4000:] + _logs(multi)
    a, b = rl_rows(single), rl_rows(multi)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4], (sorted(a), sorted(b), _logs(multi))
    for step in a:
        for key in ("trainer/loss", "train/reward_mean", "trainer/grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)
    # Only the float32 adapters move per version, in one process and to a replica alike: for
    # rank 2 on every projection, over 20x fewer bytes than the weights the export holds.
    moved = {b[s]["transfer/bytes"] for s in b}
    assert moved == {a[s]["transfer/bytes"] for s in a} and len(moved) == 1
    assert 20 * moved.pop() < (multi / "export/model.safetensors").stat().st_size
    log = (multi / "logs" / "process_2_engine.log").read_text()
    assert log.count("holds the LoRA base") == 1, log[-3000:]
    assert [f"serving version {v} " in log for v in range(5)] == [True] * 5
    assert any(abs(a[s]["trainer/loss"]) > 1e-4 for s in a), "no learning signal: a vacuous test"
    sa = json.loads((single / "summary.json").read_text())
    sb = json.loads((multi / "summary.json").read_text())
    assert sb["eval_reward_final"] == pytest.approx(sa["eval_reward_final"], abs=1e-6)
    for name in ("export/config.json", "export/lora/adapter_config.json"):
        assert (multi / name).is_file(), name
    peft = [(wd / "export/lora/adapter_model.safetensors").read_bytes() for wd in (single, multi)]
    assert len(peft[0]) == len(peft[1])


def test_staleness_bound_holds_across_processes(tmp_path: Path) -> None:
    workdir = tmp_path / "s1"
    # Two replicas finish groups out of admission order: the "pace" age policy holds a batch
    # back until no rollout in it would be older than S (the default "admit" only bounds the
    # admissions, so its observed ages may overshoot; README, simulator table).
    bound = ["Orchestrator.max_staleness = 1", "Orchestrator.age_policy = 'pace'"]
    out = _finish(_launch(workdir, "RL.steps = 5", *bound))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["rl_steps"] == 5, out[-3000:] + _logs(workdir)
    ages = {int(k): v for k, v in summary["age_histogram"].items()}
    assert ages and max(ages) <= 1 and sum(ages.values()) == 5 * 2 * 4, ages
    assert summary["dropped"] == 0


STEPS = 40  # long enough (~40 s) for the killed replica to restart (~10-20 s) and rejoin


def test_replica_killed_mid_run_loses_no_rollout(tmp_path: Path) -> None:
    workdir = tmp_path / "kill"
    proc = _launch(
        workdir,
        f"RL.steps = {STEPS}",
        "Orchestrator.max_staleness = 1",
        # The restarted replica's first load would also compile every program (~20 s on 2
        # loaded cores) while versions move on; without it the rejoin lands within the run.
        "Engine.warmup = False",
        replicas=2,
        trainers=1,
        start_new_session=True,
    )
    metrics = workdir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and '"train/reward_mean"' in metrics.read_text():
                break
            time.sleep(0.5)
        time.sleep(random.uniform(0.0, 2.0))  # a random point of the run
        victim = random.choice([1, 2])
        _kill_process(proc, victim)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:] + _logs(workdir)
    assert f"engine replica {victim - 1} exited with -9; restarting it" in out
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS
    assert summary["replicas"]["lost_total"] >= 1
    assert summary["replicas"]["rejoined_total"] >= 1, out[-3000:]
    # Restarted, it loaded the current weights (not version 0) before it served again.
    log = (workdir / "logs" / f"process_{victim}_engine.log").read_text()
    restarted = log.split(f"[process {victim}] engine replica")[2]
    first = int(restarted.split("serving version ")[1].split()[0])
    assert first >= 1, restarted[:2000]
    # Every dispatched rollout reached a sink once, none failed for the lost replica, and its
    # requests were sent again, whole, to the other replica: nothing was cut short.
    assert_each_rollout_once(workdir, summary["rollouts"], STEPS * 2 * 4)


def _wait_for_step(workdir: Path, proc: subprocess.Popen, step: int, timeout: float = 600) -> None:
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and step in rl_rows(workdir):
            return
        time.sleep(0.3)
    raise AssertionError(f"step {step} never appeared (exit {proc.poll()})\n{_logs(workdir)}")


def test_lost_trainer_stops_the_run_sigterm_drains_and_the_same_command_resumes(tmp_path):
    workdir = tmp_path / "resume"
    run = ["RL.steps = 8", "Outputs.checkpoint_every = 2"]
    # 1. A trainer peer killed with SIGKILL: the launcher stops the whole run, loudly.
    proc = _launch(workdir, *run, replicas=1, start_new_session=True)
    try:
        _wait_for_step(workdir, proc, 3)
        _kill_process(proc, 1)
        out = _finish(proc, timeout=120)  # a hang guard: the launcher stops on the loss
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode != 0 and "trainer process 1 exited with -9" in out, out[-3000:]
    assert "resumes from the last checkpoint" in out
    # 2. The same command resumes; SIGTERM to the launcher drains every role and checkpoints.
    proc = _launch(workdir, *run, replicas=1, start_new_session=True)
    try:
        first = max(rl_rows(workdir)) + 1
        _wait_for_step(workdir, proc, first + 1)
        proc.send_signal(signal.SIGTERM)
        out = _finish(proc, timeout=240)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-3000:] + _logs(workdir)
    assert "== resume: at step" in out, out[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["stopped_by_signal"] == signal.SIGTERM
    stopped = summary["rl_steps"]
    assert stopped < 8
    # 3. And again, to the end: every step trained exactly once across the three attempts.
    out = _finish(_launch(workdir, *run, replicas=1))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["rl_steps"] == 8 and summary["resumed_from_step"] == stopped, out[-3000:]
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "train/reward_mean" in r]
    assert steps == list(range(1, 9)), steps


def _history(workdir: Path) -> dict[str, bytes]:
    names = ["metrics.jsonl", "gauges.jsonl", "summary.json", "config.gin", "run_identity.json"]
    files = [workdir / n for n in names] + sorted((workdir / "rollouts").glob("*.jsonl"))
    return {f.name: f.read_bytes() for f in files}


def test_a_second_launcher_on_a_running_run_is_refused_and_the_run_completes(tmp_path):
    workdir = tmp_path / "owned"
    run = ["RL.steps = 4"]
    proc = _launch(workdir, *run, replicas=1, trainers=1, start_new_session=True)
    logs = workdir / "logs"
    try:
        # Trainer process 0 has written its config: the run is under way (warm-up, compiles).
        deadline = time.monotonic() + 600
        while not (workdir / "run_identity.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, _logs(workdir)
            time.sleep(0.2)
        kept = {n: (workdir / n).read_bytes() for n in ("config.gin", "run_identity.json")}
        key = (logs / "engine.key").read_bytes()
        before = {p.name: p.read_bytes() for p in logs.iterdir()}
        # Another layout: its logs would have other names (process_1_trainer, process_3_engine).
        second = _launch(workdir, *run, replicas=2, trainers=2)
        out = _finish(second, timeout=120)
        assert second.returncode == 2, out[-3000:]
        assert f"workdir {workdir} is in use by another run: pid {proc.pid} on host" in out
        assert (logs / "engine.key").read_bytes() == key  # the first run's replicas keep it
        assert {n: (workdir / n).read_bytes() for n in kept} == kept
        assert sorted(p.name for p in logs.iterdir()) == sorted(before)
        for name, prefix in before.items():
            assert (logs / name).read_bytes().startswith(prefix), name  # nothing appended
        assert "in use by another run" not in "".join(p.read_text() for p in logs.glob("*.log"))
        out = _finish(proc)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0 and "exited with" not in out, out[-3000:] + _logs(workdir)
    assert sorted(rl_rows(workdir)) == [1, 2, 3, 4]
    # The same launch again on the finished run: nothing is run and no history file is written.
    history = _history(workdir)
    out = _finish(_launch(workdir, *run, replicas=1, trainers=1), timeout=300)
    assert f"== finished: workdir {workdir} holds a complete run of 4 RL steps" in out, out
    assert _history(workdir) == history
