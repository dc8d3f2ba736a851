"""RemotePool: the orchestrator's view of R engine replicas (its ``types.InferencePool``).

What it owns
    One ``RemoteEngineClient`` per replica (an HTTP client of the replica's ``serving`` app),
    which replicas are live, the newest weights on offer (``(version, params)``, params on the
    leader's devices in a replica's layout), and the failover of groups. ``select()`` pins a
    group: it returns a ``PinnedClient`` on the live replica with the fewest requests in
    flight, and every rollout of the group calls that one handle. When its replica is lost,
    the handle moves the whole group to another live replica and re-issues the requests that
    were in flight there (with per-request seeds the samples are those the lost replica would
    have produced); completed turns stand. No rollout is failed or settled twice on account of
    a lost replica, so the dispatcher's exactly-once invariant holds unchanged.

Lost means not answering, dead or alive
    A replica is lost (``_lose``: one console line with the cause, ``lost_total``, every request
    in flight on it failed over at once through ``RemoteEngineClient.abandon``) when a request
    to it fails with ``ReplicaLost`` (the process died, the connection broke), when a weight
    update gets no answer at all within the pull's deadline (``weight_pull_timeout_s`` plus
    ``weight_load_extra_s``), or when ``watch`` gets no answer to its health probes for
    ``replica_health_timeout_s``: a stopped (SIGSTOP) or wedged process keeps its connections
    open and would otherwise hold its groups until ``replica_request_timeout_s`` and a weight
    update until the run fails. Every deadline is a setting of the run's ``Processes`` section
    (``Deadlines``: what the pool reads of it). A lost replica is no longer selected; a request
    of a group pinned to it moves the group before it is sent.

Weights: ``start`` waits (bounded) until every replica answers, then loads the first version
into each; ``load_weights(version, params)`` offers the params to each live replica
(an ``offer_wire.Offerer``: ``offer_server.HttpWeightOffer`` by default; one pull per offer, on
the fixed address every replica was started with as its only weight source, so an update names
just the offer's uuid; each offer expires when the update's request would) and awaits every pull
and swap (``contract.UPDATE_WEIGHTS``); a replica lost meanwhile is marked lost, a pull the replica
answers as failed raises ``WeightPullError`` naming the replica and version. A LoRA run's
pool is started with the frozen ``base`` too (in a replica's layout, ``base_layout``), and keeps
it: every replica fresh to the pool (its first load, or back after a restart) pulls the base
first, and every version then moves only the adapters. ``watch`` (a
background task) probes every replica on its own schedule; a lost one that answers again
(restarted, or resumed with SIGCONT) gets the current weights before it is live again, so it
never serves an old version, and every token still carries the version that produced it.

Joining and leaving mid-run (``membership.Membership``, which this class is): a replica the
run's weight server admits (``admission``) is checked, loads the current version, and only then
is live; a drained one takes no new groups, finishes the requests it holds, and leaves.

Runs on the orchestrator's event loop; never blocks it (the HTTP calls are asyncio's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol

from jaxrl_orch.distributed.admission import JoinDesk
from jaxrl_orch.distributed.membership import Membership
from jaxrl_orch.distributed.offer_wire import Offerer
from jaxrl_orch.distributed.replica_client import RemoteEngineClient, ReplicaLost, WeightPullError
from jaxrl_orch.serving.contract import Health
from jaxrl_orch.types import Completion, SamplingParams

PROBE_INTERVAL_S = 1.0  # each replica's health probes, one after the other


class Deadlines(Protocol):
    """The settings of the ``Processes`` section (``config.runtime``) the pool reads."""

    replica_request_timeout_s: float
    weight_pull_timeout_s: float
    weight_load_extra_s: float
    replica_warmup_s: float
    replica_start_timeout_s: float
    replica_probe_timeout_s: float
    replica_health_timeout_s: float


class RemotePool(Membership):
    def __init__(
        self,
        addresses: Sequence[str],
        offer: Offerer,
        deadlines: Deadlines,
        *,
        probe_interval_s: float = PROBE_INTERVAL_S,
        layout: dict | None = None,
        base_layout: dict | None = None,
        api_key: str | None = None,
        model: str | None = None,
        desk: JoinDesk | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("RemotePool needs at least one replica address")
        super().__init__(api_key=api_key, model=model, desk=desk)
        timeout_s = deadlines.replica_request_timeout_s
        self.clients = [
            RemoteEngineClient(a, replica=i, timeout_s=timeout_s, api_key=api_key)
            for i, a in enumerate(addresses)
        ]
        self.offer = offer
        self.deadlines = deadlines
        self.layout = layout  # how offers are laid out, when not the replicas' own
        self.base_layout = base_layout  # how a LoRA base is, likewise
        self._base: Any = None  # a LoRA run's frozen base, for replicas that start or restart
        self.probe_interval_s = probe_interval_s
        self._answered: dict[int, float] = {}  # replica -> monotonic time of its last answer
        self.live: set[int] = set()
        self._current: tuple[int, Any] | None = None
        self._changed = asyncio.Event()
        self._turn = 0
        self.lost_total = 0
        self.rejoined_total = 0
        self.moved_groups_total = 0
        self.reissued_total = 0
        self.pull_s = 0.0
        self._engine_s: dict[int, float] = {}  # per replica, this run (restarts included)
        self._raw_s: dict[int, float] = {}  # the replica's own count at the last probe

    # ------------------------------------------------------------------ weights

    async def start(self, version: int, params: Any, base: Any = None) -> None:
        """Wait until every replica answers (they may still be compiling), then load ``version``
        into each (a LoRA run: ``base`` first, ``params`` are its adapters); a replica silent
        past ``replica_start_timeout_s`` is an error naming it."""
        self._current = (version, params)
        self._base = base
        timeout_s = self.deadlines.replica_start_timeout_s
        probe_s = self.deadlines.replica_probe_timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.clients)))
        while waiting:
            for i in sorted(waiting):
                if await self.clients[i].health(probe_s) is not None:
                    waiting.discard(i)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(f"{i} ({self.clients[i].address})" for i in sorted(waiting))
                raise TimeoutError(f"engine replicas {names} did not answer within {timeout_s:g} s")
            if waiting:
                await asyncio.sleep(0.5)
        loads = (self._load(i, version, params, first=True) for i in range(len(self.clients)))
        await asyncio.gather(*loads)
        self._answered = dict.fromkeys(range(len(self.clients)), time.monotonic())
        self.live = set(range(len(self.clients)))
        self._changed.set()

    async def load_weights(self, version: int, params: Any) -> None:
        """Every live replica pulls ``version`` and swaps it in (see the module docstring)."""
        self._current = (version, params)
        live = sorted(self.live)
        results = await asyncio.gather(
            *(self._load(i, version, params) for i in live), return_exceptions=True
        )
        for i, r in zip(live, results, strict=True):
            if isinstance(r, ReplicaLost):
                self._lose(i, r.cause)
            elif isinstance(r, BaseException):
                raise r

    async def _load(self, i: int, version: int, params: Any, first: bool = False) -> None:
        """Replica ``i`` pulls ``version``; ``first``: its first load since it started, which
        also runs its engine warm-up (compiles), so the call may take longer."""
        t0 = time.perf_counter()
        extra_s = self.deadlines.weight_load_extra_s
        part = "weights"
        if self._base is not None:
            part = "adapters"
            if first:  # a fresh process holds no base
                await self._pull(i, version, self._base, extra_s, self.base_layout, "base")
        if first:
            extra_s = self.deadlines.replica_warmup_s
        await self._pull(i, version, params, extra_s, self.layout, part)
        self.pull_s += time.perf_counter() - t0

    async def _pull(
        self, i: int, version: int, arrays: Any, extra_s: float, layout: Any, part: str
    ) -> None:
        """Replica ``i`` pulls ``arrays`` as ``part`` of ``version``; the offer lasts as long as
        the pull may, plus the weight update's extra seconds."""
        d = self.deadlines
        uuid = self.offer.offer(arrays, expire_s=d.weight_pull_timeout_s + d.weight_load_extra_s)
        await self.clients[i].load_weights(
            version, uuid, d.weight_pull_timeout_s, extra_s=extra_s, layout=layout, part=part
        )

    # ------------------------------------------------------------------ liveness

    def _lose(self, i: int, cause: str) -> None:
        """Replica ``i`` is lost (see the module docstring): said once, with ``cause``."""
        if i not in self.live:
            return
        self.live.discard(i)
        self.lost_total += 1
        print(
            f"!! engine replica {i} ({self.clients[i].address}) lost: {cause}; its groups move "
            f"to the {len(self.live)} live replica(s)",
            flush=True,
        )
        self.clients[i].abandon(cause)

    def engine_seconds(self) -> float:
        """Prefill + decode seconds of every replica so far (as of the last probe)."""
        return sum(self._engine_s.values())

    async def watch(self) -> None:
        """Probe every replica, each on its own schedule so that one not answering (or one
        loading its weights to rejoin) never delays the others' probes: see ``_watch_one``."""
        async with asyncio.TaskGroup() as probes:
            self._probes = probes  # a replica admitted later gets its probes here
            for i in range(len(self.clients)):
                probes.create_task(self._watch_one(i))
            if self.desk is not None:
                probes.create_task(self.desk.serve(self.decide))

    async def _watch_one(self, i: int) -> None:
        """Replica ``i``'s probes: a live one silent for ``replica_health_timeout_s`` is lost; a
        lost one that answers is re-admitted with the current weights first; each answer updates
        its engine time."""
        timeout_s = self.deadlines.replica_health_timeout_s
        while i not in self.left:  # a drained replica is no longer probed
            await asyncio.sleep(self.probe_interval_s)
            if self._current is None or i in self.left:
                continue
            health = await self.clients[i].health(timeout_s)
            now = time.monotonic()
            if health is None:
                silent = now - self._answered.setdefault(i, now)
                if i in self.live and silent >= timeout_s:
                    self._lose(i, f"no answer to its health probe for {silent:.1f} s")
                continue
            self._answered[i] = now
            self._count_engine_s(i, health)
            if i not in self.live and i not in self.draining:
                await self._rejoin(i, first=health.version < 0)

    def _count_engine_s(self, i: int, health: Health) -> None:
        raw = health.engine_s
        last = self._raw_s.get(i, 0.0)
        # A restarted replica counts from 0 again: keep what the lost one did.
        self._engine_s[i] = self._engine_s.get(i, 0.0) + (raw - last if raw >= last else raw)
        self._raw_s[i] = raw

    async def _rejoin(self, i: int, first: bool) -> None:
        """Lost replica ``i`` answers again: live once it serves the current version."""
        version, params = self._current
        try:
            await self._load(i, version, params, first=first)
        except (ReplicaLost, WeightPullError) as exc:
            print(f"engine replica {i} answers but did not load version {version}: {exc}")
            return
        if self._current[0] != version:  # a newer version arrived meanwhile: the next probe
            return
        self._answered[i] = time.monotonic()
        self.live.add(i)
        self.rejoined_total += 1
        self._changed.set()
        print(f"engine replica {i} is back, serving version {version}", flush=True)

    async def wait_live(self) -> int:
        """A live replica taking new groups (the least busy); waits while none is."""
        while not self.serving:
            self._changed.clear()
            await self._changed.wait()
        self._turn += 1
        start = self._turn
        order = sorted(self.serving, key=lambda i: (i - start) % len(self.clients))
        return min(order, key=lambda i: self.clients[i].in_flight)

    # ------------------------------------------------------------------ InferencePool

    def select(self) -> PinnedClient:
        # None serving: pin to a replica that may come back (not one that left); the group's
        # first request then waits for one in ``wait_live``.
        every = range(len(self.clients))
        live = sorted(self.serving) or sorted(set(every) - self.left) or list(every)
        self._turn += 1
        order = live[self._turn % len(live) :] + live[: self._turn % len(live)]
        return PinnedClient(self, min(order, key=lambda i: self.clients[i].in_flight))

    def gauges(self) -> dict[str, float]:
        return {
            "replicas/live": float(len(self.live)),
            "replicas/lost_total": float(self.lost_total),
            "replicas/rejoined_total": float(self.rejoined_total),
            "replicas/moved_groups_total": float(self.moved_groups_total),
            "replicas/reissued_requests_total": float(self.reissued_total),
            "replicas/in_flight": float(sum(c.in_flight for c in self.clients)),
            "replicas/weight_pull_s_total": self.pull_s,
            **self.membership_gauges(),
        }

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


class PinnedClient:
    """One group's client: every rollout of the group calls it (see the module docstring)."""

    def __init__(self, pool: RemotePool, replica: int) -> None:
        self.pool = pool
        self.replica = replica
        # While no replica is live the first to notice waits in ``wait_live``; the others wait
        # here, then find the group moved (one move, counted once, even back to the same index).
        self._moving = asyncio.Lock()
        self._moves = 0

    @property
    def in_flight(self) -> int:
        return self.pool.clients[self.replica].in_flight

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        while True:
            replica = self.replica
            moves = self._moves
            # A replica lost since the group was pinned may be alive but silent: a request sent
            # there would wait for its own timeout, so the group moves first; so does a group on
            # a replica being drained (its requests already sent finish there).
            if replica in self.pool.serving:
                try:
                    done = await self.pool.clients[replica].generate(prompt_ids, sampling)
                    self.pool.served(replica, done)
                    return done
                except ReplicaLost as lost:
                    self.pool._lose(replica, lost.cause)
                self.pool.reissued_total += 1
            async with self._moving:  # the first of the group's requests to notice moves it
                if self._moves == moves:
                    self.replica = await self.pool.wait_live()
                    self._moves += 1
                    self.pool.moved_groups_total += 1
