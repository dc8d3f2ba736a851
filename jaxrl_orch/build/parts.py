"""Build helpers of the composition root: the model's config, the stage optimizers, the probes.

What it owns: pure functions from ``TrainConfig`` (and the tokenizer) to the settings the parts
are built with. ``build_model`` gives the run's tokenizer and model config; ``model_config``
resolves a preset or a local HF checkpoint directory and limits the logits to the tokenizer's
ids (engine and trainer share it); ``pretrained_params`` loads the weights of an HF checkpoint
it names; ``hf_checkpoint_dir`` tells a checkpoint from a preset name (nothing is downloaded);
``optim_config`` gives each stage its schedule; ``first_examples`` is the ``rl_prompt_pool``
probe's source; ``build_placement`` splits the devices into the decode and trainer meshes;
``build_data`` opens the run's sources.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flax import nnx

from jaxrl_orch.build.accel import accel_model_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.data.sources import DatasetSource, make_source, text_file_path
from jaxrl_orch.models.configs import ModelConfig, get_config
from jaxrl_orch.models.hf_import import config_from_hf, load_hf_checkpoint
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.trainer.optim import OptimConfig
from sharding.mesh import make_meshes


def model_config(name: str, tokenizer: Any) -> ModelConfig:
    """The named model, its logits limited to the ids ``tokenizer`` can produce (engine and
    trainer share this config, so both see the same masked distribution). A tokenizer with
    more ids than the model has rows is a mismatch and fails here, before any work."""
    ckpt = hf_checkpoint_dir(name)
    if ckpt is None:
        model_cfg = get_config(name)
    else:
        model_cfg = config_from_hf(json.loads((ckpt / "config.json").read_text()))
    n = tokenizer.output_vocab_size
    if n > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer produces {n} ids but model {name!r} has vocab_size "
            f"{model_cfg.vocab_size}; pick a model whose vocab covers the tokenizer"
        )
    return dataclasses.replace(model_cfg, output_vocab=n) if n < model_cfg.vocab_size else model_cfg


def build_model(cfg: TrainConfig) -> tuple[Any, ModelConfig]:
    """The run's tokenizer and its model config (``Model`` section, with the run's precision,
    attention and remat)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    return tokenizer, accel_model_config(model_config(cfg.model.name, tokenizer), cfg)


def pretrained_params(name: str, model_cfg: ModelConfig) -> Any:
    """The HF checkpoint's weights when ``name`` (``Model.name``) names one, else None."""
    path = hf_checkpoint_dir(name)
    if path is None:
        return None
    mc = model_cfg
    _, model = load_hf_checkpoint(path, dtype=mc.dtype, param_dtype=mc.param_dtype)
    return nnx.split(model)[1]


def hf_checkpoint_dir(name: str) -> Path | None:
    """The directory ``Model.name`` names when it is an HF checkpoint, else None (a
    preset name). A path that looks like a directory but holds no config.json is an error."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model {name!r} is a directory without config.json; name a preset or an HF "
                "checkpoint directory (config.json + model.safetensors)"
            )
        return path
    if "/" in name or name.startswith("."):
        raise ValueError(
            f"model directory {name!r} does not exist (nothing is downloaded: name a preset or "
            "a local HF checkpoint directory)"
        )
    return None


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


def first_examples(source: DatasetSource, n: int, seed: int) -> DatasetSource:
    """A source over the first ``n`` examples of ``source``'s data (the same every run)."""
    if n > len(source):
        raise ValueError(f"rl_prompt_pool {n} exceeds the {len(source)} training examples")
    return DatasetSource([source.example_at(i) for i in range(n)], seed=seed, name=f"first{n}")


def build_placement(cfg: TrainConfig, n_devices: int, devices: Any = None) -> tuple[bool, Any, Any]:
    """(colocated, decode mesh, trainer mesh): with one device (or ``colocated``) engine and
    trainer share every device; otherwise they split them (trainer fsdp, decode tp) unless the
    config names both meshes. An impossible shape fails here, naming it. ``devices``: default
    ``jax.devices()``; ``python -m jaxrl_orch.tools.aot`` passes a TPU topology's."""
    colocated = (n_devices == 1) if cfg.processes.colocated is None else cfg.processes.colocated
    half = n_devices if colocated else n_devices // 2
    trainer_shape = dict(cfg.trainer.mesh) or {"fsdp": half}
    decode_shape = dict(cfg.engine.mesh) or {"tp": n_devices if colocated else n_devices - half}
    decode_mesh, trainer_mesh = make_meshes(
        decode_shape, trainer_shape, devices=devices, colocated=colocated
    )
    return colocated, decode_mesh, trainer_mesh


@dataclasses.dataclass(frozen=True)
class DataSources:
    """The run's example streams: RL prompts, warm-up examples (their own order), and the
    held-out set twice (greedy eval and eval at the training temperature)."""

    train: Any
    sft: Any
    eval: Any
    sampled_eval: Any


def build_data(cfg: TrainConfig, env: Any = None) -> DataSources:
    """The sources of ``Data.dataset`` / ``eval_dataset``, or of an env that brings its own
    examples (``env.examples(split)``, a verifiers taskset). A text file is split in two
    unless a separate eval set is named: then all of it trains, an eval text file is held out
    whole (datasets use their own splits), and a line in both fails."""
    if hasattr(env, "examples"):
        return _env_data(cfg, env)
    train_split = "all" if cfg.data.eval_dataset and text_file_path(cfg.data.dataset) else "train"
    train = make_source(
        cfg.data.dataset, split=train_split, data_dir=cfg.data.data_dir, seed=cfg.seed
    )
    if cfg.data.rl_prompt_pool is not None:
        train = first_examples(train, cfg.data.rl_prompt_pool, cfg.seed)
    sft = make_source(
        cfg.data.dataset, split=train_split, data_dir=cfg.data.data_dir, seed=cfg.seed + 1
    )
    eval_name = cfg.data.eval_dataset or cfg.data.dataset
    eval_split = "all" if cfg.data.eval_dataset and text_file_path(eval_name) else "eval"
    held_out = [
        make_source(eval_name, split=eval_split, data_dir=cfg.data.data_dir, shuffle=False)
        for _ in range(2)
    ]
    if train_split == "all" and eval_split == "all":
        seen = {ex["text"] for ex in train.data}
        shared = [ex["text"] for ex in held_out[0].data if ex["text"] in seen]
        if shared:
            raise ValueError(
                f"{len(shared)} of {len(held_out[0])} lines of eval_dataset {eval_name!r} "
                f"also appear in dataset {cfg.data.dataset!r} (e.g. {shared[0]!r}); eval lines "
                "must be held out of training"
            )
    return DataSources(train, sft, *held_out)


def _env_data(cfg: TrainConfig, env: Any) -> DataSources:
    name = f"{env.name} tasks"
    train = DatasetSource(env.examples("train"), seed=cfg.seed, name=name)
    if cfg.data.rl_prompt_pool is not None:
        train = first_examples(train, cfg.data.rl_prompt_pool, cfg.seed)
    sft = DatasetSource(env.examples("train"), seed=cfg.seed + 1, name=name)
    held_out = [
        DatasetSource(env.examples("eval"), shuffle=False, name=f"{env.name} held-out tasks")
        for _ in range(2)
    ]
    return DataSources(train, sft, *held_out)
