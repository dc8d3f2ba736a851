"""What a workdir's run is, so a resume cannot quietly become another run.

What it owns: ``IDENTITY``, the settings a resume must keep (the model and its checkpoint shapes,
the data and its layout per step, the seed); ``record_identity(workdir, cfg)``, which writes
them to ``WORKDIR/run_identity.json`` when the run starts; ``check_resume(workdir, cfg)``, which
refuses a command whose settings differ from the recorded ones, naming every difference, before
any checkpoint is read. Without the check, a resume with another model fails to restore its
checkpoints, sets the intact ones aside as corrupt and starts RL over the old history; another
``group_size`` was taken silently.

Everything else may change on a resume (more steps, another learning rate, eval cadence,
timeouts): those are how a run is continued, not which run it is. A workdir written before the
record existed has none, and is not checked.
"""

from __future__ import annotations

import json
from typing import Any

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.configs import CONFIG_NAMES
from jaxrl_orch.paths import Pathish, as_path, write_atomic

FILE = "run_identity.json"

# section.field of TrainConfig -> why a resume must keep it
IDENTITY = {
    "seed": "the data order and every sample drawn derive from it",
    "model.name": "the checkpoints hold this model's weights",
    "model.tokenizer": "token ids in the checkpoints and rollouts are this tokenizer's",
    "model.param_dtype": "the checkpoints hold weights and Adam moments in this dtype",
    "model.scan_layers": "scanned layers are stacked: another tree of arrays",
    "data.env": "the rewards of the history so far",
    "data.dataset": "the prompts and the data position in the checkpoints",
    "data.eval_dataset": "the held-out evals of the history so far",
    "data.instruction": "the prompts of the history so far",
    "data.rl_prompt_pool": "the prompts and the data position in the checkpoints",
    "rl.group_size": "the saved batches, the gate and the dispatcher state count groups of it",
    "rl.prompts_per_step": "the saved loop state counts steps of this many groups",
}


def identity(cfg: TrainConfig) -> dict[str, Any]:
    out = {}
    for key in IDENTITY:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if key == "model.tokenizer" and value is None:
            # The default names the tokenizer Model.name implies (compose.model.tokenizer_spec):
            # recorded as that, a run recorded before the default existed ('byte') resumes.
            value = "byte" if cfg.model.name in CONFIG_NAMES else cfg.model.name
        out[key] = json.loads(json.dumps(value))  # as the file holds it (tuples are lists)
    return out


def record_identity(workdir: Pathish, cfg: TrainConfig) -> None:
    write_atomic(as_path(workdir) / FILE, json.dumps(identity(cfg), indent=1, sort_keys=True))


def check_resume(workdir: Pathish, cfg: TrainConfig) -> None:
    """Raise ``ValueError`` naming each identity setting this command changes for the run
    recorded in ``workdir`` (nothing is read or moved before)."""
    path = as_path(workdir) / FILE
    if not path.exists():
        return
    try:
        saved = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); fix or delete it") from None
    now = identity(cfg)
    changed = [k for k in IDENTITY if k in saved and saved[k] != now[k]]
    if not changed:
        return
    lines = "; ".join(
        f"{k}: the run has {saved[k]!r}, this command {now[k]!r} ({IDENTITY[k]})" for k in changed
    )
    raise ValueError(
        f"workdir {workdir} holds another run than this command describes: {lines}. "
        "Nothing was read or moved: run with the workdir's settings to resume it, or give "
        "another --workdir to start a new run"
    )
