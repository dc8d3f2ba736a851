"""The run's model: its tokenizer, its config and, for a checkpoint, its weights.

What it owns: ``build_model`` gives the run's tokenizer and model config (with the run's
precision, attention and remat: ``precision``); ``model_config`` resolves a preset or a local HF
checkpoint directory and limits the logits to the tokenizer's ids (engine and trainer share it);
``pretrained_params`` gives a lazy handle on the HF checkpoint it names (``HFCheckpoint``: read
later, straight onto whichever shardings take it: the trainer's, ``trainer.params``, or the
engine's, ``compose.engines.to_engine``); ``hf_checkpoint_dir`` tells a checkpoint from a preset
name (nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxrl_orch.compose.precision import accel_model_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.configs import ModelConfig, get_config
from jaxrl_orch.models.hf_import import config_from_hf
from jaxrl_orch.models.hf_sharded import HFCheckpoint
from jaxrl_orch.models.tokenizer import Tokenizer, load_tokenizer


def model_config(name: str, tokenizer: Tokenizer) -> ModelConfig:
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


def build_model(cfg: TrainConfig) -> tuple[Tokenizer, ModelConfig]:
    """The run's tokenizer and its model config (``Model`` section, with the run's precision,
    attention and remat)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    return tokenizer, accel_model_config(model_config(cfg.model.name, tokenizer), cfg)


def pretrained_params(name: str) -> HFCheckpoint | None:
    """A handle on the HF checkpoint ``name`` (``Model.name``) names, else None. Nothing is
    read here: the whole model never sits on one device or the host (an 8B model in bf16 is a
    16 GB chip's whole memory); each device reads its own shard where it is placed."""
    path = hf_checkpoint_dir(name)
    return None if path is None else HFCheckpoint(path)


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
