"""Steady-state RL step time, synchronous (max_staleness 0) vs asynchronous (max_staleness 1).

Runs the real ``python -m jaxrl_orch.train`` machinery (engine, trainer, orchestrator) twice in
one process on the same scenario: the ~3M-parameter ``small-byte`` model, 8 prompts x 4 samples
per step, up to 128 new tokens, beta = 0, no SFT (random weights: rewards are flat, so dynamic
sampling is off and every batch still trains). The step time is the median of ``orch/step_s``
after the first ``--warmup`` steps (compilation); the breakdown is the per-step median of the
generate / train / transfer / idle seconds the run records. Also reported per setting: the
generated (model) tokens per step and per second of step time (median over the same steps, from
the stored rollouts), and ``compiles_after_warmup``: XLA backend compilations that started after
the warm-up steps (JAX's ``/jax/core/compile/backend_compile_duration`` events). A steady state
with fixed shapes compiles nothing: a non-zero count is a step paying for a recompile.

The asynchronous run's schedule is ``Engine.overlap = "auto"``: on shared cores it probes
overlapped vs time-sliced steps first (``jaxrl_orch/compose/overlap.py``) and keeps the faster; its
steps are timed after that probe (``overlap`` in the result: the choice and both medians).
``--devices 1,2`` runs the whole measurement once per device count, each in its own process
(``XLA_FLAGS`` fake CPU devices; with 2, the trainer and the engine get one each).

``--profile DIR`` traces the asynchronous run's measured steps with the JAX profiler (the trace
under DIR opens in TensorBoard's profile plugin or Perfetto) and prints where that time went
(``benchmarks/profiling.py``: device compute, compile, transfers, waits, host Python).

    python benchmarks/rl_step.py --json [--devices 1,2] [--profile runs/profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

from jax import monitoring  # noqa: E402

from jaxrl_orch.compose.overlap import probe_steps  # noqa: E402
from jaxrl_orch.config.load import make_config  # noqa: E402
from jaxrl_orch.distributed.group import resolve_role  # noqa: E402
from jaxrl_orch.run import stages  # noqa: E402
from jaxrl_orch.run.stop import StopFlag  # noqa: E402

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[float] = []  # wall-clock end time of every backend compile in this process


def _on_event(name: str, secs: float, **_: object) -> None:
    if name == COMPILE_EVENT:
        _compiles.append(time.time())


monitoring.register_event_duration_secs_listener(_on_event)


def _step_rows(path: Path) -> dict[int, float]:
    """``{step: row time}`` of the step rows written so far."""
    if not path.exists():
        return {}
    rows = (json.loads(x) for x in path.read_text().splitlines() if x.strip())
    return {int(r["step"]): r["time"] for r in rows if "orch/step_s" in r}


def _profile_steps(workdir: Path, first: int, last: int, trace_dir: str, out: dict) -> None:
    """A thread: trace from step ``first``'s row to step ``last``'s (the measured steps)."""
    import jax

    metrics = workdir / "metrics.jsonl"
    while first not in _step_rows(metrics):
        time.sleep(0.05)
    jax.profiler.start_trace(trace_dir)
    t0 = time.time()
    while last not in _step_rows(metrics):
        time.sleep(0.05)
    jax.profiler.stop_trace()
    out["wall_s"] = time.time() - t0


def run_once(
    staleness: int, steps: int, warmup: int, workdir: Path, profile=None, overrides=None
) -> dict:
    """One run of the scenario (``overrides``: ``{"RL.steps": 3}``-style settings to change)
    -> its figures."""
    settings = {
        "Model.name": "small-byte",
        "Warmup.steps": 0,
        "RL.steps": steps,
        "RL.prompts_per_step": 8,
        "RL.group_size": 4,
        "RL.max_new_tokens": 128,
        "Loss.kl_beta": 0.0,
        "RL.dynamic_sampling": False,
        "RL.eval_every": 10**6,
        "RL.eval_examples": 1,
        "Engine.max_target_length": 256,
        "Engine.slots": 32,
        "Orchestrator.max_staleness": staleness,
        "Outputs.checkpoint_every": 10**6,
        "Trainer.row_len": 256,
    }
    cfg = make_config({**settings, **(overrides or {})})
    parts = stages.prepare(cfg, workdir, resolve_role(1, 0, None))
    traced: dict = {}
    tracer = threading.Thread(
        target=_profile_steps, args=(workdir, warmup, steps, profile, traced), daemon=True
    )
    if profile:
        tracer.start()
    summary = stages.run(parts, StopFlag(parts.role))
    if profile:
        tracer.join()  # the trace is written once stop_trace returns
    # A step's timeline is written as its own line after the step's line: merge by step.
    by_step: dict[int, dict] = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    rows = [r for s, r in sorted(by_step.items()) if "orch/step_s" in r and s > warmup]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    # Row times are written once a step is trained: compiles after the warm-up's last row.
    warm_end = max(r["time"] for s, r in by_step.items() if s <= warmup and "orch/step_s" in r)
    tokens = {}
    for r in rows:
        lines = (workdir / "rollouts" / f"step_{int(r['step']):08d}.jsonl").read_text().splitlines()
        tokens[r["step"]] = sum(sum(json.loads(x)["loss_mask"]) for x in lines)
    step_s = med("orch/step_s")
    if profile:
        from profiling import summarize, table

        print(table(summarize(profile), traced["wall_s"]), file=sys.__stderr__)
    return {
        "step_s": step_s,
        "generated_tokens_per_step": statistics.median(tokens.values()),
        "generated_tokens_per_s": statistics.median(
            tokens[r["step"]] / r["orch/step_s"] for r in rows
        ),
        # Up to the last measured step's row: the final eval, checkpoint and export come after.
        "compiles_after_warmup": sum(warm_end < t <= rows[-1]["time"] for t in _compiles),
        "breakdown": {k: med(f"time/{k}_s") for k in ("generate", "train", "transfer", "idle")},
        "overlap": summary.get("overlap"),
    }


def measure(a: argparse.Namespace) -> dict:
    """Sync and async in this process (its devices: ``XLA_FLAGS``)."""
    import jax

    # Async steps are timed after the overlap probe (overlap.py), which picks the schedule.
    async_warmup = max(a.warmup, probe_steps())
    # Per-step console lines go to stderr so stdout holds only the result.
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        sync = run_once(0, a.steps, a.warmup, Path(tmp) / "sync")
        async_ = run_once(
            1, async_warmup + a.steps - a.warmup, async_warmup, Path(tmp) / "async", a.profile
        )
    return {
        "devices": jax.device_count(),
        "sync_step_s": sync["step_s"],
        "async_step_s": async_["step_s"],
        "speedup": sync["step_s"] / async_["step_s"],
        **{
            f"{k}_{name}": run[k]
            for name, run in (("sync", sync), ("async", async_))
            for k in (
                "generated_tokens_per_step",
                "generated_tokens_per_s",
                "compiles_after_warmup",
            )
        },
        "overlap": async_["overlap"],
        "breakdown": {"sync": sync["breakdown"], "async": async_["breakdown"]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--devices", default=None, help="e.g. 1,2: one child process per count")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", default=None, help="trace the async run's measured steps here")
    a = p.parse_args()
    if a.devices is None:
        out = measure(a)
    else:
        out = {"by_devices": {}}
        for n in a.devices.split(","):
            env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
            cmd = [sys.executable, __file__, "--json", "--steps", str(a.steps)]
            cmd += ["--warmup", str(a.warmup)] + (["--profile", a.profile] if a.profile else [])
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
            out["by_devices"][n] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
