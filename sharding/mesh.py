"""Device meshes: split the available devices into a trainer mesh and a decode mesh.

What it owns
    ``make_meshes(decode_shape, trainer_shape, devices=None, colocated=False)``, the only place
    that decides which physical devices the trainer and the decoding engine run on, and the axis
    names of each mesh: trainer ``("fsdp", "tp")``, decode ``("tp",)``.

Invariants
    - Split mode (default): the trainer mesh takes the first ``prod(trainer_shape)`` devices and
      the decode mesh the next ``prod(decode_shape)``; the two never share a device, so decoding
      and training overlap in time. Devices beyond both are left unused.
    - Colocated mode: both meshes are views of the same devices (sizes must be equal); trainer
      and engine then time-share memory and compute, and resharding is an on-device relayout.
    - Devices are ordered by (process index, device id) before splitting, so with several
      processes each mesh stays on as few processes as its size allows (a 4-device mesh on a
      2x4-device job lands on one process) and the innermost ("tp") axis runs over neighbouring
      devices of one process.
    - Axis sizes are positive ints; an axis left out of a shape has size 1, so every mesh always
      carries all its axis names and rule tables can name them unconditionally.

Who drives it
    The entry point builds the meshes once at start-up and hands the trainer its mesh and the
    engine its mesh; nothing rebuilds meshes mid-run.

What it must never do
    Import model or RL code, allocate arrays, or silently shrink a requested mesh: shapes that
    do not fit the devices raise a ValueError naming the shapes and the device count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

TRAINER_AXES: tuple[str, ...] = ("fsdp", "tp")
DECODE_AXES: tuple[str, ...] = ("tp",)


def _normalize_shape(shape: Mapping[str, int], axes: tuple[str, ...], what: str) -> dict[str, int]:
    if not isinstance(shape, Mapping):
        raise TypeError(f"{what} mesh shape must be a dict of axis -> size, got {shape!r}")
    unknown = [k for k in shape if k not in axes]
    if unknown:
        raise ValueError(
            f"{what} mesh shape {dict(shape)} has unknown axes {unknown}; allowed axes: {axes}"
        )
    out = {}
    for axis in axes:
        size = shape.get(axis, 1)
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(
                f"{what} mesh shape {dict(shape)}: axis {axis!r} size must be a positive int, "
                f"got {size!r}"
            )
        out[axis] = int(size)
    return out


def _ordered_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("make_meshes got an empty device list")
    if len({d.id for d in devs}) != len(devs):
        raise ValueError(f"make_meshes got duplicate devices: {[d.id for d in devs]}")
    # Grouping by process keeps each mesh's collectives local where the sizes allow it.
    return sorted(devs, key=lambda d: (d.process_index, d.id))


def _build(devs: list[jax.Device], shape: dict[str, int], axes: tuple[str, ...]) -> Mesh:
    grid = np.empty(len(devs), dtype=object)
    grid[:] = devs
    return Mesh(grid.reshape(tuple(shape[a] for a in axes)), axes)


def make_meshes(
    decode_shape: Mapping[str, int],
    trainer_shape: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    colocated: bool = False,
) -> tuple[Mesh, Mesh]:
    """Builds ``(decode_mesh, trainer_mesh)`` from axis-size dicts.

    ``decode_shape`` keys are from ``("tp",)``, ``trainer_shape`` keys from ``("fsdp", "tp")``;
    missing axes have size 1. ``devices`` defaults to ``jax.devices()`` (all processes).
    """
    dshape = _normalize_shape(decode_shape, DECODE_AXES, "decode")
    tshape = _normalize_shape(trainer_shape, TRAINER_AXES, "trainer")
    n_dec = math.prod(dshape.values())
    n_tr = math.prod(tshape.values())
    devs = _ordered_devices(devices)
    have = len(devs)
    desc = f"trainer mesh {tshape} ({n_tr} devices) + decode mesh {dshape} ({n_dec} devices)"
    if colocated:
        if n_dec != n_tr:
            raise ValueError(
                f"colocated {desc}: a colocated mesh needs both on the same devices, so the "
                "sizes must be equal"
            )
        if n_tr > have:
            raise ValueError(f"colocated {desc} need {n_tr} devices, have {have}")
        shared = devs[:n_tr]
        return _build(shared, dshape, DECODE_AXES), _build(shared, tshape, TRAINER_AXES)
    if n_tr + n_dec > have:
        raise ValueError(f"{desc} need {n_tr + n_dec} devices, have {have}")
    trainer_devs = devs[:n_tr]
    decode_devs = devs[n_tr : n_tr + n_dec]
    return _build(decode_devs, dshape, DECODE_AXES), _build(trainer_devs, tshape, TRAINER_AXES)
