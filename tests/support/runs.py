"""The train command's stages, called in-process the way ``python -m jaxrl_orch.train`` does."""

from __future__ import annotations

from typing import Any

from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.distributed.group import resolve_role
from jaxrl_orch.orchestrator.metrics.writers import JsonlWriter
from jaxrl_orch.run import stages
from jaxrl_orch.run.stop import StopFlag
from jaxrl_orch.run.warmup import run_warmup


def prepare(cfg: Any, workdir: Any) -> RunParts:
    """A single-process run's parts, every check done (what the command builds first)."""
    return stages.prepare(cfg, workdir, resolve_role(1, 0, None))


def warmup(parts: RunParts, metrics: Any) -> tuple[Any, dict[str, float]]:
    """The warm-up stage alone, its rows written to ``metrics``."""
    writer = JsonlWriter(metrics)
    try:
        return run_warmup(parts, writer, StopFlag(parts.role))
    finally:
        writer.close()


def run(parts: RunParts) -> dict[str, Any]:
    """Every stage, as the command runs them (without the summary file and the report)."""
    return stages.run(parts, StopFlag(parts.role))
