"""The examples check's verdict, kept in the workdir: a restart over the same data skips it.

``compose.checks`` reads every example of every source before the first step (a record that does
not decode, a prompt over the engine's limit). That costs each start a pass over the data:
0.3 s on the bundled task's 7,744 records, growing with the data (about 40 s a million at that
rate), paid again by every restart of a preemptible run although nothing it read has changed.
A passed check is therefore kept as ``<workdir>/examples_checked.json``, under a key of
everything the verdict depends on, and a later start whose key matches skips the pass.

The key (``examples_key``) covers:
- each checked source's identity (``source_identity``): a list of records in memory (a text
  file's lines, an environment's own tasks) by a digest of its content; a prepared tfds dataset
  by its split and each file of its directory (name, size, modification time). A source of any
  other kind has no identity: the key is None and the check runs at every start;
- the tokenizer: ``byte``, or each file beside its ``tokenizer.json`` (name, size, modification
  time): a chat template or a vocabulary changes a prompt's token count;
- the settings the check reads: the data, warm-up, model and verifiers sections, the row length,
  the new-token budget and the engine's prompt limit;
- the code: ``executables.fingerprint()``, the source of every ``jaxrl_orch`` file and of any user
  module loaded from outside the installed packages (an environment's rendering), and the
  versions that matter to JAX.
A change to any of them is another key: the check runs again. A verdict file that cannot be
read is said in one line and the check runs again; one that cannot be written is said in one
line and the run goes on (the next start checks again).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from etils import epath

from jaxrl_orch.compose.executables import fingerprint
from jaxrl_orch.compose.model import tokenizer_spec
from jaxrl_orch.data.sources import DatasetSource
from jaxrl_orch.models.tokenizer import tokenizer_json_path
from jaxrl_orch.orchestrator.metrics.writers import stage

if TYPE_CHECKING:
    from jaxrl_orch.compose.parts import RunParts

VERDICT_FILE = "examples_checked.json"
FORMAT = 1


def examples_key(parts: RunParts, sources: list[DatasetSource], max_prefill: int) -> str | None:
    """The key of a check of ``sources`` (see the module docstring); None: not keepable."""
    identities = [source_identity(s) for s in sources]
    if any(i is None for i in identities):
        return None
    cfg = parts.cfg
    settings = [cfg.data, cfg.warmup, cfg.model, cfg.verifiers]
    limits = [cfg.trainer.row_len, cfg.rl.max_new_tokens, max_prefill]
    whole = {
        "format": FORMAT,
        "sources": identities,
        "tokenizer": _tokenizer_identity(tokenizer_spec(cfg.model)),
        "settings": [repr(s) for s in settings] + limits,
        "code": fingerprint(),
    }
    return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()


def source_identity(source: DatasetSource) -> list[Any] | None:
    """What ``source``'s examples are, cheaply (see the module docstring); None: unknown."""
    data = source.data
    fields = sorted(source.fields.items()) if source.fields is not None else None
    head = [type(source).__name__, source.name, fields, repr(sorted(source.extra.items()))]
    if isinstance(data, list):
        text = json.dumps(data, sort_keys=True, default=repr)
        return [*head, hashlib.sha256(text.encode()).hexdigest()]
    info = getattr(data, "dataset_info", None)
    if info is not None and getattr(info, "data_dir", None):
        return [*head, str(getattr(data, "split", "")), _files(epath.Path(info.data_dir))]
    return None


def recalled(parts: RunParts, key: str) -> bool:
    """Whether the workdir holds a passed check under ``key``."""
    path = parts.workdir / VERDICT_FILE
    try:
        if not path.exists():
            return False
        return json.loads(path.read_text())["key"] == key
    except (OSError, ValueError, KeyError, TypeError) as exc:
        stage("data", f"{path} cannot be read ({type(exc).__name__}): every example checked again")
        return False


def remember(parts: RunParts, key: str) -> None:
    """Keep a passed check under ``key`` (the process that writes the workdir only)."""
    if not parts.role.leader:
        return
    path = parts.workdir / VERDICT_FILE
    try:
        parts.workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key}))
    except OSError as exc:
        stage("data", f"{path} cannot be written ({exc}): the next start checks the examples again")


def _tokenizer_identity(spec: str) -> Any:
    if spec == "byte":
        return spec
    return _files(epath.Path(tokenizer_json_path(spec)).parent)


def _files(directory: epath.Path) -> list[list[Any]]:
    """Each file of ``directory``: name, size, modification time."""
    out = []
    for path in sorted(directory.iterdir()):
        if path.is_file():
            st = path.stat()
            out.append([path.name, st.length, st.mtime])
    return out
