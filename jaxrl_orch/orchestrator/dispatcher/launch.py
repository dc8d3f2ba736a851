"""Launcher: a group's rollouts from their admission until their permits come back.

What it owns
    The permits (at most ``max_inflight`` rollouts in flight, train and eval together), the
    open groups (train groups in the order they opened, which is their age; running eval
    rollouts, each a group of one), the episode ids, the admission counters, and the
    ``groups.Flights`` the started rollouts run in, whose ``out_q`` the main loop drains.

Launching (``launch``)
    Up to ``limit`` rollouts of a group start together. One admission covers them all: one
    ``on_admit(k)`` leaves the gate exactly where k single admissions would, and it comes
    first, so nothing has started if the gate's callback raises. A group calls
    ``pool.select()`` on its first launch and every rollout of it runs on that client, where
    they reuse its prompt cache. With the run's ``request_seed`` each rollout samples with its
    own seed (``settings.rollout_seed`` of where it sits in the run). Rollouts that finish in
    their eager first step are settled together (one clock read, one gate report), each still
    its own episode on ``out_q``; they return their permits at once.

Releasing and cancelling
    ``release`` returns the permits of started rollouts that ended; a group with nothing left
    to start or running closes. ``cancel_stale(min_version)`` cancels the train work of groups
    opened before ``min_version``: in-flight rollouts come out as error rollouts once their
    Task unwinds; the not-yet-started ones of those groups are emitted at once as cancelled
    placeholders (never admitted, so the gate does not hear of them), so the train sink still
    sees ``group_size`` rollouts and never holds a group forever.

Who drives it: only ``dispatch.RolloutDispatcher`` and its ``admission.Admission``. A helper of
the dispatcher: it decides nothing about what starts next.

Never: import another orchestrator component (gate, sinks, watcher, logger, store, loop); read
time except through the injected clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jaxrl_orch.orchestrator.dispatcher.groups import Flights, GroupInFlight
from jaxrl_orch.orchestrator.dispatcher.settings import DispatchConfig, GateHooks, rollout_seed
from jaxrl_orch.types import Environment, InferencePool, Rollout, SamplingParams


class Launcher:
    """Starts admitted rollouts and takes their permits back (see the module docstring)."""

    def __init__(
        self,
        pool: InferencePool,
        envs: Mapping[str, Environment],
        eval_envs: Mapping[str, Environment],
        config: DispatchConfig,
        gate: GateHooks,
        *,
        clock: Callable[[], float],
        wake: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.envs = envs
        self.eval_envs = eval_envs
        self.request_seed = config.request_seed
        self.on_admit = gate.on_admit
        self.clock = clock
        self.max_inflight = config.max_inflight
        self.permits = config.max_inflight
        self.flights = Flights(clock, gate.on_finish, self.release, wake, config.env_timeout_s)
        self.groups: dict[int, GroupInFlight] = {}  # open train groups, insertion order = age
        self.eval_groups: dict[int, GroupInFlight] = {}  # running eval rollouts (groups of one)
        self.next_episode_id = 0
        self.admitted_total = 0
        self.eval_admitted_total = 0

    @property
    def inflight(self) -> int:
        return self.max_inflight - self.permits

    def add(self, g: GroupInFlight) -> None:
        """A group just opened: it stays open until its last rollout has ended."""
        (self.eval_groups if g.is_eval else self.groups)[g.group_id] = g

    def train_in_flight(self) -> list[int]:
        """For each train rollout started and not yet on ``out_q``, the version its group
        opened at (see ``RolloutDispatcher.train_in_flight``)."""
        return [g.version_at_start for g in self.groups.values() for _ in range(g.running)]

    def launch(self, g: GroupInFlight, limit: int) -> int:
        """Admit and start up to ``limit`` rollouts of ``g``; returns how many started."""
        n = min(g.unscheduled, limit)
        if n <= 0:
            return 0
        if g.is_eval:
            self.eval_admitted_total += n
        else:
            self.on_admit(n)  # first: if the gate callback raises, nothing has started
            self.admitted_total += n
        env = (self.eval_envs if g.is_eval else self.envs)[g.env]
        ids = self._episode_ids(n)
        first = g.start(n, self.pool.select)  # the index in the group of the first one starting
        self.permits -= n
        now = self.clock()
        done_ids: list[int] = []
        done: list[Rollout] = []
        for j, eid in enumerate(ids):
            g.indices[eid] = first + j
            result = g.kept.pop(first + j, None)  # finished before a restart: not run again
            if result is None:
                result = self.flights.start(g, eid, now, env, self._sampling(g, first + j))
            if result is not None:
                done_ids.append(eid)
                done.append(result)
        if done:
            self.release(g, len(done))
            self.flights.emit(g, done_ids, done, now, self.clock(), each=True)
        return n

    def release(self, g: GroupInFlight, n: int) -> None:
        """``n`` started rollouts of ``g`` ended: their permits come back; a group with nothing
        left to start or running closes."""
        self.permits += n
        g.end(n)
        if g.unscheduled == 0 and g.running == 0:
            (self.eval_groups if g.is_eval else self.groups).pop(g.group_id, None)

    def cancel_stale(self, min_version: int) -> int:
        """Cancel train work of groups opened before ``min_version``; returns rollouts cancelled
        (in flight, and never started: those are emitted at once)."""
        n = self.flights.cancel_stale(min_version)
        for gid, g in list(self.groups.items()):
            if g.version_at_start < min_version and g.unscheduled:
                ids = self._episode_ids(g.unscheduled)
                g.unscheduled = 0
                reason = (
                    f"group started at version {g.version_at_start}, oldest trainable "
                    f"version is now {min_version}; never started"
                )
                now = self.clock()
                self.flights.emit(g, ids, [], now, now, cancel=reason, admitted=False)
                n += len(ids)
            if g.unscheduled == 0 and g.running == 0:
                del self.groups[gid]
        return n

    def _episode_ids(self, n: int) -> list[int]:
        first = self.next_episode_id
        self.next_episode_id = first + n
        return list(range(first, first + n))

    def _sampling(self, g: GroupInFlight, index: int) -> SamplingParams:
        """Rollout ``index`` of ``g``'s sampling: with its own seed (``request_seed``)."""
        if self.request_seed is None:
            return g.sampling
        seed = rollout_seed(self.request_seed, *g.position, index)
        return dataclasses.replace(g.sampling, seed=seed)
