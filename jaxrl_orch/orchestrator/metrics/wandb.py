"""WandbWriter: step and eval rows to a Weights & Biases run (the optional ``wandb`` extra).

What it owns: one W&B run, opened by the constructor (``wandb.init``) and finished by
``close()``. ``write(step, metrics)`` logs one history row holding the metrics and the run's
own step under ``STEP_KEY``; every metric is plotted against that key (``define_metric``), not
against W&B's internal ``_step`` counter. So rows that repeat a step (an eval row after the
step row) or go back (a resumed run re-training steps past its checkpoint) are all recorded,
where ``log(..., step=)`` would drop every row below the highest step seen.

Off unless configured: nothing imports wandb until a ``WandbWriter`` is built, and a missing
package raises naming the extra to install. ``mode`` is W&B's (``"online"``, ``"offline"``:
written under ``directory`` for a later ``wandb sync``, ``"disabled"``); None leaves it to
W&B's own settings (``WANDB_MODE``, ``wandb offline``). Values go through ``clean_metrics``
like every writer's; non-finite ones are logged as they are (W&B records NaN and inf).

``close()`` finishes the run and shuts W&B's service process down (``wandb.teardown``), so the
run's files are complete when it returns; a later ``WandbWriter`` starts the service again.

A helper, not a component: it never reads a component and never affects training. W&B keeps
one run per process by default, so a run builds one ``WandbWriter`` and passes it to every
writer list that should reach W&B.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_orch.orchestrator.metrics.writers import clean_metrics

STEP_KEY = "step"
MODES = (None, "online", "offline", "disabled")
INSTALL_HINT = "pip install 'jaxrl-orch[wandb]' (or: pip install wandb)"


def import_wandb() -> Any:
    """The ``wandb`` module, or an ImportError naming the extra that provides it."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            f"the Weights & Biases writer needs the wandb package, which is not installed: "
            f"{INSTALL_HINT}; or leave W&B off (no wandb project configured)"
        ) from exc
    return wandb


class WandbWriter:
    """A ``types.MetricsWriter`` logging to one W&B run (see the module docstring)."""

    def __init__(
        self,
        project: str,
        *,
        run_name: str | None = None,
        directory: str | os.PathLike | None = None,
        config: Mapping[str, Any] | None = None,
        entity: str | None = None,
        mode: str | None = None,
        run_id: str | None = None,
        tags: Sequence[str] = (),
    ) -> None:
        if not isinstance(project, str) or not project.strip():
            raise ValueError(f"wandb project must be a non-empty string, got {project!r}")
        if mode not in MODES:
            raise ValueError(f"wandb mode must be one of {MODES}, got {mode!r}")
        wandb = import_wandb()
        if directory is not None:
            directory = os.fspath(directory)
            os.makedirs(directory, exist_ok=True)
        # A given run_id resumes that run (e.g. the same workdir restarted) instead of
        # starting a second one.
        self._run = wandb.init(
            project=project,
            name=run_name,
            dir=directory,
            config=dict(config) if config is not None else None,
            entity=entity,
            mode=mode,
            id=run_id,
            resume="allow" if run_id is not None else None,
            tags=list(tags) or None,
        )
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        self._wandb = wandb
        self.rows = 0
        self._closed = False

    @property
    def run_id(self) -> str:
        return self._run.id

    @property
    def run_dir(self) -> str:
        """Where W&B keeps this run's local files (the offline run, for ``wandb sync``)."""
        return self._run.dir

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed:
            raise RuntimeError(
                f"WandbWriter of run {self.run_id!r} is closed; write before close()"
            )
        row = clean_metrics(metrics)
        # Step rows carry their own step as a metric: the same value is the axis itself.
        if STEP_KEY in row and row.pop(STEP_KEY) != step:
            raise ValueError(
                f"metric key {STEP_KEY!r} ({metrics[STEP_KEY]!r}) is the W&B step axis of this "
                f"writer and differs from the row's step {step}; rename the metric"
            )
        self._run.log({STEP_KEY: int(step), **row})
        self.rows += 1

    def close(self) -> None:
        """Finish the run and wait until W&B has written all of it; idempotent."""
        if not self._closed:
            self._closed = True
            self._run.finish()
            # finish() can return before W&B's service process has flushed the run's log (an
            # offline run read right after it was empty in 2 of 6 tries); teardown waits for
            # that process, so the run is complete on disk (or sent) when close returns.
            self._wandb.teardown()
