"""Settings of the orchestrator's loop, as data: importable from ``config/train.py`` without
climbing.

What it owns: ``OrchestratorConfig`` (the loop's own settings: step target, batch and group
sizes, the staleness bound S, concurrency, the observed-age policy, eval cadence, timeouts) and
``AGE_POLICIES``, with their validation and defaults. ``TrainConfig.loop`` (``config/train.py``)
composes it from the ``RL`` and ``Orchestrator`` sections users bind (``Orchestrator.max_staleness
= 2``); the orchestrator gets only this, never the root config.

Invariants: a built ``OrchestratorConfig`` is valid and fully resolved (``max_concurrent`` is
an int: its default is derived here and nowhere else). S bounds both the admission gate and the
version hold (batch ``step`` ships once the trainer has published ``step - 1 - S``).

Pure dataclasses: no JAX, no asyncio, no imports of the package beyond the standard library.
"""

from __future__ import annotations

import dataclasses

AGE_POLICIES = ("admit", "drop", "pace")


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """The loop's settings (``orchestrator/shipping.py`` and ``drain.py`` document the bounds)."""

    max_steps: int
    batch_size: int  # rollouts per training batch (B)
    group_size: int
    max_staleness: int = 1  # S: the admission gate's bound and the version hold's, in versions
    # In-flight train rollouts (dispatcher permits and gate). None: (S + 1) * B, the most the
    # gate can ever admit ahead of the trainer, so concurrency never binds before staleness.
    max_concurrent: int | None = None
    age_policy: str = "admit"
    empty_batch_limit: int = 10
    eval_every: int | None = None
    eval_at_start: bool = True
    # No progress (no rollout landed, no step shipped or trained) for this long raises
    # PipelineStallError naming what the pipeline waits on; None disables (the simulator).
    stall_timeout_s: float | None = 600.0
    env_timeout_s: float | None = 600.0  # a rollout running longer is cancelled (an error)
    drain_timeout_s: float = 60.0  # after SIGTERM: in-flight work past it is cancelled
    loop_block_warn_s: float | None = 2.0  # event-loop stalls longer are reported by name
    # every rollout samples with a seed of its own derived from this (None: the engine's RNG)
    request_seed: int | None = None
    recover_gate_on_resume: bool = True  # False only to demonstrate the resume-burst alarm

    def __post_init__(self) -> None:
        if self.age_policy not in AGE_POLICIES:
            raise ValueError(f"age_policy must be one of {AGE_POLICIES}, got {self.age_policy!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness!r}")
        for name in ("max_steps", "batch_size", "group_size"):
            _check_positive_int(name, getattr(self, name))
        if self.max_concurrent is None:
            # Frozen: the one place the default is resolved writes it through object.
            object.__setattr__(self, "max_concurrent", (self.max_staleness + 1) * self.batch_size)
        _check_positive_int("max_concurrent", self.max_concurrent)
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size "
                f"({self.group_size}): a batch holds whole groups"
            )
        if self.max_concurrent < self.group_size:
            raise ValueError(
                f"max_concurrent ({self.max_concurrent}) must be >= group_size "
                f"({self.group_size}) so a whole group can be in flight"
            )
        for name in ("stall_timeout_s", "env_timeout_s", "loop_block_warn_s", "drain_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 seconds (or None to disable), got {v!r}")


def _check_positive_int(name: str, v: object) -> None:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
