"""How a settings class becomes a config section: bound by gin under its section name, checked
on construction, listed by ``--list_config``.

What it owns: ``section(name)``, the decorator of the sections declared in ``config/``
(a frozen dataclass whose fields are ``jaxrl_orch.settings.setting`` fields, configurable by gin
as ``name``: ``Engine.slots = 8``, checked by ``check_settings`` unless it checks more itself),
and ``bind(cls)``, which makes a settings class declared in another layer a section under its
own ``SECTION`` name (the loss's ``PolicyLossConfig`` as ``Loss``, the adapters' ``LoraConfig``
as ``Lora``) so that the object gin builds is the one its users read.

The Python class names end in ``Settings`` (``EngineSettings``) so that no name is shared with
the class it configures (``Engine`` contracts, ``Trainer``); a binding and every message use
the section name.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import gin

from jaxrl_orch.settings import check_settings

T = TypeVar("T")


def section(name: str):
    """Declare a config section named ``name`` (see the module docstring)."""

    def declare(cls: type[T]) -> type[T]:
        cls.SECTION = name
        if "__post_init__" not in cls.__dict__:
            cls.__post_init__ = check_settings
        return gin.configurable(name)(dataclasses.dataclass(frozen=True)(cls))

    return declare


def bind(cls: type[T]) -> type[T]:
    """A settings class declared elsewhere, configurable by gin as its ``SECTION``."""
    return gin.configurable(cls.SECTION)(cls)


def sections_of(cls: type) -> list[tuple[str, type]]:
    """``[(field name, section class)]`` of the fields of ``cls`` that hold a section."""
    return [
        (f.name, f.default_factory)
        for f in dataclasses.fields(cls)
        if f.default_factory is not dataclasses.MISSING and hasattr(f.default_factory, "SECTION")
    ]
