"""Settings declared on their fields: each one's default, range and meaning stated once.

What it owns: ``setting(default, meaning, allowed)``, the one way a settings class (a config
section, the loss's ``PolicyLossConfig``, the adapters' ``LoraConfig``, the loop's
``OrchestratorConfig``) declares a field, and ``check_settings(obj)``, which every such class
calls from ``__post_init__``. The default is the dataclass default; the meaning and the
``Allowed`` values ride in the field's metadata, where ``--list_config`` (``config.listing``)
and the check both read them, so the listing cannot say one thing and the check do another.

The checks of one field, in order, each refusal naming ``Section.field``, the value and what is
allowed (``Engine.slots must be >= 1, got 0``): a field declared ``int`` holds an int (not
``1.5``, not ``True``); a float is finite (``inf`` and ``nan`` are refused unless the field's
``Allowed`` says ``or_infinite``); then the field's ``Allowed``. Conditions that span fields are
the class's own ``require`` calls.

A class names itself in messages by its ``SECTION`` class attribute (the name a gin binding
uses: ``RL``, ``Loss``), else by its class name.

Bottom layer: the standard library only, so every layer may declare settings this way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MEANING = "meaning"
ALLOWED = "allowed"


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values one setting may hold: a range (``low`` / ``high``, ``low_open`` for ``> low``),
    a set of ``choices``, a ``band`` (a pair ``(low, high)`` with ``0 <= low < high``) or a
    ``subset`` of ``choices``; and None when ``none_ok``, infinity when ``infinite_ok``. ``why``
    ends the refusal. ``str`` is the listing's wording."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple | None = None
    band: bool = False
    subset: bool = False
    none_ok: bool = False
    infinite_ok: bool = False
    why: str = ""

    @classmethod
    def at_least(cls, low: float) -> Allowed:
        return cls(low=low)

    @classmethod
    def above(cls, low: float) -> Allowed:
        return cls(low=low, low_open=True)

    @classmethod
    def between(cls, low: float, high: float) -> Allowed:
        return cls(low=low, high=high)

    @classmethod
    def one_of(cls, *choices: Any) -> Allowed:
        return cls(choices=tuple(choices))

    @classmethod
    def some_of(cls, *choices: Any) -> Allowed:
        return cls(choices=tuple(choices), subset=True)

    @classmethod
    def ratio_band(cls) -> Allowed:
        return cls(band=True)

    def or_none(self) -> Allowed:
        return dataclasses.replace(self, none_ok=True)

    def or_infinite(self) -> Allowed:
        return dataclasses.replace(self, infinite_ok=True)

    def because(self, why: str) -> Allowed:
        return dataclasses.replace(self, why=why)

    def __str__(self) -> str:
        if self.subset:
            text = f"a non-empty tuple of distinct names from {self.choices}"
        elif self.choices is not None:
            text = f"one of {self.choices}"
        elif self.band:
            text = "a pair (low, high) with 0 <= low < high"
        elif self.high is not None:
            text = f"in [{self.low}, {self.high}]"
        else:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        text += " or inf" if self.infinite_ok else ""
        return text + (" or None" if self.none_ok else "")

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.none_ok or (self.choices is not None and None in self.choices)
        if self.subset:
            return _is_subset(value, self.choices)
        if self.choices is not None:
            return value in self.choices
        if self.band:
            return _is_band(value)
        if not _is_number(value):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and (self.high is None or value <= self.high)


def setting(default: Any = dataclasses.MISSING, meaning: str = "", allowed: Allowed | None = None):
    """A settings field: ``default``, what it means (one or more sentences, read by
    ``--list_config``), and the values it may hold (None: any value of its type)."""
    metadata = {MEANING: meaning, ALLOWED: allowed}
    if isinstance(default, list | dict | set):
        raise TypeError(f"a setting's default must be immutable, got {default!r}")
    return dataclasses.field(default=default, metadata=metadata)


def meaning_of(field: dataclasses.Field) -> str:
    return field.metadata.get(MEANING, "")


def allowed_of(field: dataclasses.Field) -> Allowed | None:
    return field.metadata.get(ALLOWED)


def section_name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "SECTION", cls.__name__)


def check_settings(obj: Any) -> None:
    """Every field of ``obj`` (see the module docstring for the checks and their order)."""
    where = section_name(obj)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        rule = allowed_of(f)
        name = f"{where}.{f.name}"
        if f.type in ("int", "int | None") and value is not None:
            require(_is_int(value), f"{name} must be an int, got {value!r}")
        if not (rule is not None and rule.infinite_ok):
            require(_finite(value), f"{name} must be finite, got {value!r}")
        if rule is not None:
            why = f": {rule.why}" if rule.why else ""
            require(rule.allows(value), f"{name} must be {rule}, got {value!r}{why}")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, tuple | list):
        return all(_finite(v) for v in value)
    return True


def _is_band(value: Any) -> bool:
    if not isinstance(value, tuple | list) or len(value) != 2:
        return False
    if not all(_is_number(v) for v in value):
        return False
    return 0 <= value[0] < value[1]


def _is_subset(value: Any, choices: tuple) -> bool:
    if not isinstance(value, tuple | list) or not value or len(set(value)) != len(value):
        return False
    return all(v in choices for v in value)
