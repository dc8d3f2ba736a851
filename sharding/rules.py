"""Logical-axis rules: the one place logical axis names become mesh shardings.

What it owns
    The rule tables (``TRAINER_RULES``, ``DECODE_RULES``) as plain data, and the two functions
    that apply them: ``logical_to_mesh_spec`` (one array's logical axes -> ``PartitionSpec``) and
    ``resolve_shardings`` (a pytree of logical axes -> a pytree of ``NamedSharding``). Models tag
    their params, caches and activations with logical names ("embed", "heads", ...); only this
    module decides which mesh axis, if any, each name lands on. No other module may turn a
    logical name into a mesh axis.

Rule semantics (the invariants)
    A rule table is an ordered sequence of ``(logical_name, mesh_axes)`` where ``mesh_axes`` is a
    mesh axis name, a tuple of mesh axis names (the dim is split over their product), or None
    (replicate). Rules are applied in table order, so earlier rules win a contested mesh axis; a
    logical name may appear more than once to give fallbacks. For one array:
    - a mesh axis is never used for two dims of the same array: a rule whose mesh axes are
      already taken by an earlier rule for this array is skipped;
    - when the dim's size is known and not divisible by the product of the mesh axis sizes, the
      rule is skipped (the dim falls back to replication unless a later rule fits), and the mesh
      axis stays free for other dims;
    - logical names no rule mentions are replicated (None);
    - a rule naming a mesh axis the mesh does not have is a configuration error (ValueError),
      because silently replicating would hide a typo in a rule table.

Who drives it
    The trainer (params, optimizer state, batch) with ``TRAINER_RULES`` on the ('fsdp', 'tp')
    mesh; the inference engine (params, KV cache) with ``DECODE_RULES`` on the ('tp',) mesh; the
    weight watcher resolves the decode shardings it reshards trainer params onto.

What it must never do
    Import anything model- or RL-specific (``jaxrl_orch``), allocate device memory, or guess:
    a leaf that is not a tuple of ``str | None`` is rejected with the offending value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rule = tuple[str, MeshAxes]
Rules = Sequence[Rule]

# Trainer mesh ('fsdp', 'tp'): FSDP shards the model-width dim ("embed") and the batch; tensor
# parallelism shards the per-head / hidden / vocab dims. "batch" is listed before "embed" so
# activations [batch, length, embed] shard the batch, not the width, over fsdp.
TRAINER_RULES: tuple[Rule, ...] = (
    ("batch", "fsdp"),
    ("cache_batch", "fsdp"),
    ("length", None),
    ("cache_length", None),
    ("layers", None),
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("embed", "fsdp"),
    # Fallback when the (kv) heads do not divide tp (Qwen2.5: 2 kv heads on tp 4): split the
    # head dim instead of replicating the projections and the KV cache. Listed after "heads" /
    # "kv_heads", it only takes tp when they could not.
    ("head_dim", "tp"),
    ("norm", None),
)

# Decode mesh ('tp',): tensor parallelism only; FSDP would all-gather weights every step. The KV
# cache shards its kv heads over tp; when they do not divide tp (Qwen2.5: 2 kv heads on tp 4)
# it shards its slots instead ("cache_batch", listed after "kv_heads" so it only takes tp when
# the heads could not): each chip then holds and attends a quarter of the slots, where a
# head-dim split would all-gather the cache every step (measured by jaxrl-aot on
# v5e: 3.4 GB of temporaries per chip vs 1.0 GB) and replication would hold it four times.
DECODE_RULES: tuple[Rule, ...] = (
    ("batch", None),
    ("length", None),
    ("cache_length", None),
    ("layers", None),
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("cache_batch", "tp"),
    ("mlp", "tp"),
    ("embed", None),
    ("head_dim", "tp"),  # projections of non-dividing heads, as in TRAINER_RULES
    ("norm", None),
)


def _as_axes_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


def _check_rules(rules: Rules) -> None:
    for rule in rules:
        ok = (
            isinstance(rule, tuple)
            and len(rule) == 2
            and isinstance(rule[0], str)
            and (
                rule[1] is None
                or isinstance(rule[1], str)
                or (isinstance(rule[1], tuple) and all(isinstance(a, str) for a in rule[1]))
            )
        )
        if not ok:
            raise ValueError(
                f"bad sharding rule {rule!r}: expected (logical_name: str, mesh_axes: str | "
                "tuple[str, ...] | None)"
            )


def _is_logical(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _check_logical(logical: Any) -> tuple[str | None, ...]:
    if not _is_logical(logical):
        raise TypeError(
            f"logical axes must be a tuple of str | None (one entry per array dim), got {logical!r}"
        )
    return logical


def logical_to_mesh_spec(
    logical: tuple[str | None, ...],
    rules: Rules,
    *,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Maps one array's logical axes to a ``PartitionSpec`` under ``rules``.

    With ``mesh`` the rule's mesh axes are checked against the mesh's axis names, and with
    ``mesh`` and ``shape`` together a rule whose mesh-axis product does not divide the dim is
    skipped (replication fallback). Without ``mesh`` no divisibility check is possible.
    """
    logical = _check_logical(logical)
    _check_rules(rules)
    if shape is not None:
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(logical):
            raise ValueError(
                f"logical axes {logical!r} have {len(logical)} entries but the array shape "
                f"{shape} has {len(shape)} dims"
            )
    if shape is not None and mesh is None:
        raise ValueError("shape= needs mesh= too: divisibility depends on the mesh axis sizes")
    mesh_sizes = dict(mesh.shape) if mesh is not None else None

    assigned: list[tuple[str, ...] | None] = [None] * len(logical)
    used: set[str] = set()
    for name, mesh_axes in rules:
        axes = _as_axes_tuple(mesh_axes)
        if mesh_sizes is not None:
            missing = [a for a in axes if a not in mesh_sizes]
            if missing:
                raise ValueError(
                    f"rule ({name!r}, {mesh_axes!r}) names mesh axes {missing} but the mesh has "
                    f"axes {tuple(mesh_sizes)}"
                )
        for dim, dim_name in enumerate(logical):
            if dim_name != name or assigned[dim] is not None:
                continue
            if not axes:
                # An explicit "replicate" rule settles the dim; later rules cannot shard it.
                assigned[dim] = ()
                continue
            if used.intersection(axes):
                continue
            if shape is not None:
                factor = math.prod(mesh_sizes[a] for a in axes)
                if shape[dim] % factor != 0:
                    continue
            assigned[dim] = axes
            used.update(axes)

    entries: list[MeshAxes] = []
    for axes in assigned:
        if not axes:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(axes[0])
        else:
            entries.append(axes)
    return PartitionSpec(*entries)


