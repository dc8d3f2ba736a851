"""Device-to-device resharding: move a pytree of arrays onto other shardings / another mesh.

What it owns
    ``reshard(tree, dst_shardings, *, donate=False, dtype=None)``: the single path by which
    weights leave the trainer mesh for the decode mesh within one process, and
    ``reshard_cross_process(...)``: the same move when the trainer and the engine live in
    different JAX processes (multi-controller ``jax.distributed``), over the DCN socket
    transfer library (``jax_cross_host_transfer_socket_address``).

Invariants
    - Values are bit-equal after the move, or equal to ``x.astype(dtype)`` computed on the SOURCE
      devices when ``dtype`` is given: the cast happens before the transfer so that fp32 -> bf16
      halves the bytes moved. Only floating-point leaves are cast; integer leaves (step
      counters, token tables) move unchanged.
    - Every output leaf carries exactly the requested sharding.
    - ``donate=True`` deletes every source array that shares no buffer with an output, once the
      outputs are ready (``jax.device_put(donate=True)`` is only a hint on CPU, so this module
      deletes explicitly; waiting first keeps a deletion from racing an in-flight copy). A
      relayout between meshes over the same devices may return the source's own buffers; such
      sources are kept, since deleting them would delete the output. On the sending side of a
      cross-process move, arrays still being sent are likewise left to garbage collection.
    - ``dst_shardings`` is one Sharding or a pytree that is a prefix of the tree (a sharding
      where an ``nnx.State`` holds a Variable is applied to the array inside it).
    - Transfers go through ``jax.device_put`` in one batched call: a jit whose outputs sit on
      another mesh fails, and one batched call lets the runtime overlap the per-leaf copies.

Cross-process protocol (both processes call ``reshard_cross_process`` with the same tree
structure, shapes and shardings; it is a collective)
    The DCN transfer only copies shard-for-shard between shardings with identical layouts on
    different devices. So the sender first relayouts each leaf locally onto a staging sharding:
    the destination's mesh shape, axis names and spec, laid over the first devices of the
    source mesh (and casts there); then the staged array crosses processes unchanged. The
    receiver passes ``jax.ShapeDtypeStruct(shape, dtype, sharding=<source sharding>)`` leaves
    (it knows both meshes because ``jax.devices()`` spans all processes); it stages nothing.

Who drives it
    The weight watcher (trainer params -> decode shardings resolved by ``sharding.rules``),
    checkpoint restore, and the benchmark in ``benchmarks/reshard.py``.

What it must never do
    Import model or RL code, compute shardings from logical names (that is ``rules.py``), or
    silently fall back to a host round-trip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding


def _check_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"reshard dtype must be a floating-point dtype (e.g. bfloat16, float32), got {dt}"
        )
    return dt


@dataclasses.dataclass(frozen=True)
class _Group:
    sharding: Sharding
    num_leaves: int


def _flat_shardings(dst_shardings: Any, tree: Any, n: int) -> list[Sharding]:
    """One sharding per leaf of ``tree``; ``dst_shardings`` may be any prefix of the tree.

    A prefix is what ``resolve_shardings(logical_specs(state), ...)`` returns for an
    ``nnx.State``: a sharding where the state has a Variable wrapping the array.
    """
    if isinstance(dst_shardings, Sharding):
        return [dst_shardings] * n

    def count(s: Any, sub: Any) -> _Group:
        if not isinstance(s, Sharding):
            raise TypeError(f"dst_shardings leaves must be jax Shardings, got {s!r}")
        return _Group(s, jax.tree.structure(sub).num_leaves)

    try:
        groups = jax.tree.map(count, dst_shardings, tree)
    except (ValueError, KeyError) as e:
        detail = str(e)
        detail = detail if len(detail) < 600 else detail[:600] + " ..."
        raise ValueError(
            "dst_shardings must be one Sharding or a pytree whose structure is a prefix of the "
            f"tree being resharded: {detail}"
        ) from e
    # _Group is not a registered pytree, so it stays a leaf whatever containers the tree uses.
    return [g.sharding for g in jax.tree.leaves(groups) for _ in range(g.num_leaves)]


def _casts(leaves: Sequence[Any], dt: np.dtype | None) -> list[bool]:
    return [
        dt is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt for x in leaves
    ]


@partial(jax.jit, static_argnums=1)
def _astype_all(xs: list[jax.Array], dt: np.dtype) -> list[jax.Array]:
    # Elementwise, so each output keeps its input's sharding: the cast runs on the source mesh.
    return [x.astype(dt) for x in xs]


# The source-side cast as a program of its own: ``python -m jaxrl_orch.tools.aot`` lowers it to size
# the trainer-to-engine move (``cast_program.lower(leaves, dtype).compile()``).
cast_program = _astype_all


def _cast_on_source(leaves: list[Any], dt: np.dtype | None) -> list[Any]:
    which = _casts(leaves, dt)
    if not any(which):
        return list(leaves)
    idx = [i for i, c in enumerate(which) if c]
    for i in idx:
        if not isinstance(leaves[i], jax.Array):
            raise TypeError(
                f"reshard leaf {i} is a {type(leaves[i]).__name__}; casting on the source mesh "
                "needs jax.Array leaves"
            )
    cast = _astype_all([leaves[i] for i in idx], dt)
    out = list(leaves)
    for i, y in zip(idx, cast, strict=True):
        out[i] = y
    return out


def _buffer_ids(x: jax.Array) -> set[tuple[int, int]]:
    return {(sh.device.id, sh.data.unsafe_buffer_pointer()) for sh in x.addressable_shards}


def _free_sources(sources: Sequence[Any], outputs: Sequence[Any]) -> None:
    jax.block_until_ready(outputs)
    # A relayout between meshes over the same devices may hand back the source's own buffers
    # (jax forwards identity copies), so a source is only deleted when no output shares memory.
    live: set[tuple[int, int]] = set()
    for y in outputs:
        if isinstance(y, jax.Array):
            live |= _buffer_ids(y)
    seen: set[int] = set()
    for x in sources:
        if not isinstance(x, jax.Array) or id(x) in seen or x.is_deleted():
            continue
        seen.add(id(x))
        if live.isdisjoint(_buffer_ids(x)):
            x.delete()


def reshard(tree: Any, dst_shardings: Any, *, donate: bool = False, dtype: Any = None) -> Any:
    """Moves every leaf of ``tree`` onto its sharding in ``dst_shardings`` (same process).

    ``dst_shardings``: one ``Sharding`` for all leaves, or a pytree with the tree's structure
    (e.g. the output of ``sharding.rules.resolve_shardings``). ``dtype``: cast floating leaves
    on the source devices before moving. ``donate``: free the source buffers afterwards.
    """
    dt = _check_dtype(dtype)
    leaves, treedef = jax.tree.flatten(tree)
    dst = _flat_shardings(dst_shardings, tree, len(leaves))
    staged = _cast_on_source(leaves, dt)
    out = jax.device_put(staged, dst) if leaves else []
    if donate:
        # Cast intermediates are ours to free too; outputs identical to inputs are kept.
        _free_sources(
            list(leaves) + [s for s, x in zip(staged, leaves, strict=True) if s is not x], out
        )
    return jax.tree.unflatten(treedef, out)


def _staging_sharding(src: Sharding, dst: Sharding, cache: dict) -> NamedSharding:
    """The destination's layout laid over the source's first devices (see module docstring)."""
    if not isinstance(dst, NamedSharding):
        raise TypeError(
            f"cross-process reshard needs NamedSharding destinations, got {type(dst).__name__}"
        )
    key = (src, dst.mesh)
    if key not in cache:
        if isinstance(src, NamedSharding):
            src_devs = list(src.mesh.devices.flat)
        else:
            src_devs = sorted(src.device_set, key=lambda d: d.id)
        n = dst.mesh.devices.size
        if len(src_devs) < n:
            raise ValueError(
                f"cross-process reshard stages on the source devices in the destination's layout:"
                f" destination mesh {dict(dst.mesh.shape)} needs {n} devices but the source "
                f"sharding spans {len(src_devs)}"
            )
        grid = np.empty(n, dtype=object)
        grid[:] = src_devs[:n]
        cache[key] = Mesh(
            grid.reshape(dst.mesh.devices.shape),
            dst.mesh.axis_names,
            axis_types=dst.mesh.axis_types,
        )
    return NamedSharding(cache[key], dst.spec, memory_kind=dst.memory_kind)


def reshard_cross_process(
    tree: Any, dst_shardings: Any, *, donate: bool = False, dtype: Any = None
) -> Any:
    """Moves ``tree`` from the devices of one process onto ``dst_shardings`` in another.

    A collective: the sending process passes its arrays (fully addressable there), the receiving
    process passes ``jax.ShapeDtypeStruct(shape, dtype, sharding=<source sharding>)`` leaves, and
    both pass the same ``dst_shardings`` (NamedShardings). Returns, on the receiver, the arrays
    on their destination shardings; on the sender, the same arrays seen without local shards.
    Needs ``jax.distributed`` initialised and ``jax_cross_host_transfer_socket_address`` set to
    an address of this process (on CPU: a distinct explicit port per process; port 0 hangs).
    """
    if jax.process_count() < 2:
        raise RuntimeError(
            "reshard_cross_process needs jax.distributed with >= 2 processes; "
            f"jax.process_count() is {jax.process_count()} (use reshard within one process)"
        )
    if not jax.config.read("jax_cross_host_transfer_socket_address"):
        raise RuntimeError(
            "set jax.config.update('jax_cross_host_transfer_socket_address', 'HOST:PORT') "
            "before the first jax computation in every process"
        )
    dt = _check_dtype(dtype)
    leaves, treedef = jax.tree.flatten(tree)
    dst = _flat_shardings(dst_shardings, tree, len(leaves))
    cache: dict = {}
    staged: list[Any] = []
    local: list[int] = []  # leaves this process sends
    for i, (x, d) in enumerate(zip(leaves, dst, strict=True)):
        src = getattr(x, "sharding", None)
        if src is None:
            raise TypeError(
                f"cross-process reshard leaf {i} ({type(x).__name__}) has no sharding: pass "
                "jax.Array on the sender and jax.ShapeDtypeStruct(..., sharding=...) on the "
                "receiver"
            )
        stage = _staging_sharding(src, d, cache)
        if isinstance(x, jax.Array):
            if not x.is_fully_addressable:
                raise ValueError(
                    f"cross-process reshard leaf {i}: the sender must hold every shard of its "
                    f"source locally, but its sharding spans processes "
                    f"{sorted({dev.process_index for dev in src.device_set})}"
                )
            local.append(i)
            staged.append(stage)  # replaced by the relayout below
        elif isinstance(x, jax.ShapeDtypeStruct):
            if any(dev.process_index == jax.process_index() for dev in src.device_set):
                raise ValueError(
                    f"cross-process reshard leaf {i}: a ShapeDtypeStruct placeholder names a "
                    "source sharding on this process's own devices; pass the array instead"
                )
            cast = dt is not None and jnp.issubdtype(x.dtype, jnp.floating)
            staged.append(
                jax.make_array_from_single_device_arrays(
                    x.shape, stage, [], dtype=dt if cast else x.dtype
                )
            )
        else:
            raise TypeError(
                f"cross-process reshard leaf {i} must be a jax.Array or jax.ShapeDtypeStruct, "
                f"got {type(x).__name__}"
            )
    if local:
        # The sender casts and relayouts locally, in one batched call, so that only same-layout
        # shard-for-shard copies cross processes.
        sources = [leaves[j] for j in local]
        cast_in = _cast_on_source(sources, dt)
        moved = jax.device_put(cast_in, [staged[j] for j in local])
        for j, y in zip(local, moved, strict=True):
            staged[j] = y
        if donate:
            # Staged arrays are still being sent and are never deleted here; sources that share
            # buffers with them are kept alive by _free_sources' aliasing check.
            extra = [c for c, x in zip(cast_in, sources, strict=True) if c is not x]
            _free_sources(sources + extra, moved)
    out = jax.device_put(staged, dst) if leaves else []
    return jax.tree.unflatten(treedef, out)
