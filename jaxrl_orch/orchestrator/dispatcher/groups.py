"""The dispatcher's groups after admission: running their rollouts and settling them on out_q.

What it owns
    ``GroupInFlight``: the rollouts of one prompt (env, example, sampling, the version the group
    opened at, the client it is pinned to, how many are unscheduled and how many run).
    ``Flights``: every started rollout until it is on ``out_q`` (an unbounded
    ``asyncio.Queue`` of episodes, ``list[Rollout]``), the Tasks of those that suspended
    (``Flight``), and the emitted / error / cancelled counters. ``settle``: what a finished
    rollout is.

Running (``Flights.start``)
    A rollout's coroutine is started eagerly (``eager.start_eagerly``): one that finishes
    without suspending (an env that awaits nothing real, e.g. an instant engine) is handed
    back to the dispatcher at once and never gets a Task, since nothing could cancel it or
    wait on it; one that suspends continues under a Task, and only those are in flight for
    ``cancel_stale`` and ``stop``. A Task still running ``timeout_s`` after it started is
    cancelled and settled as an ``EnvTimeout`` error (``timeouts_total``); a loop timer, so a
    hung environment costs no polling. Tasks report through done-callbacks, and ``reap``
    settles only the finished ones, so a pass costs O(finished), not O(in flight).

Settling (``settle``, ``Flights.emit``)
    Whatever an environment returned is restamped with what only the dispatcher knows: env
    name, group and episode ids, ``is_eval``, ``eval_step``, ``policy_version_at_start``,
    ``admitted_at`` and ``finished_at``. Its fate is recorded on it: cancelled (error
    ``"Cancelled: <reason>"``), failed (``Rollout.capture_error``; an env returning something
    other than a ``Rollout`` or an awaitable of one fails with a ``TypeError`` naming it),
    timed out (``"EnvTimeout: ..."``) or empty (``num_turns == 0``: error
    ``"EmptyTrajectory: ..."``); each of those is untrainable. Work that produced no rollout
    gets a placeholder per episode id. Every admitted train rollout is then reported to the
    gate (``on_finish(n, accepted)``, ``accepted = trainable``: no error, not cut); never-started
    placeholders are not, since the gate never admitted them. Each ending of a started
    rollout first calls ``release(group, 1)`` so the dispatcher returns its permit.

Who drives it: only the dispatcher (``launch.Launcher``). This is a helper of that component,
not a component of its own: it reads no version, admits nothing and decides nothing.

Never: import another orchestrator component (gate, sinks, watcher, logger, store, loop);
read time except through the injected clock; settle a rollout twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any

from jaxrl_orch.orchestrator.dispatcher.eager import start_eagerly
from jaxrl_orch.types import (
    Environment,
    EnvTimeout,
    Episode,
    InferenceClient,
    Rollout,
    SamplingParams,
)


@dataclasses.dataclass(eq=False)
class GroupInFlight:
    group_id: int
    env: str
    example: dict[str, Any]
    size: int
    sampling: SamplingParams
    version_at_start: int
    is_eval: bool
    eval_step: int | None = None
    client: InferenceClient | None = None
    unscheduled: int = 0
    running: int = 0
    position: tuple[Any, ...] = ()  # where it sits in the run (its rollouts' sampling seeds)
    # episode id -> index in the group, for the rollout's slot; and the finished rollouts a
    # restart kept (index -> rollout): used instead of running those members again
    indices: dict[int, int] = dataclasses.field(default_factory=dict)
    kept: dict[int, Rollout] = dataclasses.field(default_factory=dict)

    def start(self, n: int, select: Callable[[], InferenceClient]) -> int:
        """``n`` of its unscheduled rollouts start, on the client the group is pinned to
        (``select``'s pick when its first one starts); returns the index of the first."""
        if self.client is None:
            self.client = select()
        first = self.size - self.unscheduled
        self.unscheduled -= n
        self.running += n
        return first

    def end(self, n: int) -> None:
        """``n`` of its running rollouts ended."""
        self.running -= n


@dataclasses.dataclass(eq=False)
class Flight:
    group: GroupInFlight
    episode_id: int
    admitted_at: float
    cancel_reason: str | None = None
    timer: asyncio.TimerHandle | None = None  # the env_timeout_s deadline
    timed_out: bool = False


def settle(
    g: GroupInFlight,
    ids: list[int],
    rollouts: list[Rollout],
    admitted_at: float,
    finished_at: float,
    error: BaseException | None = None,
    cancel: str | None = None,
) -> list[Rollout]:
    """Restamp the rollouts of episodes ``ids`` of ``g`` and record their fate (see the module
    docstring). ``rollouts`` is empty when the work produced none: placeholders stand in."""
    if cancel is not None or not rollouts:
        temp = g.sampling.temperature
        rollouts = [Rollout(g.env, g.group_id, i, g.example, temperature=temp) for i in ids]
    for r, eid in zip(rollouts, ids, strict=True):
        r.env = g.env
        r.group_id = g.group_id
        r.episode_id = eid
        r.is_eval = g.is_eval
        r.eval_step = g.eval_step
        r.policy_version_at_start = g.version_at_start
        if not g.is_eval and eid in g.indices and len(g.position) == 3:
            r.slot = (g.position[2], g.indices[eid])
        r.admitted_at = admitted_at
        r.finished_at = finished_at
        if cancel is not None:
            r.errors.append(f"Cancelled: {cancel}")
            r.trainable = False
        elif error is not None:
            r.capture_error(error)
        elif not r.errors and r.num_turns == 0:
            r.errors.append("EmptyTrajectory: the environment returned a rollout with 0 turns")
            r.trainable = False
        elif not r.errors and not isinstance(r.reward, numbers.Real):  # bools are fine
            # Caught here, naming the env and the value, not as a TypeError deep in the sink.
            r.capture_error(
                TypeError(
                    f"env {g.env!r} returned the reward {r.reward!r} "
                    f"({type(r.reward).__name__}); a reward must be a real number"
                )
            )
    return rollouts


class Flights:
    """Started rollouts until they are on ``out_q`` (see the module docstring)."""

    def __init__(
        self,
        clock: Callable[[], float],
        on_finish: Callable[[int, bool], None],
        release: Callable[[GroupInFlight, int], None],
        wake: Callable[[], None],
        timeout_s: float | None = None,
    ) -> None:
        self.clock = clock
        self.on_finish = on_finish
        self._release = release
        self._wake = wake
        self.timeout_s = timeout_s
        self.out_q: asyncio.Queue[Episode] = asyncio.Queue()
        self._tasks: dict[asyncio.Task, Flight] = {}
        self._done: list[asyncio.Task] = []
        self.errors_total = 0
        self.cancelled_total = 0
        self.emitted_total = 0
        self.timeouts_total = 0

    def __len__(self) -> int:
        """Rollouts running under a Task."""
        return len(self._tasks)

    @property
    def unreaped(self) -> bool:
        """Some Task finished since the last ``reap``."""
        return bool(self._done)

    def start(
        self,
        g: GroupInFlight,
        eid: int,
        now: float,
        env: Environment,
        sampling: SamplingParams | None = None,
    ) -> Rollout | None:
        """Create rollout ``eid``'s coroutine and run it eagerly up to its first suspension (as
        Python 3.12's eager tasks do). Returns its rollout if it finished cleanly without
        suspending; the caller settles it. Work that suspends continues under a Task; work
        that failed has been settled. Both return None. ``sampling``: this rollout's own
        (its seed), default the group's."""
        example = dict(g.example)  # envs may mutate theirs; the group keeps the original
        try:
            coro = env.run(
                g.client,
                example,
                group_id=g.group_id,
                episode_id=eid,
                sampling=sampling or g.sampling,
            )
        except Exception as exc:  # an env failing before its coroutine exists: same fate
            self.finish(g, eid, now, None, exc)
            return None
        if not inspect.isawaitable(coro):  # e.g. a plain function returning a Rollout
            self.finish(g, eid, now, coro)  # a Rollout is used; anything else names its type
            return None
        if not asyncio.iscoroutine(coro):  # another awaitable: no first step to take here
            task = asyncio.ensure_future(coro)
        else:
            try:
                task, result = start_eagerly(coro)
            except asyncio.CancelledError:
                self.finish(g, eid, now, None, None, "rollout task was cancelled")
                return None
            except Exception as exc:
                self.finish(g, eid, now, None, exc)
                return None
            if task is None:
                if isinstance(result, Rollout):
                    return result
                self.finish(g, eid, now, result)  # not a rollout: the error path names it
                return None
        flight = self._tasks[task] = Flight(g, eid, now)
        if self.timeout_s is not None:
            loop = asyncio.get_running_loop()
            flight.timer = loop.call_later(self.timeout_s, self._time_out, task)
        task.add_done_callback(self._task_done)
        return None

    def _time_out(self, task: asyncio.Task) -> None:
        flight = self._tasks.get(task)
        if flight is not None and flight.cancel_reason is None and task.cancel():
            flight.timed_out = True
            flight.cancel_reason = (
                f"env {flight.group.env!r} rollout ran past env_timeout_s={self.timeout_s:g}s "
                "and was cancelled"
            )
            self.timeouts_total += 1

    def _task_done(self, task: asyncio.Task) -> None:
        flight = self._tasks.get(task)
        if flight is not None and flight.timer is not None:
            flight.timer.cancel()
        self._done.append(task)
        self._wake()

    def reap(self) -> None:
        """Settle every Task that finished since the last call."""
        done = self._done
        self._done = []
        for task in done:
            self._complete(task)

    def cancel_stale(self, min_version: int) -> int:
        """Cancel the running train rollouts of groups opened before ``min_version``; they are
        settled as cancelled once their Task unwinds. Returns how many were cancelled."""
        n = 0
        for task, flight in self._tasks.items():
            g = flight.group
            stale = not g.is_eval and g.version_at_start < min_version
            # cancel() is False for a task that already finished: its result stands.
            if stale and flight.cancel_reason is None and task.cancel():
                flight.cancel_reason = (
                    f"group started at version {g.version_at_start}, oldest trainable "
                    f"version is now {min_version}"
                )
                n += 1
        return n

    async def stop(self, timeout: float) -> None:
        """Cancel every Task, wait up to ``timeout`` for them to unwind, settle them all."""
        tasks = list(self._tasks)
        for task, flight in self._tasks.items():
            if task.cancel() and flight.cancel_reason is None:
                flight.cancel_reason = "dispatcher stopped"
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            self._complete(task)

    def _complete(self, task: asyncio.Task) -> None:
        flight = self._tasks.pop(task, None)
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
        if flight.timed_out:  # an error of the env's, not a deliberate cancellation
            error = EnvTimeout(flight.cancel_reason)
            cancel = None
        result = task.result() if cancel is None and error is None else None
        self.finish(flight.group, flight.episode_id, flight.admitted_at, result, error, cancel)

    def finish(
        self,
        g: GroupInFlight,
        eid: int,
        admitted_at: float,
        result: Any,
        error: BaseException | None = None,
        cancel: str | None = None,
    ) -> None:
        """One started rollout ended, whatever its fate: release its permit and emit it."""
        self._release(g, 1)
        rollouts: list[Rollout] = []
        if cancel is None and error is None:
            if isinstance(result, Rollout):
                rollouts = [result]
            else:
                error = TypeError(
                    f"env {g.env!r} returned {type(result).__name__} (expected 1 Rollout)"
                )
        self.emit(g, [eid], rollouts, admitted_at, self.clock(), error, cancel)

    def emit(
        self,
        g: GroupInFlight,
        ids: list[int],
        rollouts: list[Rollout],
        admitted_at: float,
        finished_at: float,
        error: BaseException | None = None,
        cancel: str | None = None,
        admitted: bool = True,
        each: bool = False,
    ) -> None:
        """Settle and queue finished rollouts: one episode, or one episode per rollout
        (``each``: several rollouts that finished together)."""
        rollouts = settle(g, ids, rollouts, admitted_at, finished_at, error, cancel)
        self.errors_total += sum(r.has_error for r in rollouts)
        # An untrainable rollout (one cut short) is not accepted either: the train sink never
        # hands it back as a discard, so the gate would count it against capacity for good.
        bad = sum(r.has_error or not r.trainable for r in rollouts)
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
