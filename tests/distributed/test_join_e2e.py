"""End-to-end: an engine replica joins a running run and another is drained, real processes.

``jaxrl-launch-local`` runs trainer process 0 and 2 replicas for 20 RL steps. At step 5 the
test starts a third replica by hand, as a user would (``python -m jaxrl_orch.train --join
URL --weight_source ... --api_key_file <the run's key>``), and a stranger asks to join with a
wrong key; at step 10 it sends SIGTERM to replica 0, which asks the run to drain it and exits
0. Every step's row is written once, every rollout reaches a sink once, the joiner serves
only once it holds the run's current version, and the console and ``summary.json`` say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.multiprocess import assert_each_rollout_once, env, params, rl_rows

from jaxrl_orch.distributed.admission import JOIN, JoinRefused, ask
from jaxrl_orch.distributed.launch_local import free_ports

pytestmark = pytest.mark.slow

STEPS = 20
RUN = [f"RL.steps = {STEPS}", "Orchestrator.max_staleness = 1", "Engine.warmup = False"]


def _child(launcher: subprocess.Popen, index: int) -> psutil.Process:
    found = [
        p
        for p in psutil.Process(launcher.pid).children(recursive=True)
        if p.cmdline()[-1:] == [f"--process_index={index}"]
    ]
    assert len(found) == 1, [p.cmdline() for p in found]
    return found[0]


def _wait(what, done, proc: subprocess.Popen, logs: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            said = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs.glob("*.log"))
            raise AssertionError(f"never happened: {what} (exit {proc.poll()})\n{said}")
        time.sleep(0.3)


def _has_step(workdir: Path, step: int) -> bool:
    return (workdir / "metrics.jsonl").exists() and step in rl_rows(workdir)


def _weight_source(out: Path) -> str:
    """Where the launcher put the run's weight server (its first line says)."""
    text = out.read_text() if out.exists() else ""
    return text.split("weights offered at ", 1)[1].split(";")[0] if "offered at " in text else ""


def test_a_replica_joins_at_step_5_another_drains_at_step_10_nothing_lost(tmp_path: Path):
    workdir, out = tmp_path / "run", tmp_path / "launcher.out"
    logs = workdir / "logs"
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "programs")}
    cache |= {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    run_env = env(None) | cache
    launch = [sys.executable, "-m", "jaxrl_orch.distributed.launch_local"]
    launch += ["--trainer_processes=1", "--engine_replicas=2", "--devices_per_process=2"]
    launch += [f"--workdir={workdir}", *params(*RUN)]
    t0 = time.monotonic()
    with out.open("w") as sink:
        proc = subprocess.Popen(
            launch, env=run_env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    joiner = None
    join_url = f"http://127.0.0.1:{free_ports(1)[0]}"
    try:
        _wait("step 5", lambda: _has_step(workdir, 5), proc, logs)
        source = _weight_source(out)
        joiner_log = (tmp_path / "joiner.log").open("w")
        cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={tmp_path / 'joiner'}"]
        cmd += params(*RUN, "Processes.trainer_processes = 1", "Processes.engine_replicas = 2")
        cmd += [f"--join={join_url}", f"--weight_source={source}"]
        cmd += [f"--api_key_file={logs / 'engine.key'}"]
        joiner_env = run_env | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        joiner = subprocess.Popen(cmd, env=joiner_env, stdout=joiner_log, stderr=subprocess.STDOUT)
        with pytest.raises(JoinRefused) as stranger:  # a wrong key: refused, the run goes on
            asyncio.run(ask(JOIN, source, "http://127.0.0.1:9", "not-the-key", 10))
        _wait("step 10", lambda: _has_step(workdir, 10), proc, logs)
        _child(proc, 1).send_signal(signal.SIGTERM)  # replica 0 asks to be drained
        code = proc.wait(timeout=600)
        wall_s = time.monotonic() - t0
        joiner.send_signal(signal.SIGTERM)  # the run is over: it stops without a drain
        joined_code = joiner.wait(timeout=60)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        if joiner is not None:
            joiner.kill()
        raise
    said = out.read_text()
    logs_text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs.glob("*.log"))
    joined_text = (tmp_path / "joiner.log").read_text()
    context = said[-4000:] + logs_text + "\n--- joiner\n" + joined_text[-3000:]
    assert code == 0 and joined_code == 0, context
    print(f"20-step run with a join and a drain: {wall_s:.0f} s")

    # Every step's row once; every rollout reached a sink once; none failed or was cut.
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/reward_mean" in r] == list(range(1, STEPS + 1))
    summary = json.loads((workdir / "summary.json").read_text())
    assert_each_rollout_once(workdir, summary["rollouts"], STEPS * 2 * 4)

    # The joiner: admitted after step 5, serving only once it held the version it joined at.
    replicas = summary["replicas"]
    assert (replicas["joined_total"], replicas["drained_total"]) == (1, 1), replicas
    assert replicas["join_refused_total"] == 1 and stranger.value.status == 401
    members = {m["url"]: m for m in replicas["members"]}
    joined = members[join_url]
    assert joined["replica"] == 2 and joined["joined_at_version"] >= 5, joined
    assert joined["served"] > 0, (joined, context)
    assert joined["first_served_version"] >= joined["joined_at_version"], joined
    v = joined["joined_at_version"]
    assert f"== engine replica 2 ({join_url}) joined at version {v}" in said, context
    first_load = int(joined_text.split("serving version ")[1].split()[0])
    assert first_load <= v, joined_text[-3000:]  # it loaded before it was admitted
    assert f"replica {join_url}: the run says: admitted as replica 2" in joined_text

    # Replica 0: drained on SIGTERM, exited 0, not restarted; it took no group after.
    drained = [m for m in replicas["members"] if m["replica"] == 0][0]
    assert drained["state"] == "left", drained
    assert "== engine replica 0 (" in said and ") drained at version " in said, context
    assert "launch_local: engine replica 0 drained and exited 0; not restarted" in said
    assert "drained: it may exit" in (logs / "process_1_engine.log").read_text()
    assert "!! engine replica join refused: http://127.0.0.1:9: 401: wrong API key" in said
