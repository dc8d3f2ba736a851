"""The engine side (``compose.sides``): the plan picked from this process's role, the hooks it
hands the trainer before any trainer exists, the in-process side on a tiny real trainer and
engine, the replica side's messages to its peers (its pool, weight offer, channel and staging
stand-ins), and both sides implementing every member of ``EngineSide``.

Fast: ``TINY`` (d_model 32, 2 layers) on 2 + 4 of the 8 fake CPU devices; the replica side's
parts are stand-ins (the real ones across processes: ``tests/distributed``)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import typing
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.trainer_batches import TINY

from jaxrl_orch.compose import sides
from jaxrl_orch.compose.engines import BuiltEngine
from jaxrl_orch.compose.sides import (
    EngineSide,
    InProcessPlan,
    InProcessSide,
    ReplicaPlan,
    ReplicaSide,
    side_plan,
)
from jaxrl_orch.config.load import make_config
from jaxrl_orch.distributed.addresses import Replicas
from jaxrl_orch.distributed.group import CHECKPOINT, STOP, TRAIN, Role
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.trainer.trainer import RowLayout, Trainer
from jaxrl_orch.types import SamplingParams
from sharding.mesh import make_meshes

SINGLE = Role("single", 0, 1, 0)
REPLICAS = Replicas(urls=("http://127.0.0.1:9001",), weight_source="127.0.0.1:8470")
PROMPT, GREEDY = [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2)
# TINY's weights, counted by hand: the embedding 64 x 32 = 2048 (tied with the output head);
# per layer q 32 x 4 x 8 = 1024, k and v 32 x 2 x 8 = 512 each, o 1024, gate / up / down
# 32 x 64 = 2048 each, two norms 32 each: 9280; 2 layers; the final norm 32.
TINY_WEIGHTS = 2048 + 2 * 9280 + 32


def _parts(role: Role = SINGLE, replicas: Replicas = Replicas(), **settings) -> SimpleNamespace:
    """What a side reads of ``RunParts``."""
    return SimpleNamespace(
        cfg=make_config({"Engine.warmup": False, **settings}),
        role=role,
        engine_addresses=replicas,
        placement=SimpleNamespace(colocated=False),
        tokenizer=None,
    )


def _group(p: int) -> dict:
    return {"Processes.trainer_processes": p, "Processes.engine_replicas": 1}


@pytest.fixture(scope="module")
def meshes():
    return make_meshes({"tp": 2}, {"fsdp": 2, "tp": 2})


@pytest.fixture(scope="module")
def engine(meshes):
    limits = EngineLimits(
        max_concurrent_decodes=2, max_target_length=32, max_prefill_length=16, steps_per_call=2
    )
    # bf16 weights, unlike the trainer's float32: a move must cast them.
    return DecodeEngine(TINY, mesh=meshes[0], limits=limits, param_dtype=jnp.bfloat16)


def _trainer(meshes, hooks) -> Trainer:
    return Trainer(TINY, meshes[1], rows=RowLayout(row_len=32), seed=3, hooks=hooks)


def _assert_on_engine(served, trainer_params, engine) -> None:
    """``served`` is ``trainer_params`` cast to bf16, laid out as the engine's own weights."""
    pairs = zip(
        jax.tree.leaves(served),
        jax.tree.leaves(trainer_params),
        jax.tree.leaves(engine.param_shardings),
        strict=True,
    )
    for got, want, sharding in pairs:
        assert got.dtype == jnp.bfloat16 and got.sharding == sharding
        want = np.asarray(want, np.float32).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got), want)


# ------------------------------------------------------------------ fakes of the replica side


class FakeChannel:
    made: list[FakeChannel] = []

    def __init__(self, leader: bool) -> None:
        self.leader = leader
        self.sent: list[tuple] = []
        self.aborted: list[str] = []
        FakeChannel.made.append(self)

    def send(self, cmd, body, arrays=None):
        self.sent.append((cmd, body, arrays))

    def abort(self, reason, timeout_s=60.0):
        self.aborted.append(reason)
        return True


class FakeOffer:
    """What ``open_offer`` was asked for: the run's transport, address and key, and the desk
    its server hands join and drain requests to."""

    def __init__(self, transport: str, weight_source: str, api_key: str | None, desk) -> None:
        self.transport, self.weight_source, self.api_key = transport, weight_source, api_key
        self.desk = desk


