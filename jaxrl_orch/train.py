"""``python -m jaxrl_orch.train``: SFT warm-up, then asynchronous RL, resumable, with a report.

    python -m jaxrl_orch.train --gin_file=configs/reverse_text.gin \\
        [--gin_param='TrainConfig.rl_steps=40'] [--workdir=runs/reverse_text]

What it owns: reading the gin config (every setting is a ``TrainConfig`` field; an unknown
binding, an impossible mesh or missing data fails before any work, naming the bad value),
building the pieces (meshes, tokenizer, environment, data sources, trainer, decoding engine,
weight publisher) and handing them to the orchestrator, the SFT stage (skipped when its
checkpoint exists), checkpoints (periodic, taken on the trainer's thread between two steps, and
a final one after the drain), SIGTERM/Ctrl-C (drain, checkpoint, exit 0), resume (restore the
trainer and the orchestrator's state, give the engine the restored weights before any
rollout), and the outputs: ``config.gin``, ``metrics.jsonl``, TensorBoard events,
``summary.json`` and the report (``jaxrl_orch.report``).

Placement: with one device the engine and trainer share it (colocated); with several, the
devices are split into a trainer mesh and a decode mesh (``sharding.mesh.make_meshes``), and
weights move by ``sharding.reshard.reshard`` inside the trainer's publish callback (the params
it receives are donated by the next step, so they are copied off before it returns).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import gin

from jaxrl_orch.config import TrainConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxrl_orch.train", description=__doc__)
    p.add_argument("--gin_file", action="append", default=[], help="gin config file(s)")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding(s)")
    p.add_argument("--workdir", default="runs/default", help="outputs and checkpoints")
    return p.parse_args(argv)


def load_config(gin_files: list[str], gin_params: list[str]) -> TrainConfig:
    """Parse gin and build the config; every error names the bad file/binding/value."""
    for f in gin_files:
        if not Path(f).is_file():
            raise ValueError(f"gin file {f!r} does not exist")
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params)
    except (ValueError, KeyError, SyntaxError) as exc:
        raise ValueError(f"bad gin config: {exc}") from exc
    return TrainConfig()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.gin_file, args.gin_param)
        from jaxrl_orch.run import Experiment  # heavy imports (jax) only after config checks

        exp = Experiment(cfg, Path(args.workdir))
        exp.validate()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    exp.write_config(gin.config_str())
    stop_requested = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        stop_requested["signal"] = signum
        exp.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    t0 = time.time()
    summary = exp.run()
    summary["wall_seconds"] = time.time() - t0
    summary["stopped_by_signal"] = stop_requested["signal"]
    exp.finish(summary)
    print(json.dumps({k: summary[k] for k in _HEADLINE if k in summary}))
    return 0


_HEADLINE = (
    "eval_reward_before_rl",
    "eval_reward_final",
    "rl_steps",
    "wall_seconds",
    "stopped_by_signal",
)


if __name__ == "__main__":
    raise SystemExit(main())
