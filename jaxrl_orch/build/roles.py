"""What each process of a multi-process run is (DESIGN.md section 8), besides trainer process 0.

What it owns
    ``placement(cfg, role)``: the meshes of a role. A trainer process: the trainer mesh over
    every device of the group (``fsdp`` over all by default) and a decode mesh shaped like a
    replica's (its default: ``tp`` over one host's devices), used only for its layout. An engine
    replica: the decode mesh over its own devices.
    ``serve_replica``: an engine replica's whole life: the built engine behind the HTTP
    contract (``distributed.replica``) at the host and port of its own URL, pulling weights only
    from the run's ``--weight_source``, until SIGTERM / SIGINT. ``check_bind``: refuses, before
    any work, a replica URL beyond loopback without an API key.
    ``follow``: a peer trainer process's RL stage: the leader's commands, in lockstep, until
    the leader's STOP (the run ended) or ABORT (it failed: this process fails too).

Trainer process 0's wiring for replicas is ``sides.LeaderSide``. Checkpoints in a group are
collective (orbax writes each process's shards): the leader sends CHECKPOINT with the
orchestrator's state, then every process saves the same step.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_orch.build.adapters import GroupStaging, final_policy
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.addresses import Replicas, bind_of
from jaxrl_orch.distributed.group import (
    ABORT,
    CHECKPOINT,
    STOP,
    TRAIN,
    Channel,
    GroupAborted,
    Role,
)
from jaxrl_orch.distributed.replica import replica_server, serve_until_signal
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.serving.runner import HttpServer
from jaxrl_orch.trainer.checkpoint import Checkpointer, save_trainer
from sharding.mesh import make_meshes


def placement(cfg: TrainConfig, role: Role) -> tuple[bool, Any, Any]:
    """(colocated, decode mesh, trainer mesh) of a multi-process role (see the docstring)."""
    local = jax.local_devices()
    decode_shape = dict(cfg.engine.mesh) or {"tp": len(local)}
    size = int(np.prod(list(decode_shape.values())))
    if role.kind == "trainer" and size > len(local):
        # Staged on this host in a smaller layout; replicas reshard it on their own devices.
        decode_shape, size = {"tp": len(local)}, len(local)
    # A replica's decode mesh, on this process's devices (a trainer only reads its layout).
    decode, _ = make_meshes(decode_shape, {"fsdp": size}, devices=local, colocated=True)
    if role.kind == "engine":
        return False, decode, None
    trainer_shape = dict(cfg.trainer.mesh) or {"fsdp": len(jax.devices())}
    n = int(np.prod(list(trainer_shape.values())))
    _, trainer = make_meshes({"tp": n}, trainer_shape, colocated=True)
    return False, decode, trainer


def check_bind(replicas: Replicas, role: Role) -> None:
    """An engine replica's URL must be loopback unless the run gives an API key."""
    host, _ = bind_of(replicas.urls[role.replica])
    HttpServer.check_bind(host, replicas.api_key)


def serve_replica(
    cfg: TrainConfig, engine: Any, role: Role, replicas: Replicas, adapters: Any = None
) -> dict[str, Any]:
    """Serve ``engine`` at this replica's URL until SIGTERM / SIGINT (the launcher's stop).
    ``adapters``: a LoRA run's adapter tree (``build.run.rl_adapters``), else None."""
    url = replicas.urls[role.replica]
    host, server = replica_server(
        engine,
        replica=role.replica,
        model=cfg.model.name,
        bind=bind_of(url),
        weight_source=replicas.weight_source,
        api_key=replicas.api_key,
        warm_up=cfg.engine.warmup,
        lora=None if adapters is None else (adapters, cfg.lora.alpha / cfg.lora.rank),
    )
    where = f"{role.describe()} at {url}, weights from {replicas.weight_source}"
    stage("engine replica", f"{where}, {len(jax.local_devices())} devices")
    asyncio.run(serve_until_signal(host, server))
    return {"role": role.describe()}


def follow(trainer: Any, ckpt: Checkpointer, staging: GroupStaging) -> dict[str, Any]:
    """A peer's RL stage: take every step, stage and checkpoint the leader takes, until STOP
    (or ABORT: the leader failed, and this process fails with its reason)."""
    channel = Channel(leader=False)
    staging.first(trainer)  # what the replicas load first
    steps = 0
    while True:
        cmd, body, arrays = channel.receive()
        if cmd == TRAIN:
            trainer.follow(arrays)
            steps += 1
            staging.version(trainer.params)
        elif cmd == CHECKPOINT:
            save_trainer(ckpt, trainer, int(body["step"]), body["state"])
            ckpt.wait()
        elif cmd == STOP:
            multihost_utils.process_allgather(final_policy(trainer), tiled=True)
            return {"role": f"trainer process {jax.process_index()}", "steps": steps}
        elif cmd == ABORT:
            raise GroupAborted(f"trainer process 0 stopped the run: {body['reason']}")
