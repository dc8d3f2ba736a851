"""Settings of the orchestrator's loop, as data: importable from ``config/train.py`` without
climbing.

What it owns: ``OrchestratorConfig`` (the loop's own settings: step target, batch and group
sizes, the staleness bound S, concurrency, the observed-age policy, eval cadence, timeouts) and
``AGE_POLICIES``, each field's default, range and meaning declared on it
(``jaxrl_orch.settings``). ``TrainConfig.loop`` (``config/train.py``) composes it from the ``RL``
and ``Orchestrator`` sections users bind (``Orchestrator.max_staleness = 2``); the
``Orchestrator`` section's fields are these fields (``loop_setting``), so their meaning and
range are stated here only. The orchestrator gets only this, never the root config.

Invariants: a built ``OrchestratorConfig`` is valid and fully resolved (``max_concurrent`` is
an int: its default is derived here and nowhere else). S bounds both the admission gate and the
version hold (batch ``step`` ships once the trainer has published ``step - 1 - S``).

Pure dataclasses: no JAX, no asyncio.
"""

from __future__ import annotations

import dataclasses

from jaxrl_orch.settings import Allowed, check_settings, require, setting

AGE_POLICIES = ("admit", "drop", "pace")
# A stop's bound after its drain: the train step in flight and the checkpoint write. The
# 8B-LoRA v5e-8 state (adapters and their Adam moments, ~0.5 GB) is written in well under this
# (docs/faults.md, "The notice is enough"). A GKE pod's grace period and the run's own report
# of a stop both read it.
SAVE_AFTER_DRAIN_S = 15.0
_SECONDS_OR_OFF = Allowed.above(0).or_none()


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """The loop's settings (``orchestrator/shipping.py`` and ``drain.py`` document the bounds)."""

    max_steps: int = setting(meaning="RL steps to train", allowed=Allowed.at_least(1))
    batch_size: int = setting(
        meaning="rollouts per training batch (B)", allowed=Allowed.at_least(1)
    )
    group_size: int = setting(meaning="rollouts per prompt", allowed=Allowed.at_least(1))
    max_staleness: int = setting(
        1,
        "S: trained rollouts are at most S versions old (the admission gate's bound and the "
        "version hold's); 0: a synchronous run, the baseline for telling an algorithm bug from "
        "an asynchrony bug",
        Allowed.at_least(0),
    )
    max_concurrent: int | None = setting(
        None,
        "train rollouts in flight (dispatcher permits and gate); None: (S + 1) * batch, the most "
        "the gate can ever admit ahead of the trainer, so concurrency never binds before "
        "staleness",
        Allowed.at_least(1).or_none(),
    )
    age_policy: str = setting(
        "admit",
        "what a rollout older than S at ship time gets: 'admit' (trained, the overshoot "
        "reported), 'drop' (discarded and counted) or 'pace' (the trainer waits until it lands "
        "in time)",
        Allowed.one_of(*AGE_POLICIES),
    )
    empty_batch_limit: int = setting(
        10, "consecutive batches with nothing trainable before the run fails", Allowed.at_least(1)
    )
    eval_every: int | None = setting(
        None,
        "steps between two evals (None or 0: first and last only)",
        Allowed.at_least(0).or_none(),
    )
    eval_at_start: bool = setting(True, "evaluate the starting policy before the first step")
    stall_timeout_s: float | None = setting(
        600.0,
        "nothing landed, shipped or trained for this long: the run fails naming what the "
        "pipeline waits on; None: never",
        _SECONDS_OR_OFF,
    )
    env_timeout_s: float | None = setting(
        600.0,
        "one rollout (generation + environment) longer is cancelled (an error rollout); None: "
        "never",
        _SECONDS_OR_OFF,
    )
    drain_timeout_s: float = setting(
        15.0,
        "after SIGTERM: in-flight work still running past it is cancelled (sent again after the "
        "restart; the rollout journal keeps what finished); 15 s leaves a 30 s preemption notice "
        "room for the step in flight and the checkpoint",
        Allowed.above(0),
    )
    loop_block_warn_s: float | None = setting(
        2.0,
        "the event loop blocked longer is reported, naming the frame; None: off",
        _SECONDS_OR_OFF,
    )
    request_seed: int | None = setting(
        None,
        "every rollout samples with a seed of its own derived from this; None: the engine's RNG",
    )
    keep_pending: bool = setting(
        True,
        "every finished train rollout goes to <workdir>/rollouts/journal as it lands; a restart "
        "trains those not yet trained and sends the unfinished prompts again; False: a restart "
        "loses them (regenerates from the data cursor)",
    )
    recover_gate_on_resume: bool = setting(
        True, "recover the gate's counters on resume (False only shows the resume-burst alarm)"
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.max_concurrent is None:
            # Frozen: the one place the default is resolved writes it through object.
            object.__setattr__(self, "max_concurrent", (self.max_staleness + 1) * self.batch_size)
        require(
            self.batch_size % self.group_size == 0,
            f"batch_size ({self.batch_size}) must be a multiple of group_size "
            f"({self.group_size}): a batch holds whole groups",
        )
        require(
            self.max_concurrent >= self.group_size,
            f"max_concurrent ({self.max_concurrent}) must be >= group_size "
            f"({self.group_size}) so a whole group can be in flight",
        )


def loop_setting(name: str) -> dataclasses.Field:
    """A field of a config section that is ``OrchestratorConfig.<name>``: the same default,
    meaning and range (declared once, above)."""
    (field,) = [f for f in dataclasses.fields(OrchestratorConfig) if f.name == name]
    return dataclasses.field(default=field.default, metadata=field.metadata)
