"""Benchmark: the RL step of a multi-process run against the single-process run of one config.

What it measures
    The same scenario (tiny byte model, reverse-text, ``--prompts`` x ``--group`` rollouts a
    step, ``--new_tokens`` new tokens, S = ``--staleness``) run twice, one after the other:
    ``python -m jaxrl_orch.train`` in one process on ``P*D + R*D`` fake CPU devices (trainer
    mesh fsdp over P*D, decode tp over D), and
    ``python -m jaxrl_orch.distributed.launch_local`` with P
    trainer processes and R engine replicas of D devices each (HTTP requests, weights pulled
    with ``jax.experimental.transfer``). Per run: the median ``orch/step_s`` (wall time between
    two shipped batches) over the steps after ``--skip`` warm-up steps, the median weight
    transfer time per step, and the wall time of the whole command. The headline is
    ``step_ratio = multi / single``. On one machine the processes share its cores, so this
    shows what the process boundary costs (requests over HTTP, the group's batch broadcast, the
    stage and pull of every version), not the scale-out a multi-host slice gives.

How to run
    python benchmarks/multiprocess_step.py --json        # one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def scenario(args: argparse.Namespace) -> list[str]:
    params = [
        "Warmup.steps = 2",
        "Warmup.batch_size = 8",
        f"RL.steps = {args.steps}",
        f"RL.prompts_per_step = {args.prompts}",
        f"RL.group_size = {args.group}",
        f"RL.max_new_tokens = {args.new_tokens}",
        f"Orchestrator.max_staleness = {args.staleness}",
        "Engine.slots = 16",
        "RL.dynamic_sampling = False",
        "RL.eval_every = 0",
        "RL.eval_examples = 4",
        "Outputs.export_hf = False",
        f"Outputs.checkpoint_every = {args.steps}",
    ]
    return [f"--gin_param={p}" for p in params]


def steps(workdir: Path, skip: int) -> tuple[float, float]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "orch/step_s" in r and r["step"] > skip]
    if not rows:
        raise SystemExit(f"no RL steps past {skip} in {workdir}/metrics.jsonl")
    return (
        statistics.median(r["orch/step_s"] for r in rows),
        statistics.median(r.get("time/transfer_s", 0.0) for r in rows),
    )


def run(cmd: list[str], env: dict[str, str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        ).returncode
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited with {code}; see {log}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer_processes", type=int, default=2)
    p.add_argument("--engine_replicas", type=int, default=2)
    p.add_argument("--devices_per_process", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out (compiles)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    pp, r, d = args.trainer_processes, args.engine_replicas, args.devices_per_process
    base = dict(os.environ, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        single, multi = Path(tmp) / "single", Path(tmp) / "multi"
        meshes = [
            f"--gin_param=Trainer.mesh = (('fsdp', {pp * d}),)",
            f"--gin_param=Engine.mesh = (('tp', {d}),)",
            "--gin_param=Processes.colocated = False",
        ]
        env = dict(base, XLA_FLAGS=f"--xla_force_host_platform_device_count={pp * d + d}")
        cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={single}"]
        single_wall = run([*cmd, *scenario(args), *meshes], env, Path(tmp) / "single.log")
        cmd = [
            sys.executable,
            "-m",
            "jaxrl_orch.distributed.launch_local",
            f"--trainer_processes={pp}",
            f"--engine_replicas={r}",
            f"--devices_per_process={d}",
            f"--workdir={multi}",
        ]
        multi_wall = run([*cmd, *scenario(args)], base, Path(tmp) / "multi.log")
        (s_step, s_xfer), (m_step, m_xfer) = steps(single, args.skip), steps(multi, args.skip)
    out = {
        "layout": f"{pp} trainer processes + {r} replicas x {d} devices vs 1 process",
        "rollouts_per_step": args.prompts * args.group,
        "single_step_s": round(s_step, 3),
        "multi_step_s": round(m_step, 3),
        "step_ratio": round(m_step / s_step, 3),
        "single_transfer_s": round(s_xfer, 4),
        "multi_transfer_s": round(m_xfer, 4),
        "single_wall_s": round(single_wall, 1),
        "multi_wall_s": round(multi_wall, 1),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