class FakePool:
    def __init__(self, urls, offer, deadlines, *, api_key, model, desk, layout, base_layout):
        self.urls, self.offer, self.deadlines = urls, offer, deadlines
        self.model, self.desk = model, desk
        self.layout, self.base_layout = layout, base_layout
        self.started: tuple | None = None
        self.loads: list[tuple] = []
        self.watching = self.closed = False

    async def start(self, version, params, base=None):
        self.started = (version, params, base)

    async def watch(self):
        self.watching = True
        await asyncio.Event().wait()  # until the side stops it

    async def load_weights(self, version, params):
        self.loads.append((version, params))

    async def close(self):
        self.closed = True

    def engine_seconds(self) -> float:
        return 2.5

    def gauges(self) -> dict[str, float]:
        return {"replicas/live": 1.0}

    def members(self) -> list[dict]:
        return [{"replica": 0, "state": "live"}]

    def select(self):
        raise AssertionError("not dispatched to here")


class FakeStaging:
    layout = {"mesh": {"tp": 2}, "specs": [], "dtype": "bfloat16"}
    base_layout = None

    def __init__(self, trainer, engine) -> None:
        self.staged: list = []
        self.first_version = {"w": np.zeros(3, np.float32)}  # 12 bytes

    @classmethod
    def of(cls, trainer, engine):
        return cls(trainer, engine)

    def first(self, trainer):
        return None, self.first_version  # no LoRA base

    def version(self, params):
        self.staged.append(params)
        return {"w": np.zeros((2, 4), jnp.bfloat16), "b": np.zeros(4, np.float32)}  # 32 bytes


@pytest.fixture
def replica_fakes(monkeypatch):
    FakeChannel.made = []
    gathered: list = []

    def process_allgather(tree, tiled=False):
        gathered.append((tree, tiled))
        return {"gathered": tree}

    monkeypatch.setattr(sides, "Channel", FakeChannel)
    # Imported by the replica side when it is built (a one-process run never loads them).
    monkeypatch.setattr("jaxrl_orch.distributed.offer_server.open_offer", FakeOffer)
    monkeypatch.setattr("jaxrl_orch.distributed.pool.RemotePool", FakePool)
    monkeypatch.setattr(sides, "GroupStaging", FakeStaging)
    monkeypatch.setattr(sides, "final_policy", lambda t: {"policy of version": t.version})
    monkeypatch.setattr(
        sides, "multihost_utils", SimpleNamespace(process_allgather=process_allgather)
    )
    return gathered


def _replica_plan(p: int, replicas: Replicas = REPLICAS, **settings) -> ReplicaPlan:
    """Trainer process 0 of a group of ``p``, with one engine replica."""
    leader = Role("trainer", 0, p, 1)
    parts = _parts(leader, replicas, **_group(p), **settings)
    plan = side_plan(parts, BuiltEngine("engine", True, False))
    assert isinstance(plan, ReplicaPlan)
    return plan


def _replica_side(p: int, **plan) -> tuple[ReplicaPlan, ReplicaSide]:
    plan = _replica_plan(p, **plan)
    return plan, plan.side(SimpleNamespace(version=5, params={"w": "trainer's"}))


# ------------------------------------------------------------------ the plan


def test_the_plan_follows_the_role_and_refuses_a_process_without_an_engine_side(replica_fakes):
    built = BuiltEngine("engine", True, False)
    assert isinstance(side_plan(_parts(), built), InProcessPlan)
    leader = Role("trainer", 0, 1, 1)
    assert isinstance(side_plan(_parts(leader, REPLICAS, **_group(1)), built), ReplicaPlan)
    peer = Role("trainer", 1, 2, 1)
    with pytest.raises(ValueError, match=r"^trainer process 1 of 2 has no engine side"):
        side_plan(_parts(peer, REPLICAS, **_group(2)), built)
    replica = Role("engine", 2, 2, 1)
    with pytest.raises(ValueError, match=r"^engine replica 0 of 1 has no engine side"):
        side_plan(_parts(replica, REPLICAS, **_group(2)), built)
    no_source = Replicas(urls=REPLICAS.urls)
    with pytest.raises(ValueError, match=r"--weight_source=HOST:PORT"):
        side_plan(_parts(leader, no_source, **_group(1)), built)


@pytest.mark.parametrize(
    ("settings", "engine_runs_in_a_step"),
    [
        ({"Engine.overlap": "sliced", "Orchestrator.max_staleness": 1}, False),
        ({"Engine.overlap": "overlapped", "Orchestrator.max_staleness": 1}, True),
        ({"Engine.overlap": "sliced", "Orchestrator.max_staleness": 0}, True),  # synchronous
    ],
)
def test_an_in_process_plans_hook_is_its_schedules_step(settings, engine_runs_in_a_step):
    plan = side_plan(_parts(**settings), BuiltEngine("engine", True, False))
    assert plan.hooks.around_step == plan.schedule.training  # before any trainer exists
    assert plan.hooks.on_batch is None
    gate = plan.schedule.engine_may_run
    with plan.hooks.around_step():  # one train step
        assert gate.is_set() == engine_runs_in_a_step
    assert gate.is_set()  # the engine runs again between steps


