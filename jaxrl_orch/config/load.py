"""How a ``TrainConfig`` is made: from gin files and bindings, or from settings in code.

What it owns: ``load_config`` (the train command's: parse gin, build the config; every error
names the bad file, binding or value), ``make_config`` (scripts and tests: ``{"RL.steps": 40,
"Loss.tis_cap": 1.5, "seed": 3}``, checked like bindings) and ``SECTIONS`` (every section class,
nested ones included, in listing order). A refused config leaves no bindings behind for the next
``TrainConfig()``.

Files compose by concern (``config.concerns``): files side by side that disagree on a setting,
a file of one concern binding another's, and a macro nothing binds are refused before gin parses
them; a refusal of the built config names the file that bound each setting it names.

Two mistakes gin would let through or answer obscurely are named here:
- a binding of a name that moved (``TrainConfig.rl_steps``, ``RL.tis_cap``) names where it went
  (``RL.steps``, ``Loss.tis_cap``);
- a bare name (``--gin_param='seed = 1'``) is a gin macro, which nothing reads unless a file
  says ``%seed``: such a binding is refused, naming the setting it probably meant.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gin

from jaxrl_orch.config.concerns import compose
from jaxrl_orch.config.section import sections_of
from jaxrl_orch.config.train import TrainConfig

_LOSS_FIELDS = (
    "eps_low",
    "eps_high",
    "tis_cap",
    "kl_beta",
    "policy_loss",
    "eps_low_is",
    "eps_high_is",
    "icepop",
    "mis",
    "mis_bounds",
    "geo_mask",
)
# A binding of a name from before the sections, or from before the loss had its own, fails
# naming where it went.
MOVED = {
    ("TrainConfig", "model"): "Model.name",
    ("TrainConfig", "warmup_from"): "Warmup.from_workdir",
    ("TrainConfig", "sft_warmup_steps"): "Warmup.lr_warmup_steps",
    ("TrainConfig", "rl_warmup_steps"): "RL.lr_warmup_steps",
    ("TrainConfig", "trainer_mesh"): "Trainer.mesh",
    ("TrainConfig", "decode_mesh"): "Engine.mesh",
    ("TrainConfig", "engine"): "Engine.kind",
    ("TrainConfig", "decode_slots"): "Engine.slots",
    ("TrainConfig", "engine_warmup"): "Engine.warmup",
    ("TrainConfig", "engine_param_dtype"): "Engine.param_dtype",
    ("TrainConfig", "engine_compute_dtype"): "Engine.compute_dtype",
    ("TrainConfig", "sft_checkpoint_every"): "Warmup.checkpoint_every",
    **{
        ("TrainConfig", f"sft_{n}"): f"Warmup.{n}" for n in ("steps", "batch_size", "learning_rate")
    },
    **{("TrainConfig", f"rl_{n}"): f"RL.{n}" for n in ("steps", "learning_rate")},
    ("RL", "loss_norm"): "Loss.norm",
    **{("RL", n): f"Loss.{n}" for n in _LOSS_FIELDS},
}


def _all_sections() -> list[type]:
    found: list[type] = []
    for _, cls in sections_of(TrainConfig):
        found.append(cls)
        found.extend(nested for _, nested in sections_of(cls))
    return found


SECTIONS: tuple[type, ...] = tuple(_all_sections())
SECTION_BY_NAME: dict[str, type] = {s.SECTION: s for s in SECTIONS}


def moved_name(section: str, old: str) -> str | None:
    """Where ``section.old`` lives now (``"RL.group_size"``), or None."""
    if (section, old) in MOVED:
        return MOVED[(section, old)]
    if section == "TrainConfig":  # a flat name from before the sections
        for cls in SECTIONS:
            if old in cls.__dataclass_fields__:
                return f"{cls.SECTION}.{old}"
    return None


def load_config(gin_files: list[str], gin_params: list[str]) -> TrainConfig:
    """Parse gin and build the config; every error names the bad file/binding/value."""
    for f in gin_files:
        if not Path(f).is_file():
            raise ValueError(f"gin file {f!r} does not exist")
    composition = compose(gin_files, gin_params)
    _refuse_unused_macros(composition.reads, gin_params)
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params)
    except (ValueError, KeyError, SyntaxError) as exc:
        gin.clear_config()
        raise ValueError(f"bad gin config: {exc}{_moved_hint(str(exc))}") from exc
    try:
        return TrainConfig()
    except ValueError as exc:
        gin.clear_config()  # a refused config must not linger for the next TrainConfig()
        raise ValueError(composition.explain(str(exc))) from exc


def _moved_hint(message: str) -> str:
    found = re.search(r"'(\w+)'.*?parameter named '(\w+)'", message)
    if not found:
        return ""
    new = moved_name(*found.groups())
    return f" ({found.group(1)}.{found.group(2)} is now {new})" if new else ""


_BARE = re.compile(r"^\s*([A-Za-z_]\w*)\s*=")


def _refuse_unused_macros(reads: frozenset[str], gin_params: list[str]) -> None:
    """A bare ``NAME = value`` binding must be a macro some file (included ones too) or binding
    reads (``%NAME``)."""
    for param in gin_params:
        bare = _BARE.match(param)
        if bare is None:
            continue
        name = bare.group(1)
        if name in reads or any(re.search(rf"%{name}\b", p) for p in gin_params):
            continue
        meant = " or ".join(f"'{m} = ...'" for m in _meant(name))
        hint = f"; did you mean {meant}?" if meant else ""
        raise ValueError(
            f"binding {param.strip()!r} names no section: a bare name is a gin macro, and no "
            f"gin file or binding reads %{name}{hint} (a setting is Section.name, e.g. "
            "'RL.steps = 40')"
        )


def _meant(name: str) -> list[str]:
    """The settings a bare ``name`` probably meant: a field of ``TrainConfig`` itself, else
    every section's field of that name (or where an old flat name went)."""
    sections = {attr for attr, _ in sections_of(TrainConfig)}
    if name in TrainConfig.__dataclass_fields__ and name not in sections:
        return [f"TrainConfig.{name}"]
    found = [f"{cls.SECTION}.{name}" for cls in SECTIONS if name in cls.__dataclass_fields__]
    moved = MOVED.get(("TrainConfig", name))
    return found or ([moved] if moved else [])


def make_config(settings: Mapping[str, Any] | None = None) -> TrainConfig:
    """A config built in code from ``{"RL.steps": 40, "Loss.tis_cap": 1.5, "seed": 3}`` (a
    section's name and one of its fields, or a ``TrainConfig`` field), checked like a gin
    file's bindings."""
    by_section: dict[str, dict[str, Any]] = {}
    root: dict[str, Any] = {}
    for key, value in (settings or {}).items():
        name, _, field = key.rpartition(".")
        (by_section.setdefault(name, {}) if name else root)[field] = value
    unknown = sorted(set(by_section) - set(SECTION_BY_NAME))
    if unknown:
        raise ValueError(
            f"unknown config sections {unknown}; the sections are {list(SECTION_BY_NAME)}"
        )
    return TrainConfig(**root, **_built(TrainConfig, by_section))


def _built(cls: type, by_section: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The section fields of ``cls`` that ``by_section`` sets, built (nested sections too)."""
    out = {}
    for attr, section in sections_of(cls):
        nested = _built(section, by_section)
        if section.SECTION in by_section or nested:
            out[attr] = section(**by_section.get(section.SECTION, {}), **nested)
    return out
