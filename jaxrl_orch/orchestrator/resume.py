"""What a checkpoint holds of the loop, and how a resume puts it back.

What it owns: the layout of the orchestrator's state (``loop_state``: the next step, the gate's
counters, the train sink's lifetime counters, the dispatcher's source cursors and ids; saved
with the trainer's step), the check that a saved state fits the restored trainer
(``check_resume_state``) and its mirror (``restore_loop``).

The resume rule: the saved loop may have shipped up to ``S + 1`` steps the trainer had not
trained yet (S = ``max_staleness``, the version hold's bound). Those batches are regenerated
(their prompts are not replayed), so a saved step outside ``[step, step + S + 1]`` of the
resuming loop means the checkpoint's parts disagree, and fails. The gate's saved counters are
not copied: ``build_orchestrator`` already recovered it by its rule (``gate.resume``), so the
first step after a resume admits at most ``(S + 1) * B``. Lifetime counters come back; batches
are numbered from the trainer's step.

Who uses it: ``loop.Orchestrator`` (``state()``, ``restore()``), before ``start()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl_orch.orchestrator.components import LoopComponents


def loop_state(step: int, parts: LoopComponents) -> dict[str, Any]:
    """Everything a resume needs from the orchestrator about to ship ``step``."""
    return {
        "step": step,
        "gate": parts.gate.state(),
        "train_sink": parts.train_sink.state(),
        "dispatcher": parts.dispatcher.state(),
    }


def check_resume_state(
    state: Mapping[str, Any], step: int, version: int, max_staleness: int
) -> None:
    """A saved orchestrator state fits a loop resuming at ``step`` (trainer at ``version``):
    the version hold let the saved loop ship at most ``max_staleness + 1`` steps the trainer
    had not trained."""
    missing = {"step", "gate", "train_sink", "dispatcher"} - set(state)
    if missing:
        raise ValueError(f"orchestrator state lacks {sorted(missing)}; got {sorted(state)}")
    saved = int(state["step"])
    lo = step
    hi = lo + max_staleness + 1
    if not lo <= saved <= hi or int(state["gate"]["version"]) > version:
        raise ValueError(
            f"orchestrator state is for step {saved} (gate version {state['gate']['version']})"
            f" but the restored trainer resumes at step {lo} (version {version}):"
            f" a matching state lies in steps {lo}..{hi}; the checkpoint's parts disagree"
        )


def restore_loop(
    state: Mapping[str, Any],
    parts: LoopComponents,
    *,
    step: int,
    version: int,
    max_staleness: int,
) -> None:
    """The mirror of ``loop_state`` on the parts of a loop resuming at ``step``."""
    check_resume_state(state, step, version, max_staleness)
    parts.train_sink.restore({**state["train_sink"], "step": step})
    parts.dispatcher.restore(state["dispatcher"])
