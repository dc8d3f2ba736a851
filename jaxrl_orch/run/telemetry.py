"""Where the RL stage's numbers go: ``rl_telemetry(parts, ...)`` builds its ``Telemetry``.

Step and eval rows: ``metrics.jsonl``, TensorBoard (``tb/steps``), the console, a progress bar,
the pre-RL eval record (``history.BeforeRLRecorder``) and, when ``Outputs.wandb_project``
is set, a Weights & Biases run (``orchestrator.metrics.wandb``; the ``wandb`` extra); W&B and
TensorBoard write on threads of their own (``metrics.offloop``), off the event loop. Gauges:
``gauges.jsonl`` and ``tb/``, pulled from the components plus the driver, the trainer and the
compilation cache (``compile_cache/hits``, ``compile_cache/misses``).
Rollouts and error records: ``rollouts/``. Every path is under the workdir, local or ``gs://``.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl_orch.compose.orchestrator import Telemetry
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.compose.sides import EngineSide
from jaxrl_orch.orchestrator.metrics.offloop import OffLoop
from jaxrl_orch.orchestrator.metrics.writers import (
    ConsoleWriter,
    JsonlWriter,
    ProgressWriter,
    TensorBoardWriter,
)
from jaxrl_orch.paths import is_url
from jaxrl_orch.run.history import BeforeRLRecorder
from jaxrl_orch.trainer.trainer import Trainer
from jaxrl_orch.types import MetricsWriter

CONSOLE_KEYS = (
    "train/reward_mean",
    "eval/*/reward_mean",
    "eval/*/behaviour/*",
    "eval/*/reward/*",
    "eval/*/metric/*",
    "trainer/loss",
    "trainer/entropy",
    "orch/age_max",
    "orch/step_s",
    "orch/admitted",
)


def rl_telemetry(parts: RunParts, side: EngineSide, trainer: Trainer, start_step: int) -> Telemetry:
    """``side``: the engine's side, whose gauges (its driver's, or its replicas') join the
    trainer's."""
    cfg = parts.cfg
    wd = parts.workdir
    writers: list[MetricsWriter] = [
        JsonlWriter(wd / "metrics.jsonl"),
        # Step and eval rows (rewards, evals, ages, trainer diagnostics) next to the gauges.
        OffLoop(lambda: TensorBoardWriter(wd / "tb" / "steps"), "tensorboard-steps"),
        ConsoleWriter(keys=CONSOLE_KEYS),
        ProgressWriter(
            cfg.rl.steps,
            initial=min(start_step - 1, cfg.rl.steps),
            postfix_keys=["train/reward_mean", "orch/age_max"],
        ),
        BeforeRLRecorder(wd / "eval_before_rl.json", parts.env.name, parts.sampled_eval),
    ]
    if cfg.outputs.wandb_project is not None:
        from jaxrl_orch.orchestrator.metrics.wandb import WandbWriter

        wandb = WandbWriter(
            cfg.outputs.wandb_project,
            run_name=cfg.outputs.wandb_run_name or wd.name,
            directory=None if is_url(wd) else os.fspath(wd),  # W&B writes local files
            config=dataclasses.asdict(cfg),
            mode=cfg.outputs.wandb_mode,
        )
        writers.append(OffLoop(wandb, "wandb"))
    return Telemetry(
        writers=writers,
        gauge_writers=[
            JsonlWriter(wd / "gauges.jsonl"),
            OffLoop(lambda: TensorBoardWriter(wd / "tb"), "tensorboard-gauges"),
        ],
        gauge_sources=[side, trainer, parts.compile_cache],
        log_interval_s=cfg.outputs.log_interval_s,
        store_dir=os.fspath(wd / "rollouts"),
    )