def test_a_replica_plan_of_a_group_sends_each_batch_to_the_peers(replica_fakes):
    plan = _replica_plan(2)  # no trainer yet: the hooks are what it is built with
    (channel,) = FakeChannel.made
    assert channel.leader and plan.channel is channel
    arrays = {"tokens": np.arange(6, dtype=np.int32)}
    plan.hooks.on_batch(arrays)  # the leader's trainer packed a batch
    ((cmd, body, sent),) = channel.sent
    assert (cmd, body) == (TRAIN, {}) and list(sent) == ["tokens"]
    np.testing.assert_array_equal(sent["tokens"], np.arange(6))
    assert plan.hooks.around_step is contextlib.nullcontext  # no engine here to pause
    alone = _replica_plan(1)  # a trainer of its own: no channel, nothing to broadcast
    assert alone.channel is None and alone.hooks.on_batch is None
    assert len(FakeChannel.made) == 1


# ------------------------------------------------------------------ the in-process side


def test_the_in_process_side_starts_on_the_trainers_weights_moves_and_swaps(meshes, engine):
    cfg = {"Engine.overlap": "sliced", "Orchestrator.max_staleness": 1}
    plan = side_plan(_parts(**cfg), BuiltEngine(engine, True, False))
    trainer = _trainer(meshes, plan.hooks)
    # What a restore does once the trainer is built: newer weights, a later version.
    trainer.params = jax.tree.map(lambda x: x * 2.0 + 0.5, trainer.params)
    trainer.version = 3

    side = plan.side(trainer)
    assert side.driver.version == 3
    _assert_on_engine(side.driver._swap.params, trainer.params, engine)  # what it decodes with

    newer = jax.tree.map(lambda x: x - 1.0, trainer.params)
    moved = side.move(newer)
    _assert_on_engine(moved, newer, engine)
    assert side.bytes_moved == TINY_WEIGHTS * 2  # cast to bf16 before it moved, not float32

    async def serve() -> tuple:
        await side.start()
        try:
            (first,) = side.driver.submit(PROMPT, GREEDY)  # compiles the engine's programs
            warm = await asyncio.wrap_future(first)
            with plan.hooks.around_step():  # a train step in sliced mode: the engine waits
                (held,) = side.driver.submit(PROMPT, GREEDY)
                await asyncio.sleep(0.5)  # a compiled engine answers in milliseconds
                swap = asyncio.ensure_future(side.swap(4, moved))
                await asyncio.sleep(0.2)
                during = (held.done(), swap.done(), side.driver.version)
            await swap  # lands between two decode steps, once the step has ended
            swapped = side.driver.version
            (fut,) = side.driver.submit(PROMPT, GREEDY)
            after = await asyncio.wrap_future(fut)
            return warm, during, await asyncio.wrap_future(held), swapped, after
        finally:
            await side.stop()

    warm, during, held, swapped, after = asyncio.run(serve())
    assert warm.versions == [3, 3]
    # In the step nothing decoded and the swap waited: ``swap`` returns once the engine serves it.
    assert during == (False, False, 3)
    assert held.versions[0] == 3  # queued before the swap: prefilled on version 3
    assert swapped == 4 and after.versions == [4, 4]
    assert side.gauges()["inference/version"] == 4.0
    _assert_on_engine(side.driver._swap.params, newer, engine)
    assert side.engine_seconds() > 0.0  # two generations' prefill and decode
    assert side.summary() == {"overlap": {"mode": "sliced"}}


# ------------------------------------------------------------------ the replica side


def test_the_replica_sides_offer_takes_the_runs_transport_and_key(replica_fakes):
    keyed = Replicas(REPLICAS.urls, REPLICAS.weight_source, api_key="run key")
    _, side = _replica_side(1, replicas=keyed, **{"Processes.weight_transport": "jax"})
    assert (side.offer.transport, side.offer.api_key) == ("jax", "run key")
    assert side.pool.offer is side.offer
    # The weight server hands joins to the pool that decides them: one desk, keyed like the run.
    assert side.pool.desk is side.offer.desk and side.offer.desk.has_key


