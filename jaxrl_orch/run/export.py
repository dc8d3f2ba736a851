"""The final policy as a Hugging Face checkpoint in ``WORKDIR/export``.

What it owns: ``export_policy(parts, params)``: ``config.json``, the safetensors weights and the
tokenizer (a byte-level run writes none); a checkpoint's chat template and special tokens
travel with its tokenizer. On ``gs://`` the checkpoint is written locally, then copied up.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from etils import epath

from jaxrl_orch.build.run import RunParts
from jaxrl_orch.models.hf_import import export_hf_dir
from jaxrl_orch.models.tokenizer import tokenizer_json_path
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.paths import copy_tree, is_url

TOKENIZER_SIDECARS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def export_policy(parts: RunParts, params: Any) -> epath.Path:
    dest = parts.workdir / "export"
    stage("export", f"the final policy as an HF checkpoint to {dest}")
    name = parts.cfg.model.tokenizer
    tok = None if name == "byte" else tokenizer_json_path(name)
    with tempfile.TemporaryDirectory() as local:
        into = local if is_url(dest) else parts.workdir
        out = export_hf_dir(params, parts.model_cfg, into, tok)
        for sidecar in TOKENIZER_SIDECARS if tok is not None else ():
            if (src := Path(tok).with_name(sidecar)).is_file():
                (out / sidecar).write_bytes(src.read_bytes())
        if is_url(dest):
            if dest.exists():
                dest.rmtree()
            copy_tree(out, dest)
    return dest
