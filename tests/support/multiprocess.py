"""The scenario the multi-process end-to-end tests run, and their yardstick: the same config and
seed in one process (``single_run``), whose losses a run of several processes must equal
(``assert_same_run``). Shared by ``tests/distributed/test_multiprocess_e2e.py`` (one machine)
and ``test_netns_e2e.py`` (hosts of their own).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.checkout import subprocess_env, xla_flags

SCENARIO = [
    "Warmup.steps = 2",
    "Warmup.batch_size = 8",
    "RL.prompts_per_step = 2",
    "RL.group_size = 4",
    "RL.eval_examples = 4",
    "RL.eval_every = 5",
    "Outputs.checkpoint_every = 3",
    "RL.max_new_tokens = 16",
    "Engine.slots = 8",
    "RL.dynamic_sampling = False",
    "Outputs.export_hf = True",
    # An untrained model scores (near) 0 on the real task: a user env with a dense reward
    # (tests/support/dense_env.py), plugged by name so every process imports it.
    "Data.env = 'support.dense_env:make'",
]
COMPARED = ("trainer/loss", "train/reward_mean", "trainer/entropy", "trainer/grad_norm")


def env(devices: int | None) -> dict[str, str]:
    """A run's environment: CPU, ``devices`` fake devices (None: left as they are), tests/
    importable (support.dense_env)."""
    found = subprocess_env(JAX_PLATFORMS="cpu")
    if devices:
        found["XLA_FLAGS"] = xla_flags(devices)
    return found


def params(*extra: str) -> list[str]:
    return [f"--gin_param={p}" for p in [*SCENARIO, *extra]]


def rl_rows(workdir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/reward_mean" in r}


def single_run(workdir: Path, *extra: str) -> subprocess.Popen:
    """The scenario in one process that splits its 6 devices like the runs of 2 trainer
    processes and replicas of 2 devices each: trainer fsdp over 4, decode tp over 2. Started,
    not waited for (``wait_single``): a test may run its own meanwhile."""
    mesh = ("Trainer.mesh = (('fsdp', 4),)", "Engine.mesh = (('tp', 2),)")
    cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={workdir}"]
    cmd += params(*extra, *mesh, "Processes.colocated = False")
    return subprocess.Popen(
        cmd, env=env(6), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_single(proc: subprocess.Popen, timeout: float = 900) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-6000:]


def assert_same_run(single: Path, multi: Path, steps: int, context: str = "") -> None:
    """``multi`` trained ``steps`` RL steps with the losses, rewards, entropies and gradient
    norms of ``single``, on the same tokens, with the same evals before and after."""
    a, b = rl_rows(single), rl_rows(multi)
    want = list(range(1, steps + 1))
    assert sorted(a) == sorted(b) == want, (sorted(a), sorted(b), context)
    for step in a:
        for key in COMPARED:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)
        assert b[step]["trainer/batch_tokens"] == a[step]["trainer/batch_tokens"], step
    sa = json.loads((single / "summary.json").read_text())
    sb = json.loads((multi / "summary.json").read_text())
    assert sb["eval_reward_final"] == pytest.approx(sa["eval_reward_final"], abs=1e-6)
    assert sb["eval_reward_before_rl"] == pytest.approx(sa["eval_reward_before_rl"], abs=1e-6)
    assert any(abs(a[s]["trainer/loss"]) > 1e-4 for s in a), "no learning signal: a vacuous test"


def assert_each_rollout_once(workdir: Path, counts: dict, expected: int) -> None:
    """Every dispatched rollout reached a sink once, none failed or was cut short (``counts``:
    ``summary.json["rollouts"]``), and the stored rollouts hold each (group, episode) once,
    ``expected`` in all."""
    assert counts["reached_sinks"] == counts["dispatched"] and counts["errors"] == 0, counts
    assert counts["untrainable"] == {"abort": 0, "cancelled": 0}, counts
    seen: set[tuple[int, int]] = set()
    for f in sorted((workdir / "rollouts").glob("step_*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = (r["group_id"], r["episode_id"])
            assert key not in seen, key
            seen.add(key)
    assert len(seen) == expected
