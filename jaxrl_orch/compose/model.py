"""The run's model: its tokenizer, its config and, for a checkpoint, its weights.

What it owns: ``build_model`` gives the run's tokenizer and model config (with the run's
precision, attention and remat: ``precision``); ``model_config`` resolves a preset or an HF
checkpoint directory (local or ``gs://``, through ``paths.as_path``) and limits the logits to the
tokenizer's ids (engine and trainer share it); ``pretrained_params`` gives a lazy handle on the
HF checkpoint it names (``HFCheckpoint``: read later, straight onto whichever shardings take it:
the trainer's, ``trainer.params``, or the engine's, ``compose.engines.to_engine``);
``hf_checkpoint_dir`` tells a checkpoint from a preset name (nothing is downloaded);
``tokenizer_spec`` resolves ``Model.tokenizer``'s default (the checkpoint's own tokenizer);
``check_weights`` refuses a published model's preset without its checkpoint unless
``Model.random_init`` asks for random weights.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl_orch.compose.precision import accel_model_config
from jaxrl_orch.config.train import ModelSettings, TrainConfig
from jaxrl_orch.models.configs import PUBLISHED, ModelConfig, get_config
from jaxrl_orch.models.hf_import import config_from_hf, read_json
from jaxrl_orch.models.hf_sharded import HFCheckpoint
from jaxrl_orch.models.tokenizer import Tokenizer, load_tokenizer
from jaxrl_orch.paths import as_path, is_url


def model_config(name: str, tokenizer: Tokenizer) -> ModelConfig:
    """The named model, its logits limited to the ids ``tokenizer`` can produce (engine and
    trainer share this config, so both see the same masked distribution). A tokenizer with
    more ids than the model has rows is a mismatch and fails here, before any work."""
    ckpt = hf_checkpoint_dir(name)
    if ckpt is None:
        model_cfg = get_config(name)
    else:
        model_cfg = config_from_hf(read_json(as_path(ckpt) / "config.json"))
    n = tokenizer.output_vocab_size
    if n > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer produces {n} ids but model {name!r} has vocab_size "
            f"{model_cfg.vocab_size}; pick a model whose vocab covers the tokenizer"
        )
    return dataclasses.replace(model_cfg, output_vocab=n) if n < model_cfg.vocab_size else model_cfg


def build_model(cfg: TrainConfig) -> tuple[Tokenizer, ModelConfig]:
    """The run's tokenizer and its model config (``Model`` section, with the run's precision,
    attention and remat). A published model's preset without its checkpoint is refused here,
    unless ``Model.random_init`` asks for random weights."""
    check_weights(cfg.model)
    tokenizer = load_tokenizer(tokenizer_spec(cfg.model))
    return tokenizer, accel_model_config(model_config(cfg.model.name, tokenizer), cfg)


def check_weights(model: ModelSettings) -> None:
    """A preset of a published model stands for its weights: training it from a random
    initialisation by mistake wastes the run, so that must be asked for."""
    if model.name in PUBLISHED and not model.random_init:
        raise ValueError(
            f"model {model.name!r} is the preset of a published model but no checkpoint is "
            "named: set CHECKPOINT='/path/or/gs://bucket/dir' (its HF checkpoint; with a file of "
            "configs/model/, else Model.name) to start from its weights, or "
            "Model.random_init=True to train it from random weights"
        )


def tokenizer_spec(model: ModelSettings) -> str:
    """The tokenizer ``Model.tokenizer`` names; its default (None) is the checkpoint's own
    when ``Model.name`` is one, else ``'byte'`` (a preset)."""
    if model.tokenizer is not None:
        return model.tokenizer
    ckpt = hf_checkpoint_dir(model.name)
    if ckpt is None:
        return "byte"
    if not (as_path(ckpt) / "tokenizer.json").is_file():
        raise ValueError(
            f"checkpoint {ckpt!r} holds no tokenizer.json: set Model.tokenizer ('byte', or a "
            "tokenizer.json path / a directory holding one)"
        )
    return ckpt


def pretrained_params(name: str) -> HFCheckpoint | None:
    """A handle on the HF checkpoint ``name`` (``Model.name``) names, else None. Nothing is
    read here: the whole model never sits on one device or the host (an 8B model in bf16 is a
    16 GB chip's whole memory); each device reads its own shard where it is placed."""
    path = hf_checkpoint_dir(name)
    return None if path is None else HFCheckpoint(path)


def hf_checkpoint_dir(name: str) -> str | None:
    """The directory ``Model.name`` names when it is an HF checkpoint (local or ``gs://``),
    else None (a preset name). A directory that is missing or holds no config.json is an
    error naming it; nothing is downloaded."""
    if is_url(name):
        return _checked_dir(name, _url_exists(name))
    if os.path.isdir(name):
        return _checked_dir(name, True)
    if "/" in name or name.startswith("."):
        raise ValueError(
            f"model directory {name!r} does not exist (nothing is downloaded: name a preset or "
            "an HF checkpoint directory, local or gs://)"
        )
    return None


def _url_exists(name: str) -> bool:
    """Whether the ``gs://`` directory exists; a store that cannot be reached (after its
    client's retries) is refused in one line naming the URL, not a client's traceback."""
    try:
        return as_path(name).exists()
    except Exception as exc:  # noqa: BLE001 - storage clients raise many kinds; the cause is named
        raise ValueError(f"cannot reach checkpoint {name!r}: {type(exc).__name__}: {exc}") from None


def _checked_dir(name: str, exists: bool) -> str:
    if not exists:
        raise ValueError(f"model directory {name!r} does not exist (nothing is downloaded)")
    if not (as_path(name) / "config.json").is_file():
        raise ValueError(
            f"model {name!r} is a directory without config.json; name a preset or an HF "
            "checkpoint directory (config.json + model.safetensors)"
        )
    return name
