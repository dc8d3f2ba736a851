"""Where the RL stage's engine lives: one declared interface, two sides, chosen by placement.

What it owns
    ``EngineSide``: everything the RL stage asks of the engine's side, declared once and
    implemented in full by both sides: ``pool`` (what the orchestrator dispatches to), the
    weight path's hops (``move`` on the trainer's thread, ``swap`` on the event loop,
    ``bytes_moved``, ``engine_seconds``), the lifecycle (``start``, ``stop``), what a
    checkpoint, the export and a failure must tell others (``before_save``, ``final_params``,
    ``abort``), its numbers (``gauges``, ``summary``) and ``held()``: what holds the engine
    back that the run did not do (a caller's pause on the live server), for a stall error;
    ``live_url()``: where the live server answers, for the harness evals (``run.harness_eval``).
    ``side_plan(parts, built)``: the factory. It picks the side from the run's placement (one
    process: ``InProcessPlan``; trainer process 0 with engine replicas: ``ReplicaPlan``) and
    builds first what the trainer must be constructed with (its ``StepHooks``: the overlap
    schedule's, or the trainer group's batch broadcast); ``plan.side(trainer)`` then builds the
    side from the trainer, on its current (restored) weights. That is the whole build order:
    plan and hooks, trainer, side. Nothing is attached to a part after it is built.

``InProcessSide``: the engine on this process's decode mesh, run by an ``InferenceDriver``;
weights move by a device-to-device reshard (cast to the engine's dtype on the trainer's devices
first; a LoRA run moves only its adapters, merged into the base the engine holds) and swap in
between two decode steps. With ``Engine.serve_port`` it also serves the policy being trained
(``live``). ``ReplicaSide``: trainer process 0 with engine replicas (docs/scale-out.md): the
``GroupStaging`` lays every version out in a replica's layout, the weight offer
(``offer_server.open_offer``, as ``Processes.weight_transport`` says) offers it on
``--weight_source``, the ``RemotePool`` dispatches over the replicas' HTTP API and has every
replica pull it; with a trainer group (P > 1) the group's ``Channel`` hands each batch and
checkpoint to the peers. A peer of the group has no engine side: it follows the leader
(``compose.peer``).

Never: builds the orchestrator (the RL stage does), or reads a setting the stage could hand it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from jaxrl_orch.compose.engines import BuiltEngine, to_engine
from jaxrl_orch.compose.overlap import OverlapSchedule, schedule_for
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.compose.staging import (
    AdapterMerge,
    GroupStaging,
    final_policy,
    lora_line,
    tree_nbytes,
)
from jaxrl_orch.distributed.addresses import Replicas
from jaxrl_orch.distributed.group import CHECKPOINT, STOP, TRAIN, Channel
from jaxrl_orch.inference.client import ClientPool, EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine_api import RLEngine
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.trainer.trainer import StepHooks, Trainer
from jaxrl_orch.types import InferencePool

if TYPE_CHECKING:  # what a replica run imports when it starts (ReplicaSide)
    from jaxrl_orch.compose.live import LivePolicy
    from jaxrl_orch.distributed.admission import JoinDesk
    from jaxrl_orch.distributed.offer_wire import Offerer
    from jaxrl_orch.distributed.pool import RemotePool
from sharding.reshard import reshard


class EngineSide(Protocol):
    """See the module docstring."""

    pool: InferencePool
    bytes_moved: int  # what the last ``move`` took off the trainer's devices

    def move(self, params: Any) -> Any: ...

    async def swap(self, version: int, params: Any) -> None: ...

    def engine_seconds(self) -> float: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def before_save(self, step: int, orchestrator_state: dict[str, Any]) -> None: ...

    def final_params(self) -> dict[str, Any]: ...

    def abort(self, reason: str) -> None: ...

    def gauges(self) -> dict[str, float]: ...

    def summary(self) -> dict[str, Any]: ...

    def held(self) -> str | None: ...

    def live_url(self) -> str | None: ...


class SidePlan(Protocol):
    """What the trainer is built with (``hooks``), then the side built from the trainer."""

    hooks: StepHooks

    def side(self, trainer: Trainer) -> EngineSide: ...


def side_plan(parts: RunParts, built: BuiltEngine) -> SidePlan:
    """The engine side's plan for this process's placement (see the module docstring)."""
    role = parts.role
    if role.kind == "single":
        return InProcessPlan(parts, built.engine)
    if role.leader:
        return ReplicaPlan(parts, built.engine)
    raise ValueError(f"{role.describe()} has no engine side: it follows the group's leader")


class InProcessPlan:
    """One process: the overlap schedule first (the trainer's step hook), then the side."""

    def __init__(self, parts: RunParts, engine: RLEngine) -> None:
        cfg = parts.cfg
        self.parts = parts
        self.engine = engine
        self.schedule = schedule_for(
            cfg.orchestrator.synchronous,
            cfg.engine.overlap,
            parts.placement.colocated,
            jax.default_backend(),
        )
        self.hooks = StepHooks(around_step=self.schedule.training)

    def side(self, trainer: Trainer) -> InProcessSide:
        return InProcessSide(self.parts, self.engine, self.schedule, trainer)


class InProcessSide:
    """See the module docstring. The driver starts on the trainer's current weights (after a
    resume: the restored ones), so no rollout comes from older ones."""

    def __init__(
        self, parts: RunParts, engine: RLEngine, schedule: OverlapSchedule, trainer: Trainer
    ) -> None:
        self.parts = parts
        self.engine = engine
        self.schedule = schedule
        self.trainer = trainer
        self.adapters: AdapterMerge | None = None
        self.bytes_moved = 0
        self.driver = InferenceDriver(
            engine, self._first_weights(), trainer.version, gate=schedule.engine_may_run
        )
        self.pool = ClientPool([EngineClient(self.driver)])
        self._live: LivePolicy | None = None

    def _first_weights(self) -> Any:
        trainer = self.trainer
        if trainer.frozen is not None:  # LoRA: the base placed on the engine once
            lora = trainer.config.lora
            self.adapters = AdapterMerge(self.engine, trainer.dense_base(), lora.scale)
            first = self.adapters.move(trainer.params)
            line = lora_line(
                lora, self.adapters.bytes_moved, self.adapters.base, "stays on the engine"
            )
            stage("weights", line)
            return first
        if self.parts.placement.colocated:  # the next step donates the trainer's own arrays
            return to_engine(jax.tree.map(jnp.copy, trainer.params), self.engine)
        return to_engine(trainer.params, self.engine)

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

    async def start(self) -> None:
        """Warm the engine up (every prompt bucket and decode width compiled before the first
        rollout), start its driver, and serve it when ``Engine.serve_port`` says so."""
        cfg = self.parts.cfg
        if cfg.engine.warmup:
            secs = self.driver.warm_up()
            stage("engine", f"warm-up: every prompt bucket and decode width, {secs:.1f} s")
        self.driver.start()
        if cfg.engine.serve_port is not None:
            # Imported when a port is asked for: a run without one does not load the HTTP stack.
            from jaxrl_orch.compose.live import serve_live_policy

            self._live = serve_live_policy(cfg, self.engine, self.driver, self.parts.tokenizer)

    async def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
        self.driver.stop()

    def before_save(self, step: int, orchestrator_state: dict[str, Any]) -> None:
        """One process: nobody else saves."""

    def final_params(self) -> dict[str, Any]:
        return final_policy(self.trainer)

    def abort(self, reason: str) -> None:
        """One process: nobody else to tell."""

    def gauges(self) -> dict[str, float]:
        live = self._live.gauges() if self._live is not None else {}
        return {**self.driver.gauges(), **live}

    def summary(self) -> dict[str, Any]:
        return {"overlap": self.schedule.decision}

    def held(self) -> str | None:
        """A pause a caller of the live server made (``Engine.serve_control``), or None."""
        return self._live.held() if self._live is not None else None

    def live_url(self) -> str | None:
        """The live server's URL (``Engine.serve_port``) once started; None without one."""
        return self._live.url if self._live is not None else None


class ReplicaPlan:
    """Trainer process 0 with replicas: a trainer group's channel first (the trainer's batch
    broadcast hook), then the side."""

    def __init__(self, parts: RunParts, engine: RLEngine) -> None:
        replicas = parts.engine_addresses
        if replicas.weight_source is None:
            raise ValueError("engine replicas need --weight_source=HOST:PORT to pull weights from")
        self.parts = parts
        self.engine = engine
        group = parts.cfg.processes.trainer_processes > 1
        self.channel = Channel(leader=True) if group else None
        self.hooks = StepHooks(on_batch=self._send_batch if group else None)

    def _send_batch(self, arrays: dict[str, Any]) -> None:
        self.channel.send(TRAIN, {}, arrays)

    def side(self, trainer: Trainer) -> ReplicaSide:
        return ReplicaSide(self.parts, self.engine, trainer, self.channel)


class ReplicaSide:
    """See the module docstring. ``engine`` never runs here: its shardings and weight dtype
    are a replica's (``placement.group_placement`` built its mesh like one)."""

    def __init__(
        self, parts: RunParts, engine: RLEngine, trainer: Trainer, channel: Channel | None
    ) -> None:
        self.trainer = trainer
        self.channel = channel
        self.staging = GroupStaging.of(trainer, engine)
        replicas = parts.engine_addresses
        transport = parts.cfg.processes.weight_transport
        # Imported where replicas are served: a one-process run does not pay for the HTTP stack.
        from jaxrl_orch.distributed.admission import JoinDesk
        from jaxrl_orch.distributed.offer_server import open_offer

        # Replicas that join mid-run ask the weight server; the pool decides (docs/scale-out.md).
        desk = JoinDesk(has_key=replicas.api_key is not None)
        self.offer = open_offer(transport, replicas.weight_source, replicas.api_key, desk)
        self.pool = _replica_pool(parts, self.offer, self.staging, desk)
        self._watch: asyncio.Future | None = None
        self.bytes_moved = 0  # what each replica pulls per version

    def move(self, params: Any) -> Any:
        """Trainer thread, after every step: the collective stage, then this process's copy."""
        local = self.staging.version(params)
        self.bytes_moved = tree_nbytes(local)
        return local

    async def swap(self, version: int, params: Any) -> None:
        await self.pool.load_weights(version, params)

    def engine_seconds(self) -> float:
        return self.pool.engine_seconds()

    async def start(self) -> None:
        """Every replica holds the trainer's current weights before the first rollout."""
        trainer = self.trainer
        base, first = self.staging.first(trainer)
        self.bytes_moved = tree_nbytes(first)
        if base is not None:
            where = "is pulled once by each replica"
            stage("weights", lora_line(trainer.config.lora, self.bytes_moved, base, where))
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

    def final_params(self) -> dict[str, Any]:
        """The peers leave their loop; the final policy gathered to every process."""
        if self.channel is None:
            return final_policy(self.trainer)
        self.channel.send(STOP, {})
        self.channel = None  # the peers have left their loop: nothing more to send them
        return multihost_utils.process_allgather(final_policy(self.trainer), tiled=True)

    def abort(self, reason: str) -> None:
        """The stage failed with the trainer thread idle: the peers leave their loop too."""
        if self.channel is not None:
            channel = self.channel
            self.channel = None
            channel.abort(reason)

    def gauges(self) -> dict[str, float]:
        return self.pool.gauges()

    def summary(self) -> dict[str, Any]:
        replicas: dict[str, Any] = {k.split("/")[1]: v for k, v in self.pool.gauges().items()}
        replicas["members"] = self.pool.members()
        return {"overlap": None, "replicas": replicas}

    def held(self) -> str | None:
        """Nothing: replicas serve no live policy, and only the run holds their key."""
        return None

    def live_url(self) -> str | None:
        """None: each replica serves the API at its own URL (``Engine.serve_port`` is refused)."""
        return None


def _replica_pool(
    parts: RunParts, offer: Offerer, staging: GroupStaging, desk: JoinDesk
) -> RemotePool:
    from jaxrl_orch.distributed.pool import RemotePool

    replicas: Replicas = parts.engine_addresses
    return RemotePool(
        replicas.urls,
        offer,
        parts.cfg.processes,
        api_key=replicas.api_key,
        model=parts.cfg.model.name,  # what a replica joining mid-run must serve
        desk=desk,
        # Every load names the staged layout: a replica whose decode mesh differs (its host
        # has more devices than a trainer host) pulls in it and reshards on its own devices.
        layout=staging.layout,
        base_layout=staging.base_layout,
    )
