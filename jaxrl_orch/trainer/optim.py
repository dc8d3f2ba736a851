"""The optimizer of a train step: AdamW behind global-norm clipping, and its state's shardings.

``OptimConfig`` / ``make_schedule`` / ``make_optimizer`` (constant or warmup-cosine learning
rate; weight decay on matrices only) and ``opt_state_shardings`` (Adam's moments follow their
params). What the optimizer updates is the step's ``params``: every weight, or a LoRA run's
adapters (``trainer/programs.py`` decides), so a frozen base has no optimizer state at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

SCHEDULES = ("constant", "warmup_cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping. ``schedule``: ``"constant"`` (after an optional linear
    warmup) or ``"warmup_cosine"`` (warmup, then cosine decay to ``lr * end_lr_ratio`` at
    ``total_steps``)."""

    learning_rate: float = 1e-5
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.schedule == "warmup_cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}) for warmup_cosine"
            )
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm!r}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=cfg.learning_rate,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.total_steps,
            end_value=cfg.learning_rate * cfg.end_lr_ratio,
        )
    if cfg.warmup_steps:
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
                optax.constant_schedule(cfg.learning_rate),
            ],
            [cfg.warmup_steps],
        )
    return optax.constant_schedule(cfg.learning_rate)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    # Decay matrices only: norms and biases are scale/offset parameters, not capacity.
    def decay_mask(params: Any) -> Any:
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(
            make_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )


def opt_state_shardings(opt_state_shape: Any, params_shape: Any, param_shardings: Any, mesh):
    """Explicit shardings for an optax state: every sub-tree shaped like the params (Adam's
    moments) takes the params' shardings; every other leaf (counts) is replicated."""
    params_def = jax.tree.structure(params_shape)
    replicated = NamedSharding(mesh, PartitionSpec())

    def is_params_like(x: Any) -> bool:
        try:
            return jax.tree.structure(x) == params_def
        except Exception:  # noqa: BLE001 - non-pytree nodes simply are not params-like
            return False

    assign = lambda x: param_shardings if is_params_like(x) else replicated
    return jax.tree.map(assign, opt_state_shape, is_leaf=is_params_like)
