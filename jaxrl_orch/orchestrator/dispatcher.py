"""RolloutDispatcher: keeps the engine busy and turns every dispatched rollout into an episode.

What it owns
    Permits (at most ``max_inflight`` rollouts in flight, train and eval together), the open
    prompt groups, the pinning of each group to one client of the pool, and ``out_q``: an
    unbounded ``asyncio.Queue`` of episodes (``list[Rollout]``) that the main loop drains.

Scheduling (one ``start()`` task, driven by the orchestrator loop)
    Each pass fills free permits, then sleeps until a rollout finishes, something wakes it
    (resume, eval scheduled, policy version advanced) or ``poll_interval_s`` passes (the gate's
    capacity may change behind its back; the loop also calls ``notify()`` when the sink frees
    gate slots). Each rollout's coroutine is started eagerly (``eager.start_eagerly``): one that
    finishes without suspending (an env that awaits nothing real, e.g. an instant engine) is
    emitted on the spot and never gets a Task; one that suspends continues under a Task, and
    only those are "in flight" for cancellation, ``stop()`` and ``oldest_train_version()``.
    Rollouts of one group are admitted together (one ``capacity_fn``/``on_admit`` call for as
    many as may start), and those that finish eagerly are settled together, each still its own
    episode. Since eager rollouts return their permits at once, a pass admits at most
    ``max_inflight`` rollouts and then yields one loop turn, so an instant env cannot starve the
    loop. Completions of Tasks are collected through done-callbacks rather than
    ``asyncio.wait`` over the in-flight set, so a pass costs O(finished), not O(in flight).
    Per pass: pending eval work first (finite and step-aligned; while it waits
    for permits, train work does not take them), then train work, envs taking turns (one
    ``Source`` per env; a single source only with a single env), continuing open groups
    (oldest first) before opening a fresh one, so a group's rollouts land close together on
    one client and reuse its prompt cache. A group calls ``pool.select()`` once and every
    rollout of it runs on that client. A group is stamped with ``policy.version`` when it
    opens (``policy_version_at_start``).

Staleness gate
    Train admissions ask ``capacity_fn()`` first and report ``on_admit(n)``; completions report
    ``on_finish(n, accepted)`` with ``accepted = not rollout.has_error``. Eval rollouts never
    touch the gate. The dispatcher never imports the gate: the loop passes the callables.
    With ``max_off_policy_steps = k`` it also cancels, on every version advance ``v``, the
    train groups opened before ``v - k`` (they can no longer ship within the bound).
    ``oldest_train_version()`` feeds the loop's ``pace`` policy; ``state()``/``restore()``
    checkpoint the train sources' cursors (rollouts in flight at save time are not replayed).

Exactly-once invariant
    Every rollout handed to an environment reaches ``out_q`` exactly once, whatever its fate:
    success; exception (error placeholders via ``Rollout.capture_error``); cancellation
    (``cancel_stale``, ``stop``: error ``"Cancelled: ..."``); empty trajectory (``num_turns ==
    0``: error ``"EmptyTrajectory: ..."``). Its permits are returned in the same step. When
    ``cancel_stale`` closes a group, the group's not-yet-started rollouts are emitted at once
    as cancelled placeholders, so the train sink still sees ``group_size`` rollouts and never
    holds a group forever. After ``stop_admitting_train`` (the drain) unstarted remainders of
    open train groups are abandoned instead: nothing will train on them.

Environments
    ``env.run(client, example, *, group_id, episode_id, sampling) -> Rollout`` per rollout, or,
    when ``use_run_group`` is set and the env defines it, ``env.run_group(client, example, *,
    group_id, episode_ids, sampling) -> list[Rollout]`` once per group (holding ``group_size``
    permits). The dispatcher restamps env name, ids, ``is_eval``, ``policy_version_at_start``,
    ``admitted_at`` and ``finished_at`` (on the injected clock) on whatever comes back.

Eval
    ``schedule_eval(step)`` restores each eval source to its state at construction and draws
    ``eval_num_examples`` examples, so every eval runs the same prompts. Until ``Rollout`` has
    a field for it, the eval step travels in the rollout's example under ``EVAL_STEP_KEY``.

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

from jaxrl_orch.orchestrator.eager import start_eagerly
from jaxrl_orch.types import (
    Environment,
    Episode,
    InferenceClient,
    InferencePool,
    PolicyHandle,
    Rollout,
    SamplingParams,
    Source,
)

EVAL_STEP_KEY = "eval_step"


def _per_env(name: str, value: Any, envs: Mapping[str, Any], kind: type) -> dict[str, Any]:
    """Expand a scalar setting to every env, or check a mapping covers exactly the envs."""
    if isinstance(value, Mapping):
        if set(value) != set(envs):
            raise ValueError(f"{name} keys {sorted(value)} must equal the env names {sorted(envs)}")
        out = dict(value)
    else:
        out = {e: value for e in envs}
    for env, v in out.items():
        if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 1)):
            want = "an int >= 1" if kind is int else f"a {kind.__name__}"
            raise ValueError(f"{name} for env {env!r} must be {want}, got {v!r}")
    return out


@dataclasses.dataclass(eq=False)
class _Group:
    group_id: int
    env: str
    example: dict[str, Any]
    size: int
    sampling: SamplingParams
    version_at_start: int
    is_eval: bool
    eval_step: int | None = None
    client: InferenceClient | None = None
    whole: bool = False  # the env runs the whole group in one call (``run_group``)
    unscheduled: int = 0
    running: int = 0


@dataclasses.dataclass(eq=False)
class _Flight:
    group: _Group
    episode_ids: list[int]
    admitted_at: float
    cancel_reason: str | None = None


class RolloutDispatcher:
    def __init__(
        self,
        pool: InferencePool,
        envs: Mapping[str, Environment],
        source: Source | Mapping[str, Source],
        policy: PolicyHandle,
        *,
        max_inflight: int,
        group_size: int | Mapping[str, int],
        sampling: SamplingParams | Mapping[str, SamplingParams],
        capacity_fn: Callable[[], int] = lambda: 1 << 62,
        on_admit: Callable[[int], None] = lambda n: None,
        on_finish: Callable[[int, bool], None] = lambda n, accepted: None,
        clock: Callable[[], float] = time.monotonic,
        max_off_policy_steps: int | None = None,
        use_run_group: bool = False,
        eval_envs: Mapping[str, Environment] | None = None,
        eval_sources: Mapping[str, Source] | None = None,
        eval_num_examples: int = 8,
        eval_group_size: int = 1,
        eval_sampling: SamplingParams | None = None,
        poll_interval_s: float = 0.5,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if not envs:
            raise ValueError("envs must name at least one training environment, got none")
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if max_off_policy_steps is not None and max_off_policy_steps < 0:
            raise ValueError(
                f"max_off_policy_steps must be >= 0 or None, got {max_off_policy_steps}"
            )
        self.pool, self.envs, self.policy = pool, dict(envs), policy
        self.group_size = _per_env("group_size", group_size, self.envs, int)
        self.sampling = _per_env("sampling", sampling, self.envs, SamplingParams)
        if not isinstance(source, Mapping):
            if len(self.envs) > 1:
                raise ValueError(
                    f"several envs {sorted(self.envs)} need a source per env (a mapping), "
                    f"got one {type(source).__name__}"
                )
            source = {e: source for e in self.envs}
        self.sources: dict[str, Source] = _per_env("source", source, self.envs, object)
        self.use_run_group = use_run_group
        if use_run_group:
            for env, g in self.group_size.items():
                if g > max_inflight and hasattr(self.envs[env], "run_group"):
                    raise ValueError(
                        f"env {env!r} runs whole groups of {g} but max_inflight is only "
                        f"{max_inflight}: a group would never get its permits"
                    )
        self.eval_envs = dict(eval_envs if eval_envs is not None else self.envs)
        self.eval_sources = dict(eval_sources or {})
        for env in self.eval_sources:
            if env not in self.eval_envs:
                raise ValueError(f"eval source {env!r} has no env; envs: {sorted(self.eval_envs)}")
        # Every eval restarts its sources here, so evals at different steps are comparable.
        self._eval_source_state = {e: s.state() for e, s in self.eval_sources.items()}
        if eval_num_examples < 1 or eval_group_size < 1:
            raise ValueError(
                f"eval_num_examples and eval_group_size must be >= 1, got "
                f"{eval_num_examples} and {eval_group_size}"
            )
        missing = [e for e in self.eval_sources if e not in self.sampling]
        if missing and eval_sampling is None:
            raise ValueError(
                f"eval envs {missing} have no train sampling params: pass eval_sampling"
            )
        self.eval_num_examples, self.eval_group_size = eval_num_examples, eval_group_size
        self.eval_sampling = eval_sampling
        self.max_inflight = max_inflight
        self.max_off_policy_steps = max_off_policy_steps
        self.capacity_fn, self.on_admit, self.on_finish = capacity_fn, on_admit, on_finish
        self.clock = clock
        self.poll_interval_s, self.stop_timeout_s = poll_interval_s, stop_timeout_s

        self.out_q: asyncio.Queue[Episode] = asyncio.Queue()
        self.permits = max_inflight
        self._groups: dict[int, _Group] = {}  # open train groups, insertion order = age
        self._eval_groups: dict[int, _Group] = {}
        self._eval_pending: collections.deque[tuple[str, dict[str, Any], int]] = collections.deque()
        self._inflight: dict[asyncio.Task, _Flight] = {}
        self._done: list[asyncio.Task] = []
        self._next_group_id = self._next_episode_id = 0
        self._env_cycle = itertools.cycle(sorted(self.envs))
        self._exhausted: set[str] = set()
        self._paused = False
        self._train_admitting = True
        self._stopping = False
        self._wake = asyncio.Event()
        self._seen_version = policy.version
        self._error: BaseException | None = None
        self._run_task: asyncio.Task | None = None
        self.admitted_total = self.eval_admitted_total = 0
        self.errors_total = self.cancelled_total = self.emitted_total = 0

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        """Stop admitting train and eval rollouts; in-flight ones continue."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

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
        return not self._inflight and not self._eval_pending and not self._open_eval_work()

    def oldest_train_version(self) -> int | None:
        """Oldest group-start version among train rollouts in flight (None if none are).

        A lower bound on their head versions, for the loop's ``pace`` policy. Unstarted
        rollouts of open groups do not count: they may be waiting on the very gate that a
        held trainer keeps closed.
        """
        versions = [
            f.group.version_at_start for f in self._inflight.values() if not f.group.is_eval
        ]
        return min(versions) if versions else None

    def state(self) -> dict[str, Any]:
        """Checkpointable: each train source's cursor and the id counters. Rollouts in flight
        at save time are not part of it: on resume their prompts are not replayed."""
        return {
            "sources": {env: src.state() for env, src in self.sources.items()},
            "next_group_id": self._next_group_id,
            "next_episode_id": self._next_episode_id,
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
            for _ in range(self.eval_num_examples):
                self._eval_pending.append((env, src.next_example(), step))
            counts[env] = self.eval_num_examples * self.eval_group_size
        self._wake.set()
        return counts

    def cancel_stale(self, min_version: int) -> int:
        """Cancel train work of groups opened before ``min_version``; returns rollouts cancelled.

        In-flight ones come out as error rollouts once their task unwinds; unstarted ones of
        those groups come out at once, so each group still yields ``group_size`` rollouts.
        """
        n = 0
        for task, flight in self._inflight.items():
            g = flight.group
            stale = not g.is_eval and g.version_at_start < min_version
            # cancel() is False for a task that already finished: its result stands.
            if stale and flight.cancel_reason is None and task.cancel():
                flight.cancel_reason = (
                    f"group started at version {g.version_at_start}, oldest trainable "
                    f"version is now {min_version}"
                )
                n += len(flight.episode_ids)
        for gid, g in list(self._groups.items()):
            if g.version_at_start < min_version and g.unscheduled:
                ids = self._new_episode_ids(g.unscheduled)
                g.unscheduled = 0
                reason = (
                    f"group started at version {g.version_at_start}, oldest trainable "
                    f"version is now {min_version}; never started"
                )
                now = self.clock()
                self._emit(g, ids, [], now, now, cancel=reason, admitted=False)
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
                self._on_version()
                self._fill()
                if not self._done and not self._wake.is_set():
                    # A timer, not wait_for: wait_for wraps the wait in a Task every pass.
                    timer = loop.call_later(self.poll_interval_s, self._wake.set)
                    try:
                        await self._wake.wait()
                    finally:
                        timer.cancel()
                else:
                    await asyncio.sleep(0)  # one loop turn between passes, always
                self._wake.clear()
                done, self._done = self._done, []
                for task in done:
                    self._complete(task)
                if watch.done():
                    watch.result()  # the watcher never returns; this re-raises its failure
        except Exception as exc:
            self._error = exc
            raise
        finally:
            watch.cancel()

    async def stop(self) -> None:
        """Cancel everything in flight (emitted as cancelled rollouts) and end the loop."""
        self._stopping = True
        self._wake.set()
        tasks = list(self._inflight)
        for task, flight in self._inflight.items():
            if task.cancel() and flight.cancel_reason is None:
                flight.cancel_reason = "dispatcher stopped"
        if tasks:
            await asyncio.wait(tasks, timeout=self.stop_timeout_s)
        for task in tasks:
            self._complete(task)
        run = self._run_task
        if run is not None and run is not asyncio.current_task() and not run.done():
            await asyncio.wait([run], timeout=self.stop_timeout_s)

    async def _watch_policy(self) -> None:
        while True:
            await self.policy.wait_advanced()
            self._wake.set()

    def _on_version(self) -> None:
        v = self.policy.version
        if v != self._seen_version:
            self._seen_version = v
            if self.max_off_policy_steps is not None:
                self.cancel_stale(v - self.max_off_policy_steps)

    # ------------------------------------------------------------------ scheduling
    def _open_eval_work(self) -> bool:
        return any(g.unscheduled for g in self._eval_groups.values())

    def _fill(self) -> None:
        # Rollouts that finish eagerly hand their permits straight back, so permits alone no
        # longer end a pass: one pass admits at most ``max_inflight``, then yields a loop turn
        # (the main loop drains out_q) and the next pass follows at once.
        budget = self.admitted_total + self.eval_admitted_total + self.max_inflight
        while self.permits > 0 and not self._paused and not self._stopping:
            if self.admitted_total + self.eval_admitted_total >= budget:
                self._wake.set()
                return
            launched = self._schedule_eval_one()
            if launched is None:
                return  # eval work waits for permits; train must not take them first
            if not (launched or self._schedule_train_one()):
                return

    def _schedule_eval_one(self) -> bool | None:
        """True: launched some; False: no eval work; None: eval work waits for permits."""
        for g in self._eval_groups.values():
            if g.unscheduled:
                return self._launch(g, self.permits) > 0 or None
        if not self._eval_pending:
            return False
        env, example, step = self._eval_pending[0]
        need = self.eval_group_size if self._runs_groups(env, eval_=True) else 1
        if self.permits < need:
            return None
        self._eval_pending.popleft()
        g = self._open(env, example, self.eval_group_size, is_eval=True, eval_step=step)
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
        if (size if self._runs_groups(env) else 1) > self.permits or size > capacity:
            return False
        try:
            example = self.sources[env].next_example()
        except StopIteration:
            # A finite source ran dry: that env opens no more groups (others continue).
            self._exhausted.add(env)
            return False
        g = self._open(env, example, size, is_eval=False)
        self._groups[g.group_id] = g
        return self._launch(g, min(self.permits, capacity)) > 0

    def _next_train_env(self) -> str | None:
        for _ in range(len(self.envs)):
            env = next(self._env_cycle)
            if env not in self._exhausted:
                return env
        return None

    def _runs_groups(self, env: str, eval_: bool = False) -> bool:
        envs = self.eval_envs if eval_ else self.envs
        return self.use_run_group and hasattr(envs[env], "run_group")

    def _open(self, env: str, example: dict, size: int, *, is_eval: bool, eval_step=None) -> _Group:
        sampling = (self.eval_sampling or self.sampling[env]) if is_eval else self.sampling[env]
        gid, version = self._next_group_id, self.policy.version
        self._next_group_id += 1
        whole = self._runs_groups(env, eval_=is_eval)
        return _Group(
            gid, env, example, size, sampling, version, is_eval, eval_step, None, whole, size
        )

    def _launch(self, g: _Group, limit: int) -> int:
        """Admit and start up to ``limit`` rollouts of ``g`` (all of it, or none, for an env
        that runs whole groups); returns how many started. One admission covers them all:
        admitting k at once leaves the gate exactly where k single admissions would."""
        n = g.unscheduled if g.whole else min(g.unscheduled, limit)
        if n <= 0 or n > limit:
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
        self.permits -= n
        g.unscheduled -= n
        g.running += n
        now = self.clock()
        if g.whole:
            coro = self._call(g, ids, now, env.run_group, ids)
            if coro is not None:
                result = self._start(g, ids, now, coro)
                if result is not None:
                    self._finish(g, ids, now, result)
            return n
        # Per-rollout env: rollouts that finish during their eager first step are settled
        # together (one clock read, one gate report), each still its own episode on out_q.
        done_ids: list[int] = []
        done: list[Rollout] = []
        for eid in ids:
            coro = self._call(g, [eid], now, env.run, eid)
            if coro is None:
                continue
            result = self._start(g, [eid], now, coro)
            if result is None:
                continue
            if isinstance(result, Rollout):
                done_ids.append(eid)
                done.append(result)
            else:
                self._finish(g, [eid], now, result)  # a wrong type: its own error path
        if done:
            self.permits += len(done)
            g.running -= len(done)
            self._emit(g, done_ids, done, now, self.clock(), each=True)
            self._close_if_done(g)
        return n

    def _call(self, g: _Group, ids: list[int], now: float, run, id_arg) -> Any:
        """The env's coroutine for this unit of work, or None if creating it already failed
        (then it has been emitted as an error rollout)."""
        example = dict(g.example)  # envs may mutate theirs; the group keeps the original
        try:
            if g.whole:
                return run(
                    g.client, example, group_id=g.group_id, episode_ids=id_arg, sampling=g.sampling
                )
            return run(
                g.client, example, group_id=g.group_id, episode_id=id_arg, sampling=g.sampling
            )
        except Exception as exc:  # an env failing before its coroutine exists: same fate
            self._finish(g, ids, now, None, exc)
            return None

    def _start(self, g: _Group, ids: list[int], now: float, coro: Any) -> Any:
        """Run one unit of work eagerly up to its first suspension (as Python 3.12's eager
        tasks do) and return its result if it finished cleanly without suspending (an env
        that awaits nothing real): such work needs no Task, since nothing could cancel it or
        wait on it. Work that suspends continues under a Task, which cancellation and
        ``stop()`` act on; work that failed has been emitted. Both return None."""
        if not asyncio.iscoroutine(coro):  # another awaitable: no first step to take here
            task = asyncio.ensure_future(coro)
        else:
            try:
                task, result = start_eagerly(coro)
            except asyncio.CancelledError:
                self._finish(g, ids, now, None, None, "rollout task was cancelled")
                return None
            except Exception as exc:
                self._finish(g, ids, now, None, exc)
                return None
            if task is None:
                if result is None:  # not a rollout: the error path names it
                    self._finish(g, ids, now, None)
                return result
        self._inflight[task] = _Flight(g, ids, now)
        task.add_done_callback(self._task_done)
        return None

    def _task_done(self, task: asyncio.Task) -> None:
        self._done.append(task)
        self._wake.set()

    # ------------------------------------------------------------------ completion
    def _complete(self, task: asyncio.Task) -> None:
        flight = self._inflight.pop(task, None)
        if flight is None:
            return  # already handled (stop() and the loop can both see a task)
        error: BaseException | None = None
        cancel = flight.cancel_reason
        if task.done() and not task.cancelled():
            error = task.exception()  # retrieved even when cancelled, so asyncio does not warn
            if error is not None and not isinstance(error, Exception):
                raise error  # KeyboardInterrupt / SystemExit are not rollout failures
        elif cancel is None:
            # Cancelled by someone else, or still running after stop()'s grace period.
            cancel = "rollout task was cancelled"
        result = task.result() if cancel is None and error is None else None
        self._finish(flight.group, flight.episode_ids, flight.admitted_at, result, error, cancel)

    def _finish(
        self,
        g: _Group,
        ids: list[int],
        admitted_at: float,
        result: Any,
        error: BaseException | None = None,
        cancel: str | None = None,
    ) -> None:
        """Return the permits of finished work and emit its rollouts, whatever its fate."""
        n = len(ids)
        self.permits += n
        g.running -= n
        rollouts: list[Rollout] = []
        if cancel is None and error is None:
            rollouts = result if isinstance(result, list) else [result]
            if len(rollouts) != n or not all(isinstance(r, Rollout) for r in rollouts):
                error = TypeError(
                    f"env {g.env!r} returned {type(result).__name__} "
                    f"(expected {n} Rollout{'s' if n > 1 else ''})"
                )
                rollouts = []
        self._emit(g, ids, rollouts, admitted_at, self.clock(), error, cancel)
        self._close_if_done(g)

    def _close_if_done(self, g: _Group) -> None:
        if g.unscheduled == 0 and g.running == 0:
            (self._eval_groups if g.is_eval else self._groups).pop(g.group_id, None)

    def _emit(
        self,
        g: _Group,
        ids: list[int],
        rollouts: list[Rollout],
        admitted_at: float,
        finished_at: float,
        error: BaseException | None = None,
        cancel: str | None = None,
        admitted: bool = True,
        each: bool = False,
    ) -> None:
        """Restamp and queue finished rollouts: one episode, or one episode per rollout
        (``each``: several single-rollout units that finished together)."""
        if cancel is not None or not rollouts:
            temp = g.sampling.temperature
            rollouts = [Rollout(g.env, g.group_id, i, g.example, temperature=temp) for i in ids]
        bad = 0
        for r, eid in zip(rollouts, ids, strict=True):
            r.env, r.group_id, r.episode_id, r.is_eval = g.env, g.group_id, eid, g.is_eval
            r.policy_version_at_start = g.version_at_start
            r.admitted_at, r.finished_at = admitted_at, finished_at
            if g.is_eval:
                r.example = {**r.example, EVAL_STEP_KEY: g.eval_step}
            if cancel is not None:
                r.errors.append(f"Cancelled: {cancel}")
                r.trainable = False
            elif error is not None:
                r.capture_error(error)
            elif not r.errors and r.num_turns == 0:
                r.errors.append("EmptyTrajectory: the environment returned a rollout with 0 turns")
                r.trainable = False
            if r.errors:
                bad += 1
        self.errors_total += bad
        if cancel is not None:
            self.cancelled_total += len(rollouts)
        self.emitted_total += len(rollouts)
        if each:
            for r in rollouts:
                self.out_q.put_nowait([r])
        else:
            self.out_q.put_nowait(rollouts)
        # Never-started placeholders were never admitted, so the gate must not hear of them.
        if not g.is_eval and admitted:
            ok = len(rollouts) - bad
            if ok:
                self.on_finish(ok, True)
            if bad:
                self.on_finish(bad, False)

    # ------------------------------------------------------------------ metrics
    def gauges(self) -> dict[str, float]:
        return {
            "dispatcher/inflight": float(self.inflight),
            "dispatcher/permits_available": float(self.permits),
            "dispatcher/out_q_depth": float(self.out_q.qsize()),
            "dispatcher/admitted_total": float(self.admitted_total),
            "dispatcher/eval_admitted_total": float(self.eval_admitted_total),
            "dispatcher/emitted_total": float(self.emitted_total),
            "dispatcher/errors_total": float(self.errors_total),
            "dispatcher/cancelled_total": float(self.cancelled_total),
            "dispatcher/open_groups": float(len(self._groups) + len(self._eval_groups)),
            "dispatcher/eval_pending": float(len(self._eval_pending)),
            "dispatcher/paused": float(self._paused),
        }
