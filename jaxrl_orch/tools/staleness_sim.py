"""The staleness study's ``--simulate``: each S's steps/s predicted before spending compute.

What it owns: the latency / train-time model of a prediction (``--sim_latency`` and
``--sim_train_time``, else calibrated from a finished run of the study, else the simulator's
defaults, the output naming which) and the predicted table. Each S runs
``jaxrl_orch.tools.simulate`` in process with what the real run would use: the config's batch,
group size and RL steps, (S + 1) x batch rollouts in flight, ``age_policy = admit``.

Calibration from a run's per-step rows (``metrics.jsonl``): the train time is the median
``time/train_s``; a rollout's latency is lognormal with the median of the steps'
``orch/in_flight_s_p50`` as its median and ``ln(p95 / p50) / 1.645`` (median over steps) as its
sigma (``fixed`` when that is ~0). The simulated engine serves every rollout in parallel, so its
latency does not grow with the rollouts in flight: the prediction is the orchestration's
(gate, hold, overlap), not the engine's contention.

JAX-free (the simulator is): deterministic for a seed.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from typing import Any

from jaxrl_orch.paths import as_path
from jaxrl_orch.tools import simulate
from jaxrl_orch.tools.report_data import num, read_metrics
from jaxrl_orch.tools.staleness_table import step_rows

_Z95 = 1.6448536269514722  # the standard normal's 95th percentile
_DEFAULT = simulate.Scenario()


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "--simulate: predict each S's steps/s (the real orchestrator, a simulated engine and "
        "trainer, a virtual clock) and run nothing"
    )
    g.add_argument("--simulate", action="store_true", help="print the predicted table and exit")
    g.add_argument(
        "--sim_latency",
        default=None,
        help="seconds per rollout: fixed:X | uniform:A:B | lognormal:MU:SIGMA (default: "
        f"calibrated from a finished run of the study, else {_DEFAULT.latency})",
    )
    g.add_argument(
        "--sim_train_time",
        type=float,
        default=None,
        help="seconds per train step (default: calibrated from a finished run of the study, "
        f"else {_DEFAULT.train_time:g})",
    )


def calibrate(rows: Sequence[dict]) -> tuple[str | None, float | None]:
    """``(latency spec, train seconds)`` from a run's step rows; None for what they lack."""
    pairs = []
    for r in rows:
        p50 = num(r.get("orch/in_flight_s_p50"))
        p95 = num(r.get("orch/in_flight_s_p95"))
        if p50 is not None and p95 is not None and p50 > 0 and p95 >= p50:
            pairs.append((p50, p95))
    latency = None
    if pairs:
        median = statistics.median(p for p, _ in pairs)
        sigma = statistics.median(math.log(q / p) / _Z95 for p, q in pairs)
        latency = (
            f"fixed:{median:.4g}"
            if sigma < 1e-3
            else f"lognormal:{math.log(median):.4g}:{sigma:.4g}"
        )
    train = [t for r in rows if (t := num(r.get("time/train_s"))) is not None and t > 0]
    return latency, (statistics.median(train) if train else None)


def _calibration(args: argparse.Namespace, runs: Sequence[Any]) -> tuple[str, float, str] | None:
    """``(latency, train time, the file)`` of the first finished run with usable rows."""
    root = as_path(args.workdir)
    for run in runs:
        wd = root / run.label
        if (wd / "summary.json").is_file() and (wd / "metrics.jsonl").is_file():
            latency, train = calibrate(step_rows(read_metrics(wd / "metrics.jsonl")))
            if latency is not None and train is not None:
                return latency, train, str(wd / "metrics.jsonl")
    return None


def model(args: argparse.Namespace, runs: Sequence[Any]) -> tuple[str, float, str]:
    """``(latency, train time, where each came from)``; flags win over a calibration."""
    found = None
    if args.sim_latency is None or args.sim_train_time is None:
        found = _calibration(args, runs)
    src = f"calibrated from {found[2]}" if found else "the simulator's default"
    latency = args.sim_latency
    lat_src = "--sim_latency"
    if latency is None:
        latency = found[0] if found else _DEFAULT.latency
        lat_src = src
    train = args.sim_train_time
    train_src = "--sim_train_time"
    if train is None:
        train = found[1] if found else _DEFAULT.train_time
        train_src = src
    if not train > 0:
        raise ValueError(f"--sim_train_time must be > 0 seconds, got {train}")
    simulate.parse_latency(latency)  # a bad spec fails naming the allowed forms
    where = f"latency {latency} ({lat_src}); train time {train:.4g} s per step ({train_src})"
    return latency, train, where


def predict(args: argparse.Namespace, cfg: Any, runs: Sequence[Any]) -> int:
    """Print the predicted table for every ``--staleness`` value; returns the exit status."""
    latency, train, where = model(args, runs)
    batch = cfg.rl.batch_size
    group = cfg.rl.group_size
    steps = cfg.rl.steps
    print(
        f"[staleness] simulated: batch {batch} ({group} per group), (S + 1) x batch in flight, "
        f"{steps} steps, age policy admit; {where}"
    )
    print("[staleness] the simulated engine's latency does not grow with the rollouts in flight")
    print("| S | predicted steps/s | predicted age max | predicted age p95 |")
    print("| --- | --- | --- | --- |")
    for s in args.staleness:
        sc = simulate.Scenario(
            max_staleness=s,
            batch_size=batch,
            group_size=group,
            max_concurrent=(s + 1) * batch,
            latency=latency,
            train_time=train,
            steps=steps,
            policy="admit",
        )
        res = simulate.simulate(sc)
        print(f"| {s} | {res['steps_per_second']:.3f} | {res['age_max']:g} | {res['age_p95']:g} |")
    return 0
