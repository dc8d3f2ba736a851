"""The value checks of the config sections: each refusal names the section, the setting, the
value given and what is allowed (``Engine.slots must be >= 1, got 0``), at config time, before
any work."""

from __future__ import annotations


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def at_least(section: object, floor: int, *names: str) -> None:
    kind = type(section).__name__
    for name in names:
        value = getattr(section, name)
        require(value >= floor, f"{kind}.{name} must be >= {floor}, got {value}")


def positive(section: object, *names: str) -> None:
    kind = type(section).__name__
    for name in names:
        value = getattr(section, name)
        require(value > 0, f"{kind}.{name} must be > 0, got {value}")


def one_of(section: object, name: str, allowed: tuple) -> None:
    value = getattr(section, name)
    kind = type(section).__name__
    require(value in allowed, f"{kind}.{name} must be one of {allowed}, got {value!r}")
