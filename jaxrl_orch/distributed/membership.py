"""Membership: which replicas the pool may send work to, as replicas join and leave mid-run.

What it owns: the part of ``pool.RemotePool`` (which is a ``Membership``) that decides the
requests a ``admission.JoinDesk`` hands it (``decide``), the replicas being drained and those
that left, the count of joins and drains, and what each replica served (``members``).

Join (``POST /replicas/join?url=...``, keyed: ``admission``). The pool dials the URL only once
the request carried the run's key, and admits the replica only when it answers its health
probe, serves the run's model (``Model.name``) and takes the run's key (``GET /v1/models``
with it); otherwise the join is refused (403), naming what failed, counted and said. An
admitted replica gets the next index and loads the current version the way a lost replica
that comes back does (``_load``: a LoRA run's base first); a version that arrives meanwhile is
loaded too, and only when it holds the current one is it live, so the first request it gets
is served with the version it was admitted at or a later one. The console says
``== engine replica I (URL) joined at version V``. A URL the pool already serves is not added
twice; one that left (drained) is admitted again under its old index.

Drain (``POST /replicas/drain?url=...``, keyed; a replica asks for it on SIGTERM). The replica
takes no new group at once; a group pinned to it moves whole to another replica before its
next request (``pool.PinnedClient``, as for a lost replica, with its same per-request seeds);
the requests already on it finish there, and it keeps loading each new version meanwhile. Once
it holds none (or past ``replica_request_timeout_s``: then they are failed over as for a lost
replica) it leaves: it is no longer probed or loaded, the console says ``== engine replica I
(URL) drained at version V and left``, and the answer tells the replica it may exit. The run's
last replica taking new groups is not drained (409): the run would have nowhere to send work.

Runs on the pool's event loop, as the pool does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from jaxrl_orch.distributed.admission import Answer, Decision, JoinDesk
from jaxrl_orch.distributed.replica_client import RemoteEngineClient
from jaxrl_orch.types import Completion


class Membership:
    """See the module docstring; ``RemotePool`` holds the clients, liveness and weights."""

    clients: list[RemoteEngineClient]
    live: set[int]
    deadlines: Any
    _current: tuple[int, Any] | None
    _answered: dict[int, float]
    _changed: asyncio.Event

    def __init__(self, *, api_key: str | None, model: str | None, desk: JoinDesk | None) -> None:
        self.api_key = api_key
        self.model = model  # what a joining replica must serve; None: not checked
        self.desk = desk
        self.draining: set[int] = set()
        self.left: set[int] = set()
        self.joined_total = 0
        self.drained_total = 0
        self._probes: asyncio.TaskGroup | None = None
        self._joined_at: dict[int, int] = {}  # replica -> the version it was admitted at
        self._first_served: dict[int, int] = {}  # replica -> oldest version of its first answer
        self._served: dict[int, int] = {}  # replica -> requests answered

    @property
    def serving(self) -> set[int]:
        """The live replicas that take new groups (not being drained)."""
        return self.live - self.draining

    def served(self, i: int, done: Completion) -> None:
        """Replica ``i`` answered ``done``."""
        self._served[i] = self._served.get(i, 0) + 1
        if done.versions:
            self._first_served.setdefault(i, min(done.versions))

    async def decide(self, kind: str, url: str) -> Answer:
        """A join or drain of the replica at ``url`` (the desk's handler)."""
        known = [i for i, c in enumerate(self.clients) if c.address == url]
        if kind == "drain":
            if not known:
                return 404, Decision(replica=-1, version=-1, message=f"no replica at {url} here")
            return await self._drain(known[0])
        if known and known[0] not in self.left:
            i = known[0]
            state = "serves" if i in self.live else "is joining, or lost and back on its probes"
            return 200, Decision(replica=i, version=self._version(), message=f"it {state}")
        why = await self._check(url)
        if why is not None:
            self.desk.refuse(url, f"403: {why}")
            return 403, Decision(replica=-1, version=-1, message=why)
        return self._admit(url, known[0] if known else None)

    def _version(self) -> int:
        return -1 if self._current is None else self._current[0]

    async def _check(self, url: str) -> str | None:
        """Why the replica at ``url`` may not join, or None: it answers, serves the run's model
        and takes the run's key."""
        if self._current is None or self._probes is None:
            return "the run has not started its replicas yet"
        probe = RemoteEngineClient(url, replica=-1, timeout_s=1.0, api_key=self.api_key)
        probe_s = self.deadlines.replica_probe_timeout_s
        try:
            if await probe.health(probe_s) is None:
                return f"it does not answer GET /health within {probe_s:g} s"
            try:
                model = await probe.served_model(probe_s)
            except RuntimeError as exc:
                return str(exc)
        finally:
            await probe.close()
        if self.model is not None and model != self.model:
            return f"it serves model {model!r}, the run trains {self.model!r}"
        return None

    def _admit(self, url: str, i: int | None) -> Answer:
        """Admit the checked replica at ``url`` (index ``i``: it left before; None: a new
        one); it becomes live once it holds the current version (``_join``)."""
        if i is None:
            i = len(self.clients)
            timeout_s = self.deadlines.replica_request_timeout_s
            client = RemoteEngineClient(url, replica=i, timeout_s=timeout_s, api_key=self.api_key)
            self.clients.append(client)
        version = self._version()
        print(f"== engine replica {i} ({url}) admitted: loading version {version}", flush=True)
        self._probes.create_task(self._join(i))
        message = f"admitted as replica {i}: it serves once it holds version {version} or later"
        return 200, Decision(replica=i, version=version, message=message)

    async def _join(self, i: int) -> None:
        """Replica ``i`` loads the current version, then a newer one while one arrived
        meanwhile; then it is live, and probed like any other."""
        url, first = self.clients[i].address, True
        while True:
            version, params = self._current
            try:
                await self._load(i, version, params, first=first)
            except (RuntimeError, ValueError) as exc:
                # ReplicaLost, WeightPullError, an answer outside the contract: this replica
                # is refused, and the pool's probes (the task group it runs in) go on.
                self.left.add(i)
                self.desk.refuse(url, f"it did not load version {version}: {exc}")
                return
            first = False
            if self._current[0] == version:
                break
        self.left.discard(i)
        self._answered[i] = time.monotonic()
        self.live.add(i)
        self.joined_total += 1
        self._joined_at[i] = version
        self._changed.set()
        n = len(self.serving)
        print(
            f"== engine replica {i} ({url}) joined at version {version}; {n} replica(s) serve",
            flush=True,
        )
        await self._watch_one(i)

    async def _drain(self, i: int) -> Answer:
        """Replica ``i`` takes no new group, finishes what it holds and leaves (see the module
        docstring)."""
        url = self.clients[i].address
        if i in self.left:
            return 200, Decision(replica=i, version=-1, message="it has already left")
        if i in self.serving and len(self.serving) == 1:
            why = "it is the only replica taking new groups; start another one first"
            print(f"!! engine replica {i} ({url}) not drained: {why}", flush=True)
            return 409, Decision(replica=i, version=-1, message=why)
        self.draining.add(i)
        held = self.clients[i].in_flight
        print(
            f"== engine replica {i} ({url}) draining: no new groups; its {held} request(s) "
            "in flight finish there",
            flush=True,
        )
        timeout_s = self.deadlines.replica_request_timeout_s
        deadline = time.monotonic() + timeout_s
        while self.clients[i].in_flight and i in self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.clients[i].in_flight and i in self.live:
            self._lose(i, f"its drain held requests past {timeout_s:g} s")
        self.live.discard(i)
        self.draining.discard(i)
        self.left.add(i)
        self.drained_total += 1
        version = self._version()
        print(
            f"== engine replica {i} ({url}) drained at version {version} and left; "
            f"{len(self.serving)} replica(s) serve",
            flush=True,
        )
        return 200, Decision(replica=i, version=version, message="drained: it may exit")

    def membership_gauges(self) -> dict[str, float]:
        refused = 0 if self.desk is None else self.desk.refused_total
        return {
            "replicas/joined_total": float(self.joined_total),
            "replicas/drained_total": float(self.drained_total),
            "replicas/join_refused_total": float(refused),
            "replicas/draining": float(len(self.draining)),
        }

    def members(self) -> list[dict[str, Any]]:
        """Each replica the run had: its URL, state, the version it joined at (None: one of
        the run's own), the oldest version of its first answer, and its answers."""
        out = []
        for i, c in enumerate(self.clients):
            state = "left" if i in self.left else "live" if i in self.live else "lost"
            out.append(
                {
                    "replica": i,
                    "url": c.address,
                    "state": state,
                    "joined_at_version": self._joined_at.get(i),
                    "first_served_version": self._first_served.get(i),
                    "served": self._served.get(i, 0),
                }
            )
        return out
