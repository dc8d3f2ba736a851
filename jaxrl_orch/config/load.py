"""How a ``TrainConfig`` is made: from gin files and bindings, or from settings in code.

What it owns: ``load_config`` (the train command's: parse gin, build the config; every error
names the bad file, binding or value, and a binding of a name from before the sections, such as
``TrainConfig.rl_steps``, names where it went, ``RL.steps``), and ``make_config`` (scripts and
tests: ``{"RL.steps": 40, "seed": 3}``, checked like bindings). A refused config leaves no
bindings behind for the next ``TrainConfig()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gin

from jaxrl_orch.config.train import SECTIONS, TrainConfig

# A binding of a name from before the sections fails naming where it went.
MOVED = {
    "model": "Model.name",
    "warmup_from": "Warmup.from_workdir",
    "sft_warmup_steps": "Warmup.lr_warmup_steps",
    "rl_warmup_steps": "RL.lr_warmup_steps",
    "trainer_mesh": "Trainer.mesh",
    "decode_mesh": "Engine.mesh",
    "engine": "Engine.kind",
    "decode_slots": "Engine.slots",
    "engine_warmup": "Engine.warmup",
    "engine_param_dtype": "Engine.param_dtype",
    "engine_compute_dtype": "Engine.compute_dtype",
    **{f"sft_{n}": f"Warmup.{n}" for n in ("steps", "batch_size", "learning_rate")},
    "sft_checkpoint_every": "Warmup.checkpoint_every",
    **{f"rl_{n}": f"RL.{n}" for n in ("steps", "learning_rate")},
}


def moved_name(old: str) -> str | None:
    """Where the flat setting ``old`` lives now (``"RL.group_size"``), or None."""
    if old in MOVED:
        return MOVED[old]
    for section in SECTIONS:
        if old in {f.name for f in dataclasses.fields(section)}:
            return f"{section.__name__}.{old}"
    return None


def load_config(gin_files: list[str], gin_params: list[str]) -> TrainConfig:
    """Parse gin and build the config; every error names the bad file/binding/value."""
    for f in gin_files:
        if not Path(f).is_file():
            raise ValueError(f"gin file {f!r} does not exist")
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params)
    except (ValueError, KeyError, SyntaxError) as exc:
        gin.clear_config()
        raise ValueError(f"bad gin config: {exc}{_moved_hint(str(exc))}") from exc
    try:
        return TrainConfig()
    except ValueError:
        gin.clear_config()  # a refused config must not linger for the next TrainConfig()
        raise


def _moved_hint(message: str) -> str:
    found = re.search(r"'TrainConfig'.*?parameter named '(\w+)'", message)
    new = moved_name(found.group(1)) if found else None
    return f" (TrainConfig.{found.group(1)} is now {new})" if new else ""


def make_config(settings: Mapping[str, Any] | None = None) -> TrainConfig:
    """A config built in code from ``{"RL.steps": 40, "seed": 3}`` (a section's name and one
    of its fields, or a ``TrainConfig`` field), checked like a gin file's bindings."""
    by_section: dict[str, dict[str, Any]] = {}
    root: dict[str, Any] = {}
    for key, value in (settings or {}).items():
        section, _, name = key.rpartition(".")
        (by_section.setdefault(section, {}) if section else root)[name] = value
    attrs = {type(f.default_factory()).__name__: f.name for f in _section_fields()}
    unknown = sorted(set(by_section) - set(attrs))
    if unknown:
        raise ValueError(f"unknown config sections {unknown}; the sections are {list(attrs)}")
    made = {attrs[s]: SECTION_BY_NAME[s](**kw) for s, kw in by_section.items()}
    return TrainConfig(**root, **made)


def _section_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.default_factory in SECTIONS]


SECTION_BY_NAME = {s.__name__: s for s in SECTIONS}
