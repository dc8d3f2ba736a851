"""The trainers of the run's stages, built from the settings and the run's parts.

What it owns: ``build_trainer`` (a stage's ``Trainer``: the warm-up's SFT trainer, the RL
trainer, the imitation control's SFT trainer on the RL schedule), the settings it is built with
(``step_config``: the train step, its loss read as the ``RL`` section holds it; ``optim_config``:
each stage's optimizer schedule), and the RL trainer's model (``rl_model``: with ``Lora.rank`` its
adapters over the frozen weights; ``rl_adapters``: their abstract tree, what every engine replica
pulls each version).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxrl_orch.compose.staging import abstract_adapters
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.trainer.optim import OptimConfig
from jaxrl_orch.trainer.step import StepConfig
from jaxrl_orch.trainer.trainer import RowLayout, StepHooks, Trainer

if TYPE_CHECKING:
    from jaxrl_orch.compose.parts import RunParts


def build_trainer(
    parts: RunParts,
    kind: str,
    lr: float,
    *,
    recompute: bool = False,
    optim_kind: str | None = None,
    init_params: Any = None,
    hooks: StepHooks = StepHooks(),
) -> Trainer:
    """A trainer for a stage: ``kind`` picks the loss; ``optim_kind`` (default ``kind``) the
    optimizer schedule (the imitation control trains SFT on the RL schedule); ``recompute``
    whether the trainer recomputes the behaviour log-probs (an engine that reports none)."""
    cfg = parts.cfg
    # The warm-up takes one plain step per batch (minibatches and epochs are RL settings).
    rows = RowLayout(
        row_len=cfg.trainer.row_len,
        num_rows=cfg.trainer.rows_per_batch,
        # A row per sample at most: one shape all run long (no recompiles mid-run).
        min_rows=cfg.rl.batch_size if kind == "rl" else cfg.warmup.batch_size,
        pad_id=parts.tokenizer.pad_id,
    )
    return Trainer(
        rl_model(cfg, parts.model_cfg) if kind == "rl" else parts.model_cfg,
        parts.placement.trainer_mesh,
        rows=rows,
        step=step_config(cfg, kind, recompute=recompute),
        optim=optim_config(cfg, optim_kind or kind, lr),
        seed=cfg.seed,
        init_params=init_params,
        hooks=dataclasses.replace(hooks, programs=parts.compile_cache.program),
    )


def rl_model(cfg: TrainConfig, model_cfg: ModelConfig) -> ModelConfig:
    """The RL trainer's model: with ``Lora.rank`` its adapters over the frozen ``model_cfg``."""
    if not cfg.lora.rank:
        return model_cfg
    return dataclasses.replace(model_cfg, lora=cfg.lora)


def rl_adapters(cfg: TrainConfig, model_cfg: ModelConfig) -> Any:
    """A LoRA run's adapter tree as abstract arrays (what the RL trainer trains and every
    engine replica pulls each version), else None."""
    model = rl_model(cfg, model_cfg)
    return None if model.lora is None else abstract_adapters(model)


def step_config(cfg: TrainConfig, kind: str, recompute: bool | None = None) -> StepConfig:
    """The train step of a stage: its loss is ``RL.loss`` as the config holds it.
    ``recompute``: whether old log-probs are recomputed; default the setting, where unset
    (None) means no (the built-in engine reports behaviour log-probs)."""
    if recompute is None:
        recompute = bool(cfg.rl.recompute_old_logprobs)
    return StepConfig(
        kind=kind,
        chunk_rows=cfg.trainer.chunk_rows,
        minibatches=cfg.rl.minibatches if kind == "rl" else 1,
        ppo_epochs=cfg.rl.ppo_epochs if kind == "rl" else 1,
        recompute_old_logprobs=recompute,
        logprob_chunk=cfg.trainer.logprob_chunk,
        loss=cfg.rl.loss,
    )


def optim_config(cfg: TrainConfig, kind: str, lr: float) -> OptimConfig:
    """The optimizer schedule of a stage. RL: constant after ``RL.lr_warmup_steps`` (its length is
    open-ended: a resumed run continues the same schedule). SFT: the warm-up has a known length,
    so warm up for ``Warmup.lr_warmup_steps`` then anneal (cosine to 10% of the LR at
    ``Warmup.steps``): on the embedded default the annealed warm-up reaches a far higher greedy
    eval reward than a constant LR over the same steps (docs/results.md)."""
    if kind == "rl":
        return OptimConfig(learning_rate=lr, warmup_steps=cfg.rl.lr_warmup_steps)
    if cfg.warmup.steps > cfg.warmup.lr_warmup_steps:
        return OptimConfig(
            learning_rate=lr,
            schedule="warmup_cosine",
            warmup_steps=cfg.warmup.lr_warmup_steps,
            total_steps=cfg.warmup.steps,
            end_lr_ratio=0.1,
        )
    return OptimConfig(learning_rate=lr, warmup_steps=cfg.warmup.lr_warmup_steps)
