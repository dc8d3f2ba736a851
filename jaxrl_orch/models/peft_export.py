"""A LoRA run's adapters as a Hugging Face PEFT adapter directory.

What it owns: ``save_peft_adapter(adapters, cfg, path, base_model)``, which writes
``adapter_model.safetensors`` (float32, PEFT's tensor names: ``models.lora.peft_tensors``) and
``adapter_config.json`` (``models.lora.peft_config``) into ``path``. Loaded with
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<base>), path)`` over the
HF checkpoint of the same base (``models.hf_import.save_hf_checkpoint``), it computes the same
function as this package's unmerged LoRA model: PEFT's ``lora_alpha / r`` is our scale, its
``lora_A`` / ``lora_B`` are our ``A`` / ``B`` with the head axes flattened the way the base's
``q/k/v/o`` projections are.

Invariants: the directory is replaced whole (written to ``<path>.tmp``, then renamed), so a
crash mid-write never leaves a half-written adapter; only a config with ``lora`` is accepted.
Reads no checkpoint and never touches the base: ``base_model`` is only recorded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.models.lora import peft_config, peft_tensors

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_peft_adapter(
    adapters: Any, cfg: ModelConfig, path: str | os.PathLike, base_model: str
) -> Path:
    """Write ``adapters`` (the LoRA model's ``nnx.LoRAParam`` state, or its pure dict; arrays
    may be sharded) as a PEFT adapter of ``base_model`` into ``path``; returns ``path``."""
    if cfg.lora is None:
        raise ValueError(
            "save_peft_adapter needs a ModelConfig with lora set (a LoRA run's model), got "
            "lora=None: export a full-weight model with models.hf_import.save_hf_checkpoint"
        )
    if isinstance(adapters, nnx.State):
        adapters = nnx.to_pure_dict(adapters)
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), adapters)
    tensors = peft_tensors(host, cfg.n_layers, cfg.lora)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(tmp / ADAPTER_CONFIG, "w") as f:
        json.dump(peft_config(cfg.lora, base_model), f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
