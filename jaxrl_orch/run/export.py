"""The final policy as a Hugging Face checkpoint in ``WORKDIR/export``.

What it owns: ``export_policy(parts, params, adapters=None, base=None)``: ``config.json``, the
safetensors weights and the tokenizer (a byte-level run's as an HF tokenizer directory,
``models.byte_hf``, so transformers and renderers load the export as is); a checkpoint's chat
template and special tokens travel with its tokenizer. ``params`` are every weight of the
policy (a LoRA run's merged weights), so ``export/`` loads in plain ``transformers``.

A LoRA run passes its ``adapters`` (the trainer's params) and its frozen ``base`` too, and
``export/lora/`` gets them as a PEFT adapter (``models.peft_export``), whose
``base_model_name_or_path`` is the base it was trained over:

- the model's own HF checkpoint directory (``Model.name``, as an absolute path) when the RL base
  is exactly that checkpoint: no warm-up ran (``Warmup.steps == 0``, no ``Warmup.from_workdir``);
- otherwise (a warmed-up or preset-initialised base) ``base`` itself, written as an HF
  checkpoint to ``export/lora/base/``, named by the absolute path it ends up at.

The user runs ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<base>),
"<workdir>/export/lora")`` with ``<base>`` the adapter's ``base_model_name_or_path``, or
``AutoPeftModelForCausalLM.from_pretrained("<workdir>/export/lora")``, which reads it from
``adapter_config.json``. On a ``gs://`` workdir that path is the bucket's URL: copy
``export/`` down and pass the local ``lora/base``.

Invariant: ``export/`` is replaced whole. Everything is written to a staging directory first
(``WORKDIR/export.staging``, or a local temporary one for ``gs://``), then renamed (or copied
up), so a crash mid-write leaves the previous export or none, never a mix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from etils import epath

from jaxrl_orch.compose.model import tokenizer_spec
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.compose.trainers import rl_model
from jaxrl_orch.models.byte_hf import save_byte_tokenizer
from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.models.hf_import import save_hf_checkpoint
from jaxrl_orch.models.peft_export import save_peft_adapter
from jaxrl_orch.models.tokenizer import tokenizer_json_path
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.paths import as_path, copy_tree, is_url

TOKENIZER_SIDECARS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def export_policy(
    parts: RunParts, params: Any, adapters: Any = None, base: Any = None
) -> epath.Path:
    """Write ``WORKDIR/export`` (see the module docstring); returns its path."""
    dest = parts.workdir / "export"
    stage("export", f"the final policy as an HF checkpoint to {dest}")
    checkpoint = None if adapters is None else _checkpoint_base(parts, base)
    name = tokenizer_spec(parts.cfg.model)
    tok = None if name == "byte" else tokenizer_json_path(name)
    with tempfile.TemporaryDirectory() as local:
        staging = Path(local) if is_url(dest) else Path(os.fspath(parts.workdir), "export.staging")
        shutil.rmtree(staging, ignore_errors=True)
        out = _export_hf_dir(params, parts.model_cfg, staging, tok)
        for sidecar in TOKENIZER_SIDECARS if tok is not None else ():
            if (src := as_path(tok).parent / sidecar).is_file():
                (out / sidecar).write_bytes(src.read_bytes())
        if name == "byte":
            save_byte_tokenizer(out)
        if adapters is not None:
            _export_adapter(parts, adapters, (checkpoint, base), out / "lora", dest / "lora")
        if is_url(dest):
            if dest.exists():
                dest.rmtree()
            copy_tree(out, dest)
        else:
            shutil.rmtree(os.fspath(dest), ignore_errors=True)
            out.rename(os.fspath(dest))
            shutil.rmtree(staging)
    return dest


def _checkpoint_base(parts: RunParts, base: Any) -> Path | str | None:
    """The HF checkpoint directory the RL base is exactly, or None (a warm-up changed it, QLoRA
    trained over its dequantized weights, or the model is a preset, initialised at random): then
    ``base`` is exported and must be given."""
    warmup = parts.cfg.warmup
    name = parts.cfg.model.name
    exact = not (warmup.steps or warmup.from_workdir) and parts.cfg.lora.quantize is None
    if exact and (as_path(name) / "config.json").is_file():  # a gs:// checkpoint is named as is
        return name if is_url(name) else Path(name).resolve()
    if base is None:
        raise ValueError(
            f"export_policy: the LoRA run's base is not the checkpoint {name!r} (Warmup.steps="
            f"{warmup.steps}, Warmup.from_workdir={warmup.from_workdir!r}), so base= (the "
            "trainer's frozen state) must be given to write it beside the adapter"
        )
    return None


def _export_adapter(
    parts: RunParts, adapters: Any, base: tuple[Path | str | None, Any], out: Path, final: Any
) -> None:
    """The PEFT adapter in ``out`` (the staging copy of ``final``) over ``base``: the checkpoint
    directory it names, else the frozen state, written to ``out/base``."""
    checkpoint, state = base
    if checkpoint is not None:
        base_dir = str(checkpoint)
    elif is_url(final):
        base_dir = str(final / "base")
    else:
        base_dir = str(Path(os.fspath(final)).resolve() / "base")
    lora_cfg = rl_model(parts.cfg, parts.model_cfg)
    save_peft_adapter(adapters, lora_cfg, out, base_dir)  # replaces `out` whole, so first
    if checkpoint is None:
        save_hf_checkpoint(state, parts.model_cfg, out / "base")


def _export_hf_dir(
    params: Any, cfg: ModelConfig, workdir: str | Path, tokenizer_json: str | Path | None
) -> Path:
    """``params`` as an HF checkpoint in ``workdir/export`` (plus ``tokenizer_json`` if given),
    replaced whole via ``export.tmp``: a crash mid-write never leaves a half-written export."""
    out = Path(workdir) / "export"
    tmp = Path(workdir) / "export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(params, cfg, tmp)
    if tokenizer_json is not None:
        (tmp / "tokenizer.json").write_bytes(as_path(tokenizer_json).read_bytes())  # or gs://
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
