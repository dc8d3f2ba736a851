"""A finished run is not run again: the same command on a complete workdir writes nothing.

What it owns: ``finished_summary(workdir, cfg)``, the workdir's ``summary.json`` when it records
a run this command would only repeat: every stage done (the summary is the run's last write,
after the final checkpoint, the final eval and the export), not stopped by a signal, and at
least ``RL.steps`` steps trained. Anything less (no summary, a torn one, a stopped run, more
steps asked for) gives None, and the command resumes as usual. ``finished_line`` is what the
command prints instead of running.

Why: run again, a finished run restored its last checkpoint, trimmed the final eval's rows,
evaluated the same version twice (the eval at start and the final one), appended a gauge row,
wrote new TensorBoard events and rewrote its summary and report: the final step was in every
history file twice.

Read by every trainer process (the workdir is shared) before any of them builds or writes
anything, so a group's processes leave together; it never writes.
"""

from __future__ import annotations

import json
from typing import Any

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.paths import Pathish, as_path


def finished_summary(workdir: Pathish, cfg: TrainConfig) -> dict[str, Any] | None:
    path = as_path(workdir) / "summary.json"
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except ValueError:  # cut short by a crash: the run did not finish writing it
        return None
    if not isinstance(summary, dict) or summary.get("stopped_by_signal") is not None:
        return None
    steps = summary.get("rl_steps")
    if isinstance(steps, bool) or not isinstance(steps, int | float) or steps < cfg.rl.steps:
        return None
    return summary


def finished_line(workdir: Pathish, summary: dict[str, Any]) -> str:
    return (
        f"== finished: workdir {workdir} holds a complete run of {summary['rl_steps']:g} RL "
        "steps (summary.json is its last write); nothing was run or written. Raise RL.steps to "
        "continue it, or give another --workdir for a new run"
    )
