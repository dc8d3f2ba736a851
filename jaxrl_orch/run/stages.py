"""The stage sequence of ``python -m jaxrl_orch.train``, for one workdir.

Owns the workdir layout::

    config.gin          resolved gin config         metrics.jsonl   one row per RL step / eval
    run_identity.json   what a resume must keep     run.lock        the owning process
    sft/                SFT warm-up checkpoint      gauges.jsonl    periodic component gauges
    checkpoints/        RL checkpoints (orbax)      rollouts/       trained rollouts per step
    tb/                 TensorBoard events          summary.json, report.md, *.png
    export/             final policy as an HF checkpoint (config.json, safetensors, tokenizer)

The workdir is local or a ``gs://`` URL (``paths``). ``prepare`` builds and checks the run's
parts before any work (``compose.parts``); ``run`` takes the stages in order: the warm-up
(``warmup``), then RL (``rl``) or its imitation control (``control``); ``finish`` writes the
summary and the report. Each stage takes the parts and the ``StopFlag`` and returns values.
``finished`` is asked first: a workdir whose run is complete for this command is left as it
is (``run.finished``).

Several processes (``Role``; docs/design.md section 8): an engine replica only serves, over HTTP
(``compose.replica.serve_replica``); a trainer peer runs the same warm-up and then follows process
0's RL steps; process 0 runs every stage and writes the workdir, with the replicas as its engine.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxrl_orch.compose.engines import build_engine
from jaxrl_orch.compose.parts import RunParts, build_run
from jaxrl_orch.compose.trainers import rl_adapters
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.addresses import Replicas
from jaxrl_orch.distributed.group import Role
from jaxrl_orch.orchestrator.metrics.writers import JsonlWriter, stage
from jaxrl_orch.paths import Pathish
from jaxrl_orch.run.control import run_imitation
from jaxrl_orch.run.ending import run_coroutine
from jaxrl_orch.run.finished import finished_summary
from jaxrl_orch.run.history import check_history
from jaxrl_orch.run.identity import check_resume, record_identity
from jaxrl_orch.run.rl import run_rl
from jaxrl_orch.run.stop import StopFlag
from jaxrl_orch.run.warmup import rl_restores_every_weight, run_warmup
from jaxrl_orch.tools.report import write_report


def finished(cfg: TrainConfig, workdir: Any, role: Role) -> dict[str, Any] | None:
    """The summary of the workdir's run when this command would only repeat it
    (``run.finished``): a trainer process then leaves without building or writing anything.
    A command describing another run is refused first (``identity``)."""
    if role.kind == "engine":
        return None
    if role.leader:
        check_resume(workdir, cfg)
    return finished_summary(workdir, cfg)


def prepare(
    cfg: TrainConfig,
    workdir: Pathish,
    role: Role,
    engine_addresses: Replicas = Replicas(),
    started: float | None = None,
) -> RunParts:
    """The run's parts, every check done: fails before any work, naming the bad value.
    ``engine_addresses``: where a multi-process run's replicas are (``--engine_addresses``,
    ``--weight_source``, ``--api_key_file``); ``started``: when the command started
    (``time.monotonic()``; None: now). A resume that would change what the workdir's run is
    (its model, data or layout: ``identity``) is refused here, before any checkpoint is read."""
    if role.leader:
        check_resume(workdir, cfg)
        check_history(workdir)
    return build_run(cfg, workdir, role, engine_addresses, started)


def write_config(parts: RunParts, text: str) -> None:
    if not parts.role.leader:
        return
    parts.workdir.mkdir(parents=True, exist_ok=True)
    (parts.workdir / "config.gin").write_text(text)
    record_identity(parts.workdir, parts.cfg)


def run(parts: RunParts, stop: StopFlag) -> dict[str, Any]:
    """Every stage of this process's role, in order; returns the summary's keys, with what the
    run's compiles found in the compilation cache (``compile_cache``: its dir, hits, misses)."""
    summary = _stages(parts, stop)
    summary["compile_cache"] = parts.compile_cache.summary()
    return summary


def _stages(parts: RunParts, stop: StopFlag) -> dict[str, Any]:
    cfg = parts.cfg
    role = parts.role
    if role.kind == "engine":
        mesh = parts.placement.decode_mesh
        engine = build_engine(
            cfg, parts.model_cfg, mesh, parts.tokenizer, programs=parts.compile_cache.program
        ).engine
        adapters = rl_adapters(cfg, parts.model_cfg)
        # Imported by the role that serves: a trainer process does not load the HTTP stack.
        from jaxrl_orch.compose.replica import serve_replica

        return serve_replica(cfg, engine, role, parts.engine_addresses, adapters)
    parts.workdir.mkdir(parents=True, exist_ok=True)
    # A group's peers take the same warm-up steps (same data, same seed); process 0 writes.
    writer = JsonlWriter(parts.workdir / "metrics.jsonl" if role.leader else os.devnull)
    try:
        weights = not rl_restores_every_weight(parts)
        params, info = run_warmup(parts, writer, stop, weights=weights)
    finally:
        writer.close()
    summary: dict[str, Any] = {**info, "max_staleness": cfg.orchestrator.max_staleness}
    if params is None:
        return summary
    if cfg.rl.after_warmup == "sft":
        stage("imitation control", f"SFT for the {cfg.rl.steps} RL steps' updates instead")
        summary.update(run_imitation(parts, params, stop))
        return summary
    rl = cfg.rl
    orch = cfg.orchestrator
    stage(
        "RL",
        f"{rl.algorithm}, {rl.steps} steps of {rl.prompts_per_step} prompts x {rl.group_size} "
        f"samples, max_staleness {orch.max_staleness} ({orch.age_policy})",
    )
    summary.update(run_coroutine(run_rl(parts, params, stop)))
    return summary


def finish(parts: RunParts, summary: dict[str, Any]) -> None:
    if not parts.role.leader:
        return
    (parts.workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    write_report(parts.workdir)
