"""What each process of a multi-process run builds (DESIGN.md section 8), for ``Experiment``.

What it owns
    ``placement(cfg, role)``: the meshes of a role. A trainer process: the trainer mesh over
    every device of the group (``fsdp`` over all by default) and a decode mesh shaped like a
    replica's (its default: ``tp`` over one host's devices), used only for its layout. An engine
    replica: the decode mesh over its own devices.
    ``serve_replica``: an engine replica's whole life (``remote.server.ReplicaServer`` on the
    built engine), until SIGTERM / SIGINT.
    ``LeaderWiring``: on trainer process 0, what replaces the in-process engine: the
    ``group.EngineStager`` that lays every version out in a replica's layout, the
    ``remote.weights.WeightOffer`` replicas pull it from, the ``remote.pool.RemotePool`` the
    orchestrator dispatches to, and (group of P > 1) the ``group.Channel`` that hands each batch
    and checkpoint to the peers.
    ``follow``: a peer trainer process's RL stage: the leader's commands, in lockstep.

Checkpoints in a group are collective (orbax writes each process's shards): the leader sends
CHECKPOINT with the orchestrator's state, then every process saves the same step.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_orch.build.engines import to_engine
from jaxrl_orch.build.overlap import OverlapSchedule
from jaxrl_orch.build.weights import WeightPath
from jaxrl_orch.distributed.group import CHECKPOINT, STOP, TRAIN, Channel, EngineStager, Role
from jaxrl_orch.distributed.pool import RemotePool
from jaxrl_orch.distributed.server import ReplicaServer
from jaxrl_orch.distributed.transfer import WeightOffer
from jaxrl_orch.inference.client import ClientPool, EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.trainer.checkpoint import save_trainer
from sharding.mesh import make_meshes


def placement(cfg: Any, role: Role) -> tuple[bool, Any, Any]:
    """(colocated, decode mesh, trainer mesh) of a multi-process role (see the docstring)."""
    local = jax.local_devices()
    decode_shape = dict(cfg.decode_mesh) or {"tp": len(local)}
    size = int(np.prod(list(decode_shape.values())))
    if role.kind == "trainer" and size > len(local):
        # Staged on this host in a smaller layout; replicas reshard it on their own devices.
        decode_shape, size = {"tp": len(local)}, len(local)
    # A replica's decode mesh, on this process's devices (a trainer only reads its layout).
    decode, _ = make_meshes(decode_shape, {"fsdp": size}, devices=local, colocated=True)
    if role.kind == "engine":
        return False, decode, None
    trainer_shape = dict(cfg.trainer_mesh) or {"fsdp": len(jax.devices())}
    n = int(np.prod(list(trainer_shape.values())))
    _, trainer = make_meshes({"tp": n}, trainer_shape, colocated=True)
    return False, decode, trainer


def serve_replica(exp: Any, role: Role, address: str) -> dict[str, Any]:
    """Serve the engine at ``address`` until SIGTERM / SIGINT (the launcher's stop)."""
    engine = exp.make_engine()
    server = ReplicaServer(
        engine,
        address=address,
        replica=role.replica,
        pull_timeout_s=exp.cfg.weight_pull_timeout_s,
        warm_up=exp.cfg.engine_warmup,
    )
    stage("engine replica", f"{role.describe()} on {address}, {len(jax.local_devices())} devices")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serving = asyncio.ensure_future(server.serve())
        await asyncio.wait(
            [serving, asyncio.ensure_future(stop.wait())], return_when="FIRST_COMPLETED"
        )
        await server.stop()
        if serving.done() and serving.exception() is not None:
            raise serving.exception()

    asyncio.run(main())
    return {"role": role.describe()}


class LeaderWiring:
    """Trainer process 0's parts for engine replicas (see the module docstring)."""

    def __init__(
        self, exp: Any, trainer: Any, engine: Any, role: Role, engine_addresses: list[str]
    ) -> None:
        cfg = exp.cfg
        if len(engine_addresses) != cfg.engine_replicas:
            raise ValueError(
                f"--engine_addresses names {len(engine_addresses)} replicas, the config has "
                f"engine_replicas={cfg.engine_replicas}"
            )
        # ``engine`` never runs here: its shardings and weight dtype are a replica's.
        self.stager = make_stager(trainer, engine)
        self.channel = Channel(leader=True) if role.trainer_processes > 1 else None
        if self.channel is not None:
            trainer.on_batch = lambda arrays: self.channel.send(TRAIN, {}, arrays)
        self.offer = WeightOffer()
        self.pool = RemotePool(
            engine_addresses,
            self.offer,
            request_timeout_s=cfg.env_timeout_s,
            pull_timeout_s=cfg.weight_pull_timeout_s,
        )
        # Every load names the staged layout: a replica whose decode mesh differs (its host has
        # more devices than a trainer host) pulls in it and reshards on its own devices.
        self.pool.layout = self.stager.transfer_layout()

    def move(self, params: Any) -> Any:
        """Trainer thread, after every step: the collective stage, then this process's copy."""
        return self.stager.local(self.stager.stage(params))

    def before_save(self, step: int, orchestrator_state: dict[str, Any]) -> None:
        if self.channel is not None:
            self.channel.send(CHECKPOINT, {"step": step, "state": orchestrator_state})

    def stop_peers(self, trainer: Any) -> Any:
        """The peers leave their loop; returns the final params gathered to every process
        (the export writes them from here)."""
        if self.channel is None:
            return trainer.params
        self.channel.send(STOP, {})
        return multihost_utils.process_allgather(trainer.params, tiled=True)


def engine_side(exp: Any, engine: Any, trainer: Any, path_kw: dict[str, Any]):
    """What the RL stage dispatches to and moves weights into: ``(driver, wiring, weight path,
    pool)``; the engine in this process (a driver, no wiring) or the replicas (wiring)."""
    if exp.role.kind == "single":
        # The engine starts on the trainer's weights: after a resume, the restored ones.
        first = jax.tree.map(jnp.copy, trainer.params) if exp.colocated else trainer.params
        exp.overlap = schedule = overlap_schedule(exp.cfg, exp.colocated)
        driver = InferenceDriver(
            engine, to_engine(first, engine), trainer.version, gate=schedule.engine_may_run
        )
        trainer.around_step = schedule.training
        if exp.cfg.engine_warmup:
            stage(
                "engine", f"warm-up: every prompt bucket and decode width, {driver.warm_up():.1f} s"
            )
        dtype = getattr(engine, "param_dtype", None)
        weights = WeightPath.in_process(trainer, driver, engine.param_shardings, dtype, **path_kw)
        return driver, None, weights, ClientPool([EngineClient(driver)])
    wiring = LeaderWiring(exp, trainer, engine, exp.role, exp.engine_addresses)
    pool = wiring.pool
    weights = WeightPath(trainer, wiring.move, pool.load_weights, pool.engine_seconds, **path_kw)
    return None, wiring, weights, wiring.pool


def overlap_schedule(cfg: Any, colocated: bool) -> OverlapSchedule:
    """``auto`` measures only where engine and trainer share cores (a CPU host, or one set of
    devices); separate chips always overlap. Synchronous runs never overlap anyway."""
    if cfg.max_staleness == 0:
        schedule = OverlapSchedule("overlapped")  # the engine never waits: nothing to time
        schedule.decision = {"mode": "synchronous"}
        return schedule
    mode = cfg.overlap
    if mode == "auto" and not (colocated or jax.default_backend() == "cpu"):
        mode = "overlapped"
    return OverlapSchedule(mode, announce=lambda line: stage("overlap", line))


def make_stager(trainer: Any, layout_engine: Any) -> EngineStager:
    return EngineStager(trainer.mesh, layout_engine.param_shardings, layout_engine.param_dtype)


def follow(exp: Any, trainer: Any, ckpt: Any, stager: EngineStager) -> dict[str, Any]:
    """A peer's RL stage: take every step, stage and checkpoint the leader takes, until STOP."""
    channel = Channel(leader=False)
    stager.stage(trainer.params)  # the first version the replicas load
    steps = 0
    while True:
        cmd, body, arrays = channel.receive()
        if cmd == TRAIN:
            trainer.step_arrays(arrays)
            trainer.version += 1
            steps += 1
            stager.stage(trainer.params)
        elif cmd == CHECKPOINT:
            save_trainer(ckpt, trainer, int(body["step"]), body["state"])
            ckpt.wait()
        elif cmd == STOP:
            multihost_utils.process_allgather(trainer.params, tiled=True)
            return {"role": f"trainer process {jax.process_index()}", "steps": steps}
