"""Key names of a model's state: how the same weight is found across its tree forms.

An ``nnx.State``, a pure dict of it, a quantized base and the engine's params name a weight by
the same dict keys and list indices; only the ``nnx.State``'s ``.value`` steps differ. Matching
by ``key_names`` lets a merge or a quantization pair arrays of different trees.
"""

from __future__ import annotations

from typing import Any

import jax


def key_names(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key path's dict keys and indices, with every other step (``.value``) dropped."""
    keys = [k for k in path if hasattr(k, "key") or hasattr(k, "idx")]
    return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in keys)


def by_names(tree: Any) -> dict[tuple[Any, ...], Any]:
    """Every leaf of ``tree`` under its ``key_names``."""
    return {key_names(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
