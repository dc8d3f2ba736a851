"""``python -m jaxrl_orch.train`` in a subprocess, as a user runs it, on a tiny scenario; and
readers of what it leaves in its workdir. Shared by the end-to-end tests of ``tests/run/``.

The subprocess's ``PYTHONPATH`` holds ``tests/`` (``checkout.subprocess_env``), so a setting may
name a helper module (``Engine.kind = 'support.upstream_engines:UpstreamShapedEngine'``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.checkout import subprocess_env, xla_flags

# A few SFT steps, a few RL steps, short completions: the plumbing, not the learning.
TINY = [
    "Warmup.steps = 2",
    "Warmup.batch_size = 8",
    "RL.prompts_per_step = 2",
    "RL.group_size = 4",
    "RL.eval_examples = 4",
    "RL.eval_every = 2",
    "Outputs.checkpoint_every = 2",
    "RL.max_new_tokens = 16",
    "Engine.slots = 8",
    # An untrained model scores 0 everywhere: keep flat groups so batches still form.
    "RL.dynamic_sampling = False",
]


def train_cmd(workdir: Path | str, *params: str, program: tuple[str, ...] = ()) -> list[str]:
    """The train command on ``TINY`` plus ``params``, ``workdir`` local or ``gs://``.
    ``program`` replaces ``python -m jaxrl_orch.train`` (e.g. a helper that registers an
    environment, then runs the command's ``main``)."""
    args = list(program or (sys.executable, "-m", "jaxrl_orch.train"))
    return [*args, f"--workdir={workdir}"] + [f"--gin_param={p}" for p in [*TINY, *params]]


def train_env(devices: int) -> dict[str, str]:
    """CPU only, ``devices`` fake devices, ``tests/`` importable."""
    return subprocess_env(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")


def run_train(workdir: Path, *params: str, devices: int = 1, timeout: float = 600):
    return subprocess.run(
        train_cmd(workdir, *params),
        env=train_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def all_rows(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def rl_rows(workdir: Path) -> list[dict]:
    return [r for r in all_rows(workdir) if "train/reward_mean" in r]


def checkpoints(workdir: Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []
