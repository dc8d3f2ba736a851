"""RolloutDispatcher: keeps the engine busy and turns every dispatched rollout into an episode.

What it owns
    Permits (at most ``max_inflight`` rollouts in flight, train and eval together), the open
    prompt groups, the pinning of each group to one client of the pool, and ``out_q``: an
    unbounded ``asyncio.Queue`` of episodes (``list[Rollout]``) that the main loop drains.
    Settings: ``DispatchConfig``, ``GateHooks`` and ``EvalPlan`` (``dispatch_settings``).
    Running started rollouts and settling them on ``out_q`` is delegated to its
    ``dispatch_groups.Flights`` (eager start, Tasks, restamping, error placeholders).

Scheduling (one ``start()`` task, driven by the orchestrator loop)
    Each pass fills free permits, then sleeps until a rollout finishes, something wakes it
    (eval scheduled, policy version advanced) or ``poll_interval_s`` passes (the gate's
    capacity may change behind its back; the loop also calls ``notify()`` when the sink frees
    gate slots). Rollouts of one group are admitted together (one ``capacity_fn``/``on_admit``
    call for as many as may start), and those that finish in their eager first step are
    settled together, each still its own episode. Since those return their permits at once, a
    pass admits at most ``max_inflight`` rollouts and then yields one loop turn, so an instant
    env cannot starve the loop. Per pass: pending eval rollouts first (finite and
    step-aligned: they take free permits before train work does), then train work, envs
    taking turns (one ``Source`` per env; a single source only with a single env), continuing
    open groups (oldest first) before opening a fresh one, so a group's rollouts land close
    together on one client and reuse its prompt cache. A group calls ``pool.select()`` once
    and every rollout of it runs on that client. A group is stamped with ``policy.version``
    when it opens (``policy_version_at_start``).

Staleness gate
    Train admissions ask ``capacity_fn()`` first and report ``on_admit(n)``; completions report
    ``on_finish(n, accepted)`` with ``accepted = not rollout.has_error``. Eval rollouts never
    touch the gate. The dispatcher never imports the gate: the loop passes ``GateHooks``. Age
    policies act from outside: the loop's ``drop`` calls ``cancel_stale(min_version)`` and its
    ``pace`` reads ``train_in_flight()``. ``state()``/``restore()`` checkpoint the train
    sources' cursors (rollouts in flight at save time are not replayed).

Exactly-once invariant
    Every rollout handed to an environment reaches ``out_q`` exactly once, whatever its fate
    (success, exception, cancellation by ``cancel_stale`` or ``stop``, empty trajectory), and
    its permit is returned in the same step. When ``cancel_stale`` closes a group, the group's
    not-yet-started rollouts are emitted at once as cancelled placeholders, so the train sink
    still sees ``group_size`` rollouts and never holds a group forever. After
    ``stop_admitting_train`` (the drain) unstarted remainders of open train groups are
    abandoned instead: nothing will train on them.

Environments and eval
    ``env.run(client, example, *, group_id, episode_id, sampling) -> Rollout`` once per
    rollout, on its group's client. ``schedule_eval(step)`` restores each eval source to its
    state at construction and draws ``EvalPlan.num_examples`` examples, so every eval runs the
    same prompts; each example is one rollout (a group of one), emitted with
    ``Rollout.eval_step = step``.

Never: sleep or read time except through asyncio and the injected clock; import another
orchestrator component; swallow a failure of its own loop (it is stored, re-raised from
``start()`` and from ``check()``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_orch.orchestrator.dispatcher.groups import Flights, GroupInFlight
from jaxrl_orch.orchestrator.dispatcher.settings import (
    DispatchConfig,
    EvalPlan,
    GateHooks,
    rollout_seed,
)
from jaxrl_orch.types import Environment, InferencePool, PolicyHandle, Rollout, Source

__all__ = ["DispatchConfig", "EvalPlan", "GateHooks", "RolloutDispatcher"]


class RolloutDispatcher:
    def __init__(
        self,
        pool: InferencePool,
        envs: Mapping[str, Environment],
        source: Source | Mapping[str, Source],
        policy: PolicyHandle,
        config: DispatchConfig,
        *,
        gate: GateHooks | None = None,
        eval_plan: EvalPlan | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, DispatchConfig):
            raise TypeError(f"config must be a DispatchConfig, got {type(config).__name__}")
        gate, plan = gate or GateHooks(), eval_plan or EvalPlan()
        self.pool, self.envs, self.policy, self.config = pool, dict(envs), policy, config
        self.group_size, self.sampling, self.sources = config.resolve(self.envs, source)
        self.eval_envs, self.eval_sources = plan.resolve(self.envs, self.sampling)
        # Every eval restarts its sources here, so evals at different steps are comparable.
        self._eval_source_state = {e: s.state() for e, s in self.eval_sources.items()}
        self.eval_num_examples, self.eval_sampling = plan.num_examples, plan.sampling
        self.max_inflight = self.permits = config.max_inflight
        self.capacity_fn, self.on_admit = gate.capacity_fn, gate.on_admit
        self.clock = clock
        self._wake = asyncio.Event()
        self._flights = Flights(
            clock, gate.on_finish, self._release, self._wake.set, config.env_timeout_s
        )
        self.out_q = self._flights.out_q
        self._groups: dict[int, GroupInFlight] = {}  # open train groups, insertion order = age
        self._eval_groups: dict[int, GroupInFlight] = {}  # running eval rollouts (groups of one)
        self._eval_pending: collections.deque[tuple[str, dict[str, Any], int, int]] = (
            collections.deque()
        )
        self._next_group_id = self._next_episode_id = self._train_groups = 0
        self._env_cycle = itertools.cycle(sorted(self.envs))
        self._exhausted: set[str] = set()
        self._train_admitting = True
        self._stopping = False
        self._error: BaseException | None = None
        self._run_task: asyncio.Task | None = None
        self.admitted_total = self.eval_admitted_total = 0

    # ------------------------------------------------------------------ control
    def notify(self) -> None:
        """Capacity may have grown behind the dispatcher's back (the sink discarded rollouts the
        gate had accepted): run a fill pass now rather than at the next poll."""
        self._wake.set()

    def stop_admitting_train(self) -> None:
        """The drain: no new train rollouts from now on; eval and in-flight work continue."""
        self._train_admitting = False

    @property
    def inflight(self) -> int:
        return self.max_inflight - self.permits

    @property
    def idle(self) -> bool:
        """Nothing in flight and no eval work waiting: the drain is complete."""
        return not self._flights and not self._eval_pending

    def train_in_flight(self) -> list[int]:
        """For each train rollout started and not yet on ``out_q``, the version its group opened
        at: a lower bound on its head version, for the loop's ``pace`` policy.

        Unstarted rollouts of a group started half-way (too few permits) do not count: they
        will start under the current version or a later one. They wait on permits, not on the
        gate (the group opened only with gate room for all of it, and open groups continue
        first), so a held trainer never keeps them from starting.
        """
        return [g.version_at_start for g in self._groups.values() for _ in range(g.running)]

    def state(self) -> dict[str, Any]:
        """Checkpointable: each train source's cursor and the id counters. Rollouts in flight
        at save time are not part of it: on resume their prompts are not replayed."""
        return {
            "sources": {env: src.state() for env, src in self.sources.items()},
            "next_group_id": self._next_group_id,
            "next_episode_id": self._next_episode_id,
            "train_groups": self._train_groups,
        }

    def restore(self, state: dict[str, Any]) -> None:
        unknown = set(state["sources"]) - set(self.sources)
        if unknown:
            raise ValueError(
                f"saved sources {sorted(unknown)} are not train envs {sorted(self.sources)}"
            )
        for env, src_state in state["sources"].items():
            self.sources[env].restore(src_state)
        self._next_group_id = int(state["next_group_id"])
        self._next_episode_id = int(state["next_episode_id"])
        self._train_groups = int(state.get("train_groups", self._next_group_id))

    def _new_episode_ids(self, n: int) -> list[int]:
        first, self._next_episode_id = self._next_episode_id, self._next_episode_id + n
        return list(range(first, first + n))

    def check(self) -> None:
        """Re-raise the failure that killed the dispatcher's loop, if any."""
        if self._error is not None:
            raise self._error

    def schedule_eval(self, step: int) -> dict[str, int]:
        """Queue one eval pass; returns how many eval rollouts each env will emit for ``step``."""
        counts: dict[str, int] = {}
        for env, src in self.eval_sources.items():
            src.restore(self._eval_source_state[env])
            for i in range(self.eval_num_examples):
                self._eval_pending.append((env, src.next_example(), step, i))
            counts[env] = self.eval_num_examples
        self._wake.set()
        return counts

    def cancel_stale(self, min_version: int) -> int:
        """Cancel train work of groups opened before ``min_version``; returns rollouts cancelled.

        In-flight ones come out as error rollouts once their task unwinds; unstarted ones of
        those groups come out at once, so each group still yields ``group_size`` rollouts.
        """
        n = self._flights.cancel_stale(min_version)
        for gid, g in list(self._groups.items()):
            if g.version_at_start < min_version and g.unscheduled:
                ids = self._new_episode_ids(g.unscheduled)
                g.unscheduled = 0
                reason = (
                    f"group started at version {g.version_at_start}, oldest trainable "
                    f"version is now {min_version}; never started"
                )
                now = self.clock()
                self._flights.emit(g, ids, [], now, now, cancel=reason, admitted=False)
                n += len(ids)
            if g.unscheduled == 0 and g.running == 0:
                del self._groups[gid]
        return n

    # ------------------------------------------------------------------ the loop
    async def start(self) -> None:
        """Run the dispatch loop until ``stop()``. A failure is stored and re-raised here."""
        if self._run_task is not None:
            raise RuntimeError("RolloutDispatcher.start() called twice")
        self._run_task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        watch = asyncio.create_task(self._watch_policy(), name="dispatcher-policy-watch")
        try:
            while not self._stopping:
                self._fill()
                if not self._flights.unreaped and not self._wake.is_set():
                    # A timer, not wait_for: wait_for wraps the wait in a Task every pass.
                    timer = loop.call_later(self.config.poll_interval_s, self._wake.set)
                    try:
                        await self._wake.wait()
                    finally:
                        timer.cancel()
                else:
                    await asyncio.sleep(0)  # one loop turn between passes, always
                self._wake.clear()
                self._flights.reap()
                if watch.done():
                    watch.result()  # the watcher never returns; this re-raises its failure
        except Exception as exc:
            self._error = exc
            raise
        finally:
            watch.cancel()

    def drop_pending_evals(self) -> int:
        """Forget eval work not started yet (a forced drain); returns how many were dropped."""
        n = len(self._eval_pending)
        self._eval_pending.clear()
        return n

    async def stop(self) -> None:
        """Cancel everything in flight (emitted as cancelled rollouts) and end the loop."""
        self._stopping = True
        self._wake.set()
        await self._flights.stop(self.config.stop_timeout_s)
        run = self._run_task
        if run is not None and run is not asyncio.current_task() and not run.done():
            await asyncio.wait([run], timeout=self.config.stop_timeout_s)

    async def _watch_policy(self) -> None:
        # A new version moves the gate's bound: run a fill pass now rather than at the poll.
        while True:
            await self.policy.wait_advanced()
            self._wake.set()

    # ------------------------------------------------------------------ scheduling
    def _fill(self) -> None:
        # Rollouts that finish eagerly hand their permits straight back, so permits alone no
        # longer end a pass: one pass admits at most ``max_inflight``, then yields a loop turn
        # (the main loop drains out_q) and the next pass follows at once.
        budget = self.admitted_total + self.eval_admitted_total + self.max_inflight
        while self.permits > 0 and not self._stopping:
            if self.admitted_total + self.eval_admitted_total >= budget:
                self._wake.set()
                return
            if not (self._schedule_eval_one() or self._schedule_train_one()):
                return

    def _schedule_eval_one(self) -> bool:
        """Start the next pending eval rollout, if any (one permit is free: ``_fill`` checked)."""
        if not self._eval_pending:
            return False
        env, example, step, i = self._eval_pending.popleft()
        g = self._open(env, example, 1, is_eval=True, eval_step=step)
        g.position = ("eval", env, step, i)
        self._eval_groups[g.group_id] = g
        return self._launch(g, self.permits) > 0

    def _schedule_train_one(self) -> bool:
        if not self._train_admitting:
            return False
        for g in self._groups.values():
            if g.unscheduled:
                return self._launch(g, min(self.permits, self.capacity_fn())) > 0
        env = self._next_train_env()
        if env is None:
            return False
        size = self.group_size[env]
        # A fresh group opens only when the gate has room for all of it: a group half-admitted
        # when the gate closes would wait for the next version to finish, and its early rollouts
        # would age in the sink past the bound (the gate's promise is per group, like AReaL's).
        capacity = self.capacity_fn()
        if size > capacity:
            return False
        try:
            example = self.sources[env].next_example()
        except StopIteration:
            # A finite source ran dry: that env opens no more groups (others continue).
            self._exhausted.add(env)
            return False
        g = self._open(env, example, size, is_eval=False)
        g.position, self._train_groups = ("train", env, self._train_groups), self._train_groups + 1
        self._groups[g.group_id] = g
        return self._launch(g, min(self.permits, capacity)) > 0

    def _next_train_env(self) -> str | None:
        for _ in range(len(self.envs)):
            env = next(self._env_cycle)
            if env not in self._exhausted:
                return env
        return None

    def _open(
        self, env: str, example: dict, size: int, *, is_eval: bool, eval_step: int | None = None
    ) -> GroupInFlight:
        sampling = (self.eval_sampling or self.sampling[env]) if is_eval else self.sampling[env]
        gid, version = self._next_group_id, self.policy.version
        self._next_group_id += 1
        return GroupInFlight(
            gid, env, example, size, sampling, version, is_eval, eval_step, None, size
        )

    def _launch(self, g: GroupInFlight, limit: int) -> int:
        """Admit and start up to ``limit`` rollouts of ``g``; returns how many started. One
        admission covers them all: admitting k at once leaves the gate exactly where k single
        admissions would. Rollouts that finish during their eager first step are settled
        together (one clock read, one gate report), each still its own episode on out_q."""
        n = min(g.unscheduled, limit)
        if n <= 0:
            return 0
        if g.is_eval:
            self.eval_admitted_total += n
        else:
            self.on_admit(n)  # first: if the gate callback raises, nothing has started
            self.admitted_total += n
        if g.client is None:
            g.client = self.pool.select()
        env = (self.eval_envs if g.is_eval else self.envs)[g.env]
        ids = self._new_episode_ids(n)
        first = g.size - g.unscheduled  # the index in the group of the first one starting now
        self.permits -= n
        g.unscheduled -= n
        g.running += n
        now = self.clock()
        done_ids: list[int] = []
        done: list[Rollout] = []
        for j, eid in enumerate(ids):
            result = self._flights.start(g, eid, now, env, self._sampling(g, first + j))
            if result is not None:
                done_ids.append(eid)
                done.append(result)
        if done:
            self._release(g, len(done))
            self._flights.emit(g, done_ids, done, now, self.clock(), each=True)
        return n

    def _sampling(self, g: GroupInFlight, index: int) -> Any:
        """Rollout ``index`` of ``g``'s sampling: with its own seed (``request_seed``)."""
        if self.config.request_seed is None:
            return g.sampling
        seed = rollout_seed(self.config.request_seed, *g.position, index)
        return dataclasses.replace(g.sampling, seed=seed)

    def _release(self, g: GroupInFlight, n: int) -> None:
        """``n`` started rollouts of ``g`` ended: their permits come back; a group with nothing
        left to start or running closes."""
        self.permits += n
        g.running -= n
        if g.unscheduled == 0 and g.running == 0:
            (self._eval_groups if g.is_eval else self._groups).pop(g.group_id, None)

    # ------------------------------------------------------------------ metrics
    def gauges(self) -> dict[str, float]:
        return {
            "dispatcher/inflight": float(self.inflight),
            "dispatcher/permits_available": float(self.permits),
            "dispatcher/out_q_depth": float(self.out_q.qsize()),
            "dispatcher/admitted_total": float(self.admitted_total),
            "dispatcher/eval_admitted_total": float(self.eval_admitted_total),
            "dispatcher/emitted_total": float(self._flights.emitted_total),
            "dispatcher/errors_total": float(self._flights.errors_total),
            "dispatcher/env_timeouts_total": float(self._flights.timeouts_total),
            "dispatcher/cancelled_total": float(self._flights.cancelled_total),
            "dispatcher/open_groups": float(len(self._groups) + len(self._eval_groups)),
            "dispatcher/eval_pending": float(len(self._eval_pending)),
        }
