"""RemotePool: the orchestrator's view of R engine replicas (its ``types.InferencePool``).

What it owns
    One ``RemoteEngineClient`` per replica (an HTTP client of the replica's ``serving`` app),
    which replicas are live, the newest weights on offer (``(version, params)``, params on the
    leader's devices in a replica's layout), and the failover of groups. ``select()`` pins a
    group: it returns a ``PinnedClient`` on the live replica with the fewest requests in
    flight, and every rollout of the group calls that one handle. When its replica is lost
    (``ReplicaLost``: the process died, the connection broke), the handle moves the whole group
    to another live replica and re-issues the requests that were in flight there (with
    per-request seeds the samples are those the lost replica would have produced); completed
    turns stand. No rollout is failed or settled twice on account of a lost replica, so the
    dispatcher's exactly-once invariant holds unchanged.

Weights: ``start`` waits (bounded) until every replica answers, then loads the first version
into each; ``load_weights(version, params)`` offers the params to each live replica
(``transfer.WeightOffer``, one pull per offer, on the fixed address every replica was started
with as its only weight source, so an update names just the offer's uuid) and awaits every pull
and swap (``POST /update_weights``); a replica lost meanwhile is marked lost, a pull that fails
or times out raises ``WeightPullError`` naming the replica and version. ``watch`` (a background
task) probes lost replicas; one that answers again (restarted) gets the current weights before
it is live again, so it never serves an old version.

Runs on the orchestrator's event loop; never blocks it (the HTTP calls are asyncio's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from jaxrl_orch.distributed.client import RemoteEngineClient, ReplicaLost, WeightPullError
from jaxrl_orch.distributed.transfer import WeightOffer
from jaxrl_orch.types import Completion, SamplingParams

FIRST_LOAD_EXTRA_S = 900.0  # a replica's first load also compiles its engine (warm-up)


class RemotePool:
    def __init__(
        self,
        addresses: Sequence[str],
        offer: WeightOffer,
        *,
        request_timeout_s: float,
        pull_timeout_s: float,
        probe_interval_s: float = 1.0,
        layout: dict | None = None,
        api_key: str | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("RemotePool needs at least one replica address")
        self.clients = [
            RemoteEngineClient(a, replica=i, timeout_s=request_timeout_s, api_key=api_key)
            for i, a in enumerate(addresses)
        ]
        self.offer = offer
        self.layout = layout  # how offers are laid out, when not the replicas' own
        self.pull_timeout_s = pull_timeout_s
        self.probe_interval_s = probe_interval_s
        self.live: set[int] = set()
        self._current: tuple[int, Any] | None = None
        self._changed = asyncio.Event()
        self._turn = 0
        self.lost_total = self.rejoined_total = self.moved_groups_total = 0
        self.reissued_total = 0
        self.pull_s = 0.0
        self._engine_s: dict[int, float] = {}  # per replica, this run (restarts included)
        self._raw_s: dict[int, float] = {}  # the replica's own count at the last probe

    # ------------------------------------------------------------------ weights

    async def start(self, version: int, params: Any, timeout_s: float = 600.0) -> None:
        """Wait until every replica answers (they may still be compiling), then load ``version``
        into each; an unreachable replica past ``timeout_s`` is an error naming it."""
        self._current = (version, params)
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.clients)))
        while waiting:
            for i in sorted(waiting):
                if await self.clients[i].health(timeout_s=5.0) is not None:
                    waiting.discard(i)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(f"{i} ({self.clients[i].address})" for i in sorted(waiting))
                raise TimeoutError(f"engine replicas {names} did not answer within {timeout_s:g} s")
            if waiting:
                await asyncio.sleep(0.5)
        loads = (self._load(i, version, params, first=True) for i in range(len(self.clients)))
        await asyncio.gather(*loads)
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
                self._lose(i)
            elif isinstance(r, BaseException):
                raise r

    async def _load(self, i: int, version: int, params: Any, first: bool = False) -> None:
        """Replica ``i`` pulls ``version``; ``first``: its first load since it started, which
        also runs its engine warm-up (compiles), so the call may take longer."""
        t0 = time.perf_counter()
        uuid = self.offer.offer(params, expire_s=self.pull_timeout_s + 30)
        extra = FIRST_LOAD_EXTRA_S if first else 30.0
        await self.clients[i].load_weights(
            version, uuid, self.pull_timeout_s, layout=self.layout, extra_s=extra
        )
        self.pull_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ liveness

    def _lose(self, i: int) -> None:
        if i in self.live:
            self.live.discard(i)
            self.lost_total += 1
            print(
                f"!! engine replica {i} ({self.clients[i].address}) lost: its groups move to "
                f"the {len(self.live)} live replica(s)",
                flush=True,
            )

    def engine_seconds(self) -> float:
        """Prefill + decode seconds of every replica so far (as of the last probe)."""
        return sum(self._engine_s.values())

    async def watch(self) -> None:
        """Probe every replica: the live ones for their engine time, the lost ones to re-admit
        those that answer again, with the current weights first."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            for i in range(len(self.clients)):
                if self._current is None:
                    continue
                health = await self.clients[i].health(timeout_s=2.0)
                if health is None:
                    continue
                raw = float(health.get("engine_s", 0.0))
                last = self._raw_s.get(i, 0.0)
                # A restarted replica counts from 0 again: keep what the lost one did.
                self._engine_s[i] = self._engine_s.get(i, 0.0) + (
                    raw - last if raw >= last else raw
                )
                self._raw_s[i] = raw
                if i in self.live:
                    continue
                version, params = self._current
                try:
                    await self._load(i, version, params, first=health.get("version", -1) < 0)
                except (ReplicaLost, WeightPullError) as exc:
                    print(f"engine replica {i} answers but did not load version {version}: {exc}")
                    continue
                if self._current[0] != version:  # a newer version arrived meanwhile
                    continue
                self.live.add(i)
                self.rejoined_total += 1
                self._changed.set()
                print(f"engine replica {i} is back, serving version {version}", flush=True)

    async def wait_live(self) -> int:
        """A live replica (the least busy); waits while none is."""
        while not self.live:
            self._changed.clear()
            await self._changed.wait()
        start = self._turn = self._turn + 1
        order = sorted(self.live, key=lambda i: (i - start) % len(self.clients))
        return min(order, key=lambda i: self.clients[i].in_flight)

    # ------------------------------------------------------------------ InferencePool

    def select(self) -> PinnedClient:
        live = sorted(self.live) or list(range(len(self.clients)))
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
        }

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


class PinnedClient:
    """One group's client: every rollout of the group calls it (see the module docstring)."""

    def __init__(self, pool: RemotePool, replica: int) -> None:
        self.pool, self.replica = pool, replica

    @property
    def in_flight(self) -> int:
        return self.pool.clients[self.replica].in_flight

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        while True:
            replica = self.replica
            try:
                return await self.pool.clients[replica].generate(prompt_ids, sampling)
            except ReplicaLost:
                self.pool._lose(replica)
            self.pool.reissued_total += 1
            if self.replica == replica:  # the first of the group's requests to notice moves it
                self.replica = await self.pool.wait_live()
                self.pool.moved_groups_total += 1