def test_the_replica_side_builds_its_pool_moves_swaps_starts_and_stops(replica_fakes):
    plan, side = _replica_side(2)
    pool = side.pool
    offer = side.offer  # the run's default transport, on --weight_source
    assert (offer.transport, offer.weight_source, offer.api_key) == ("http", "127.0.0.1:8470", None)
    assert pool.urls == REPLICAS.urls and pool.offer is side.offer
    assert pool.layout == FakeStaging.layout and pool.base_layout is None
    assert pool.deadlines is plan.parts.cfg.processes
    # A joining replica must serve the run's model; a run without a key takes no joins.
    assert pool.model == plan.parts.cfg.model.name and not pool.desk.has_key

    local = side.move({"w": "step 6"})
    assert side.staging.staged == [{"w": "step 6"}] and side.bytes_moved == 2 * 4 * 2 + 4 * 4
    asyncio.run(side.swap(6, local))
    ((version, loaded),) = pool.loads
    assert version == 6 and loaded is local  # what ``move`` staged, as it is
    assert side.engine_seconds() == 2.5

    async def run() -> bool:
        await side.start()
        await asyncio.sleep(0)  # the pool's watch task runs
        watching = pool.watching
        await side.stop()
        return watching

    assert asyncio.run(run()) and pool.closed
    version, first, base = pool.started  # the trainer's current version, no LoRA base
    assert version == 5 and first is side.staging.first_version and base is None
    assert side.bytes_moved == 12  # the first version's 3 float32
    members = [{"replica": 0, "state": "live"}]  # every replica the run had, for summary.json
    assert side.summary() == {"overlap": None, "replicas": {"live": 1.0, "members": members}}


def test_the_replica_side_tells_its_peers_of_each_checkpoint_and_stops_them_once(replica_fakes):
    _, side = _replica_side(2)
    (channel,) = FakeChannel.made
    state = {"cursor": [1, 2]}
    side.before_save(4, state)
    assert channel.sent == [(CHECKPOINT, {"step": 4, "state": state}, None)]

    final = side.final_params()
    assert channel.sent[-1] == (STOP, {}, None) and len(channel.sent) == 2
    assert replica_fakes == [({"policy of version": 5}, True)]  # gathered from every process
    assert final == {"gathered": {"policy of version": 5}}
    # The peers left their loop: nothing more reaches them.
    side.before_save(5, state)
    side.abort("too late")
    assert side.final_params() == {"policy of version": 5}  # no second gather
    assert len(channel.sent) == 2 and channel.aborted == [] and len(replica_fakes) == 1


def test_the_replica_side_aborts_its_peers_once(replica_fakes):
    _, side = _replica_side(2)
    (channel,) = FakeChannel.made
    side.abort("ValueError: boom")
    side.abort("ValueError: again")
    assert channel.aborted == ["ValueError: boom"]
    side.before_save(3, {})
    assert channel.sent == []  # ABORT went by the channel's abort; nothing is sent after it


def test_a_replica_side_without_peers_saves_and_exports_alone(replica_fakes):
    _, side = _replica_side(1)
    assert side.channel is None and FakeChannel.made == []
    side.before_save(2, {"cursor": [0]})
    side.abort("ValueError: boom")
    assert side.final_params() == {"policy of version": 5} and replica_fakes == []


# ------------------------------------------------------------------ one interface


def _protocol_members(proto: type) -> set[str]:
    """Every attribute and method ``proto`` declares (its own and its bases', not object's or
    typing's)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        declared = (*vars(cls).get("__annotations__", {}), *vars(cls))
        names |= {n for n in declared if not n.startswith("_")}
    return names


def test_both_sides_implement_every_member_of_the_engine_side(meshes, engine, replica_fakes):
    members = _protocol_members(EngineSide)
    assert {"pool", "bytes_moved", "move", "swap", "abort"} <= members  # the walk finds them
    plan = side_plan(_parts(), BuiltEngine(engine, True, False))
    in_process = plan.side(_trainer(meshes, plan.hooks))
    _, replica = _replica_side(2)
    for side in (in_process, replica):
        assert isinstance(side, InProcessSide | ReplicaSide)
        missing = sorted(n for n in members if not hasattr(side, n))
        assert not missing, f"{type(side).__name__} lacks {missing}"
        for name in members:
            declared = getattr(EngineSide, name, None)
            if not callable(declared):  # a data member: set on the instance
                continue
            got = getattr(type(side), name)
            where = f"{type(side).__name__}.{name}"
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(declared), where
            params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
            assert params(got) == params(declared), where
        assert isinstance(side.bytes_moved, int)
        assert callable(side.pool.select)  # what the orchestrator dispatches through
