"""``load_factory``: the one import of a user's ``"package.module:factory"`` setting.

Who uses it: ``Engine.kind`` (``compose/engines.engine_factory``) and ``Data.env``
(``envs/base.make_env``) name user code this way, so that every process of a multi-process run
imports it itself (no registering script). Bad specs, missing modules or attributes and
non-callables raise ``ValueError`` naming the setting, the spec and what failed. Standard
library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_factory(spec: str, setting: str, hint: str = "") -> Callable[..., Any]:
    """Import ``spec`` (``"package.module:factory"``) and return the callable it names;
    ``hint`` ends every error (e.g. the built-in names the setting also takes)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{setting} must name 'package.module:factory', got {spec!r}{hint}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{setting} {spec!r}: cannot load {attr!r} from {module_name!r} "
            f"({type(exc).__name__}: {exc}){hint}"
        ) from exc
    if not callable(factory):
        kind = type(factory).__name__
        raise ValueError(f"{setting} {spec!r} names a {kind}, not a callable{hint}")
    return factory