def _shape_of(x: Any) -> tuple[int, ...]:
    if hasattr(x, "shape"):
        return tuple(x.shape)
    if isinstance(x, Sequence) and all(isinstance(d, int) for d in x):
        return tuple(x)
    raise TypeError(
        f"shapes= leaves must be arrays, jax.ShapeDtypeStruct or tuples of ints, got {x!r}"
    )


def abstract_arrays(shapes: Any, shardings: Any) -> Any:
    """``shapes`` (arrays or ShapeDtypeStructs) as ``jax.ShapeDtypeStruct``s carrying
    ``shardings``, a prefix tree of it such as ``resolve_shardings`` returns: what
    ``jit(...).lower`` takes to compile for a mesh without allocating anything."""
    lay = lambda sh, sub: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sub
    )
    return jax.tree.map(lay, shardings, shapes)


def resolve_shardings(
    logical_specs_tree: Any,
    mesh: Mesh,
    rules: Rules,
    *,
    shapes: Any = None,
) -> Any:
    """Resolves a pytree of logical axis tuples into a same-structured pytree of NamedSharding.

    Leaves of ``logical_specs_tree`` are tuples of ``str | None`` (tuples are leaves, never
    containers); containers may be dicts, lists, flax ``nnx.State`` or any registered pytree.
    ``shapes`` is an optional pytree with the same structure whose leaves are arrays,
    ``jax.ShapeDtypeStruct`` or shape tuples; when given, mesh axes that do not divide a dim fall
    back to replication for that dim.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    _check_rules(rules)
    # Every tuple is a leaf, so a malformed one is reported whole instead of being descended.
    leaves, treedef = jax.tree.flatten(logical_specs_tree, is_leaf=lambda x: isinstance(x, tuple))
    for leaf in leaves:
        _check_logical(leaf)
    if shapes is None:
        shape_leaves: list[Any] = [None] * len(leaves)
    else:
        try:
            # Flattening up to the logical tree keeps shape tuples whole at leaf positions.
            shape_leaves_raw = treedef.flatten_up_to(shapes)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"shapes= tree structure does not match the logical specs tree {treedef}: {e}"
            ) from e
        shape_leaves = [_shape_of(s) for s in shape_leaves_raw]
    shardings = [
        NamedSharding(mesh, logical_to_mesh_spec(leaf, rules, mesh=mesh, shape=shape))
        for leaf, shape in zip(leaves, shape_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, shardings)
