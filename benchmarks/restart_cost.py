"""Benchmark: what a restart of the main job costs, cold vs warm compilation cache, back to back.

What it measures: the main job (``configs/reverse_text.gin``, its warm-up cut to ``--sft``
steps so the preparation is short) is run to RL step ``--steps`` once (not timed), leaving a
checkpoint (flat groups kept: a 2-step warm-up scores 0 everywhere). Two copies of that
workdir are then resumed by the same command to one more step, back to back:
the first on an empty compilation cache (cold: every program compiles), the second on the
cache the first filled (warm). Each resume's own report (``summary.json["restart"]``) gives the
seconds from the command's start to its first rollout and to its first train step; the ratio
warm / cold is the figure (goal: at most 1/3). ``--pairs`` such cold/warm pairs are run, each on
a fresh cache, and the median of their ratios is reported beside each pair's: a first train
step waits for a batch of rollouts and shares 2 cores with the next batch's, so one pair's
ratio moves by several hundredths between runs.

How to run
    python benchmarks/restart_cost.py            # ~2.5 min on 2 CPU cores
    python benchmarks/restart_cost.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _train(workdir: Path, cache: Path, steps: int, sft: int) -> dict:
    params = [
        f"Warmup.steps = {sft}",
        f"RL.steps = {steps}",
        "Outputs.export_hf = False",
        # two SFT steps leave the policy scoring 0 everywhere: keep the flat groups
        "RL.dynamic_sampling = False",
        f"Processes.compile_cache = '{cache}'",
    ]
    cmd = [sys.executable, "-m", "jaxrl_orch.train", "--gin_file=configs/reverse_text.gin"]
    cmd += [f"--workdir={workdir}", *(f"--gin_param={p}" for p in params)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"train exited {res.returncode}: {res.stderr[-2000:]}")
    summary = json.loads((workdir / "summary.json").read_text())
    return {**summary["restart"], "compile_cache": summary["compile_cache"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="RL steps before the restart")
    ap.add_argument("--sft", type=int, default=2, help="warm-up steps of the preparation")
    ap.add_argument("--pairs", type=int, default=3, help="cold/warm pairs, each on a new cache")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        _train(t / "base", t / "prep_cache", args.steps, args.sft)
        for i in range(args.pairs):
            runs = {}
            for kind in ("cold", "warm"):
                shutil.copytree(t / "base", t / f"{kind}{i}")
                runs[kind] = _train(t / f"{kind}{i}", t / f"cache{i}", args.steps + 1, args.sft)
            pairs.append(_pair(runs["cold"], runs["warm"]))
    out = {
        "pairs": pairs,
        "first_rollout_ratio": statistics.median(p["first_rollout_ratio"] for p in pairs),
        "first_step_ratio": statistics.median(p["first_step_ratio"] for p in pairs),
    }
    if args.json:
        print(json.dumps(out))
        return
    for i, pair in enumerate(pairs):
        for kind in ("cold", "warm"):
            r, c = pair[kind], pair[kind]["compile_cache"]
            print(
                f"pair {i + 1} {kind}: first rollout {r['first_rollout_s']:.2f} s, first train "
                f"step {r['first_step_s']:.2f} s after the command started ({c['hits']} hits, "
                f"{c['misses']} misses)"
            )
        print(
            f"pair {i + 1} warm / cold: first rollout {pair['first_rollout_ratio']:.3f}x, "
            f"first train step {pair['first_step_ratio']:.3f}x"
        )
    print(
        f"median of {len(pairs)} pairs, warm / cold: first rollout "
        f"{out['first_rollout_ratio']:.3f}x, first train step {out['first_step_ratio']:.3f}x "
        "(goal: <= 0.333x)"
    )


def _pair(cold: dict, warm: dict) -> dict:
    return {
        "cold": cold,
        "warm": warm,
        "first_rollout_ratio": round(warm["first_rollout_s"] / cold["first_rollout_s"], 3),
        "first_step_ratio": round(warm["first_step_s"] / cold["first_step_s"], 3),
    }


if __name__ == "__main__":
    main()
