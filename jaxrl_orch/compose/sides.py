"""Where the RL stage's engine lives: in this process, or behind engine replicas.

What it owns: the two engine sides the RL stage drives through one interface (the
``weights.EngineSide`` hops plus their lifecycle): ``pool`` (what the orchestrator dispatches
to), ``move`` / ``swap`` / ``engine_seconds`` (the weight path's hops), ``start`` / ``stop``,
``before_save`` (what a checkpoint must tell the others first), ``final_params`` (what the
export writes: ``compose.staging.final_policy``), ``abort`` (the stage failed: what the others
must be told), ``gauge_source`` and ``summary`` (the summary's keys of this side).

``InProcessSide``: the engine on this process's decode mesh, run by an ``InferenceDriver``;
weights move by a device-to-device reshard (cast to the engine's dtype on the trainer's devices
first) and swap in between two decode steps. The overlap schedule (``overlap``) decides whether
the engine pauses while the trainer steps; it is given to the trainer as its step hook.

``LeaderSide``: trainer process 0 with engine replicas (DESIGN.md section 8): the
``GroupStaging`` lays every version out in a replica's layout (a LoRA run: the frozen base once,
then only the adapters, which each replica merges into it), the ``WeightOffer`` offers it on
the run's ``--weight_source`` (the one address every replica pulls from), the ``RemotePool``
dispatches over the replicas' HTTP API and has every replica pull it; with a trainer group of
P > 1 the ``Channel`` hands each batch (the trainer's ``on_batch`` hook) and checkpoint to the
peers.

Never: builds the trainer or the orchestrator (the RL stage does), or sets a hook on a part.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from jaxrl_orch.compose.engines import to_engine
from jaxrl_orch.compose.overlap import OverlapSchedule
from jaxrl_orch.compose.staging import (
    AdapterMerge,
    GroupStaging,
    final_policy,
    lora_line,
    tree_nbytes,
)
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.addresses import Replicas, host_port
from jaxrl_orch.distributed.group import CHECKPOINT, STOP, TRAIN, Channel
from jaxrl_orch.distributed.pool import RemotePool
from jaxrl_orch.distributed.transfer import WeightOffer
from jaxrl_orch.inference.client import ClientPool, EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.trainer.trainer import StepHooks
from sharding.reshard import reshard


class InProcessSide:
    """See the module docstring. Built before the trainer: ``hooks`` go to its constructor."""

    def __init__(self, engine: Any, schedule: OverlapSchedule, engine_warmup: bool) -> None:
        self.engine, self.schedule = engine, schedule
        self._warm_up = engine_warmup
        self.driver: InferenceDriver | None = None  # attach: it starts on the trainer's params
        self.pool: ClientPool | None = None
        self.hooks = StepHooks(around_step=schedule.training)
        self.adapters: AdapterMerge | None = None  # a LoRA run: the base lives on the engine
        self.bytes_moved = 0  # what the last version moved from the trainer's devices

    def attach(self, trainer: Any, colocated: bool) -> None:
        """The driver on the trainer's current weights (after a resume: the restored ones)."""
        if trainer.frozen is not None:
            lora = trainer.config.lora
            self.adapters = AdapterMerge(self.engine, trainer.dense_base(), lora.scale)
            first = self.adapters.move(trainer.params)
            where = "stays on the engine"
            stage("weights", lora_line(lora, self.adapters.bytes_moved, self.adapters.base, where))
        else:
            first = jax.tree.map(jnp.copy, trainer.params) if colocated else trainer.params
            first = to_engine(first, self.engine)
        self.driver = InferenceDriver(
            self.engine,
            first,
            trainer.version,
            gate=self.schedule.engine_may_run,
        )
        self.pool = ClientPool([EngineClient(self.driver)])
        if self._warm_up:
            secs = self.driver.warm_up()
            stage("engine", f"warm-up: every prompt bucket and decode width, {secs:.1f} s")

    def move(self, params: Any) -> Any:
        if self.adapters is not None:
            moved = self.adapters.move(params)
            self.bytes_moved = self.adapters.bytes_moved
            return moved
        dtype = getattr(self.engine, "param_dtype", None)
        moved = jax.block_until_ready(reshard(params, self.engine.param_shardings, dtype=dtype))
        self.bytes_moved = tree_nbytes(moved)  # cast to the engine's dtype before the move
        return moved

    async def swap(self, version: int, params: Any) -> None:
        await asyncio.wrap_future(self.driver.swap_params(params, version))

    def engine_seconds(self) -> float:
        g = self.driver.gauges()
        return g["inference/prefill_s"] + g["inference/decode_s"]

    async def start(self, trainer: Any) -> None:
        self.driver.start()

    async def stop(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    def before_save(self, step: int, orchestrator_state: dict[str, Any]) -> None:
        """One process: nobody else saves."""

    def final_params(self, trainer: Any) -> dict[str, Any]:
        return final_policy(trainer)

    def abort(self, reason: str) -> None:
        """One process: nobody else to tell."""

    @property
    def gauge_source(self) -> Any:
        return self.driver

    def summary(self) -> dict[str, Any]:
        return {"overlap": self.schedule.decision}


class LeaderSide:
    """See the module docstring. ``engine`` never runs here: its shardings and weight dtype
    are a replica's (``roles.placement`` built its mesh like one)."""

    def __init__(
        self,
        cfg: TrainConfig,
        engine: Any,
        trainer_mesh: Any,
        replicas: Replicas,
        adapters: Any = None,
    ) -> None:
        if replicas.weight_source is None:
            raise ValueError("engine replicas need --weight_source=HOST:PORT to pull weights from")
        self.staging = GroupStaging(trainer_mesh, engine, adapters)
        self.channel = Channel(leader=True) if cfg.processes.trainer_processes > 1 else None
        on_batch = None if self.channel is None else self._send_batch
        self.hooks = StepHooks(on_batch=on_batch)
        self.offer = WeightOffer(*host_port(replicas.weight_source))
        self.pool = RemotePool(
            replicas.urls,
            self.offer,
            cfg.processes,
            api_key=replicas.api_key,
            # Every load names the staged layout: a replica whose decode mesh differs (its host
            # has more devices than a trainer host) pulls in it and reshards on its own devices.
            layout=self.staging.layout,
            base_layout=self.staging.base_layout,
        )
        self._watch: asyncio.Future | None = None
        self.bytes_moved = 0  # what each replica pulls per version

    def _send_batch(self, arrays: dict[str, Any]) -> None:
        self.channel.send(TRAIN, {}, arrays)

    def move(self, params: Any) -> Any:
        """Trainer thread, after every step: the collective stage, then this process's copy."""
        local = self.staging.version(params)
        self.bytes_moved = tree_nbytes(local)
        return local

    async def swap(self, version: int, params: Any) -> None:
        await self.pool.load_weights(version, params)

    def engine_seconds(self) -> float:
        return self.pool.engine_seconds()

    async def start(self, trainer: Any) -> None:
        """Every replica holds the trainer's current weights before the first rollout."""
        base, first = self.staging.first(trainer)
        self.bytes_moved = tree_nbytes(first)
        if base is not None:
            lora = trainer.config.lora
            where = "is pulled once by each replica"
            stage("weights", lora_line(lora, self.bytes_moved, base, where))
        await self.pool.start(trainer.version, first, base=base)
        self._watch = asyncio.ensure_future(self.pool.watch())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            await self.pool.close()

    def before_save(self, step: int, orchestrator_state: dict[str, Any]) -> None:
        """A trainer group: every process saves this step (orbax writes each one's shards)."""
        if self.channel is not None:
            self.channel.send(CHECKPOINT, {"step": step, "state": orchestrator_state})

    def final_params(self, trainer: Any) -> dict[str, Any]:
        """The peers leave their loop; the final policy gathered to every process."""
        if self.channel is None:
            return final_policy(trainer)
        self.channel.send(STOP, {})
        self.channel = None  # the peers have left their loop: nothing more to send them
        return multihost_utils.process_allgather(final_policy(trainer), tiled=True)

    def abort(self, reason: str) -> None:
        """The stage failed with the trainer thread idle: the peers leave their loop too."""
        if self.channel is not None:
            channel, self.channel = self.channel, None
            channel.abort(reason)

    @property
    def gauge_source(self) -> Any:
        return self.pool

    def summary(self) -> dict[str, Any]:
        replicas = {k.split("/")[1]: v for k, v in self.pool.gauges().items()}
        return {"overlap": None, "replicas": replicas}
