"""The value checks of the config sections: each refusal names the section, the setting, the
value given and what is allowed (``Engine.slots must be >= 1, got 0``), at config time, before
any work.

A section states what each setting may hold once, in its ``ALLOWED`` table (``{field:
Allowed}``); its ``__post_init__`` calls ``check_allowed(self)``, and ``--list_config``
(``config.listing``) prints the same ``Allowed`` under each field, so the listing and the check
cannot disagree. A setting declared ``int`` must hold an int (``1.5`` or ``True`` is refused).
``at_least`` / ``positive`` / ``one_of`` check a section's settings one by one with the same
rules and messages, for the checks that are not in a table yet; ``require`` is any other
condition, with its own message.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values one setting may hold: a range (``low`` / ``high``, ``low_open`` for ``> low``),
    a set of ``choices``, or a ``band`` (a pair ``(low, high)`` with ``0 <= low < high``), and
    None when ``none_ok``; ``why`` ends the refusal. ``str`` is the listing's wording."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple | None = None
    band: bool = False
    subset: bool = False  # a non-empty tuple of distinct ``choices``
    none_ok: bool = False
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
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and (self.high is None or value <= self.high)

    def check(self, section: object, name: str) -> None:
        value = getattr(section, name)
        where = f"{type(section).__name__}.{name}"
        why = f": {self.why}" if self.why else ""
        require(self.allows(value), f"{where} must be {self}, got {value!r}{why}")


def _is_band(value: Any) -> bool:
    if not isinstance(value, tuple | list) or len(value) != 2:
        return False
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return False
    return 0 <= value[0] < value[1]


def _is_subset(value: Any, choices: tuple) -> bool:
    if not isinstance(value, tuple | list) or not value or len(set(value)) != len(value):
        return False
    return all(v in choices for v in value)


def check_allowed(section: object) -> None:
    """Check every setting of ``section`` in its class's ``ALLOWED`` table, and that each one
    declared ``int`` (or ``int | None``) holds an int."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.type in ("int", "int | None") and value is not None:
            require(
                isinstance(value, int) and not isinstance(value, bool),
                f"{type(section).__name__}.{f.name} must be an int, got {value!r}",
            )
    for name, allowed in type(section).ALLOWED.items():
        allowed.check(section, name)


def allowed_of(cls: type) -> dict[str, Allowed]:
    """``{field: Allowed}`` of a section class (empty for one without a table)."""
    return dict(getattr(cls, "ALLOWED", {}))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def at_least(section: object, floor: int, *names: str) -> None:
    for name in names:
        Allowed.at_least(floor).check(section, name)


def positive(section: object, *names: str) -> None:
    for name in names:
        Allowed.above(0).check(section, name)


def one_of(section: object, name: str, allowed: tuple) -> None:
    Allowed.one_of(*allowed).check(section, name)
