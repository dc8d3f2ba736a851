"""Where the engine and the trainer run: their meshes, and whether they share devices.

What it owns: ``Placement`` and the two ways to get one. ``build_placement`` splits one
process's devices into a decode mesh and a trainer mesh (or shares them, ``colocated``);
``group_placement`` gives a process of a multi-process run its meshes: a trainer process the
trainer mesh over every device of the group (``fsdp`` over all by default) and a decode mesh
shaped like a replica's (``tp`` over one host's devices), used only for its layout; an engine
replica the decode mesh over its own devices. An impossible shape fails here, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.group import Role
from sharding.mesh import make_meshes


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the engine and the trainer run: their meshes, and whether they share devices.
    ``trainer_mesh`` is None on an engine replica (it trains nothing)."""

    colocated: bool
    decode_mesh: Mesh
    trainer_mesh: Mesh | None


def build_placement(cfg: TrainConfig, n_devices: int, devices: Any = None) -> Placement:
    """One process's placement: with one device (or ``colocated``) engine and
    trainer share every device; otherwise they split them (trainer fsdp, decode tp) unless the
    config names both meshes. An impossible shape fails here, naming it. ``devices``: default
    ``jax.devices()``; ``python -m jaxrl_orch.tools.aot`` passes a TPU topology's."""
    colocated = (n_devices == 1) if cfg.processes.colocated is None else cfg.processes.colocated
    half = n_devices if colocated else n_devices // 2
    trainer_shape = dict(cfg.trainer.mesh) or {"fsdp": half}
    decode_shape = dict(cfg.engine.mesh) or {"tp": n_devices if colocated else n_devices - half}
    decode_mesh, trainer_mesh = make_meshes(
        decode_shape, trainer_shape, devices=devices, colocated=colocated
    )
    return Placement(colocated, decode_mesh, trainer_mesh)


def group_placement(cfg: TrainConfig, role: Role) -> Placement:
    """The placement of a process of a multi-process run (see the module docstring)."""
    local = jax.local_devices()
    decode_shape = dict(cfg.engine.mesh) or {"tp": len(local)}
    size = int(np.prod(list(decode_shape.values())))
    if role.kind == "trainer" and size > len(local):
        # Staged on this host in a smaller layout; replicas reshard it on their own devices.
        decode_shape = {"tp": len(local)}
        size = len(local)
    # A replica's decode mesh, on this process's devices (a trainer only reads its layout).
    decode, _ = make_meshes(decode_shape, {"fsdp": size}, devices=local, colocated=True)
    if role.kind == "engine":
        return Placement(False, decode, None)
    trainer_shape = dict(cfg.trainer.mesh) or {"fsdp": len(jax.devices())}
    n = int(np.prod(list(trainer_shape.values())))
    _, trainer = make_meshes({"tp": n}, trainer_shape, colocated=True)
    return Placement(False, decode, trainer)
