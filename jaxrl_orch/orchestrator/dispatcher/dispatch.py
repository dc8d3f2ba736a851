"""RolloutDispatcher: keeps the engine busy and turns every dispatched rollout into an episode.

What it owns
    The dispatch loop (one ``start()`` task) and the surface the orchestrator loop drives, over its
    parts: ``admission.Admission`` (what starts next, the opening of groups, the train sources),
    ``launch.Launcher`` (permits, open groups, starting and releasing rollouts, and ``out_q``: an
    unbounded ``asyncio.Queue`` of episodes, ``list[Rollout]``, that the main loop drains),
    ``evals.EvalQueue`` (eval work not started yet). Settings: ``DispatchConfig``, ``GateHooks`` and
    ``EvalPlan`` (``settings``). ``on_open`` hears of every train group drawn from the data (the
    rollout journal); ``recover`` takes a restart's plan. Running started rollouts and settling them
    on ``out_q`` is the launcher's ``groups.Flights`` (eager start, Tasks, restamping, error
    placeholders).

Scheduling (driven by the orchestrator loop)
    Each pass fills free permits, then sleeps until a rollout finishes, something wakes it
    (eval scheduled, policy version advanced) or ``poll_interval_s`` passes (the gate's
    capacity may change behind its back; the loop also calls ``notify()`` when the sink frees
    gate slots). Rollouts of one group are admitted together, and those that finish in their
    eager first step are settled together, each still its own episode. Since those return
    their permits at once, a pass admits at most ``max_inflight`` rollouts and then yields one
    loop turn, so an instant env cannot starve the loop. Per pass: pending eval rollouts first,
    then train work, in the order ``admission`` documents.

Staleness gate
    Train admissions ask ``capacity_fn()`` first and report ``on_admit(n)``; completions report
    ``on_finish(n, accepted)`` with ``accepted = rollout.trainable`` (no error, not cut short:
    the train sink hands back only discards of rollouts it could train). Eval rollouts never
    touch the gate. The dispatcher never imports the gate: the loop passes ``GateHooks``. Age
    policies act from outside: the loop's ``drop`` calls ``cancel_stale(min_version)`` and its
    ``pace`` reads ``train_in_flight()``. ``state()``/``restore()`` checkpoint the train
    sources' cursors and the ids (rollouts in flight at save time are not replayed).

Exactly-once invariant
    Every rollout handed to an environment reaches ``out_q`` exactly once, whatever its fate
    (success, exception, cancellation by ``cancel_stale`` or ``stop``, empty trajectory), and
    its permit is returned in the same step; a group ``cancel_stale`` closes still yields
    ``group_size`` rollouts (``launch``). After ``stop_admitting_train`` (the drain) unstarted
    remainders of open train groups are abandoned instead: nothing will train on them.

Environments
    ``env.run(client, example, *, group_id, episode_id, sampling) -> Rollout`` once per
    rollout, on its group's client.

Gauges: ``gauges()``, pulled by the periodic logger: permits, queue depth, the admission,
emission, error, timeout and cancellation counters, open groups and pending evals.

Never: sleep or read time except through asyncio and the injected clock; import another
orchestrator component; swallow a failure of its own loop (it is stored, re-raised from
``start()`` and from ``check()``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_orch.orchestrator.dispatcher.admission import Admission
from jaxrl_orch.orchestrator.dispatcher.evals import EvalQueue
from jaxrl_orch.orchestrator.dispatcher.launch import Launcher
from jaxrl_orch.orchestrator.dispatcher.settings import DispatchConfig, EvalPlan, GateHooks
from jaxrl_orch.types import Environment, InferencePool, PolicyHandle, Source

__all__ = ["DispatchConfig", "EvalPlan", "GateHooks", "RolloutDispatcher"]


class RolloutDispatcher:
    """Keeps the engine busy (see the module docstring)."""

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
        on_open: Callable[[str, int, Any], None] | None = None,
    ) -> None:
        if not isinstance(config, DispatchConfig):
            raise TypeError(f"config must be a DispatchConfig, got {type(config).__name__}")
        gate = gate or GateHooks()
        envs = dict(envs)
        group_size, sampling, self.sources = config.resolve(envs, source)
        self.policy = policy
        self.config = config
        self.evals = EvalQueue(eval_plan or EvalPlan(), envs, sampling)
        self.eval_sources = self.evals.sources
        self._wake = asyncio.Event()
        self.launcher = Launcher(
            pool, envs, self.evals.envs, config, gate, clock=clock, wake=self._wake.set
        )
        self.out_q = self.launcher.flights.out_q
        self.admission = Admission(
            self.sources,
            group_size,
            sampling,
            policy,
            gate.capacity_fn,
            self.launcher,
            self.evals,
            on_open=on_open,
        )
        self._stopping = False
        self._error: BaseException | None = None
        self._run_task: asyncio.Task | None = None

    max_inflight = property(lambda self: self.launcher.max_inflight, doc="permits in all")
    permits = property(lambda self: self.launcher.permits, doc="permits free now")
    inflight = property(lambda self: self.launcher.inflight, doc="rollouts holding a permit")
    admitted_total = property(lambda self: self.launcher.admitted_total, doc="train admissions")
    eval_admitted_total = property(lambda self: self.launcher.eval_admitted_total)

    # ------------------------------------------------------------------ control
    def notify(self) -> None:
        """Capacity may have grown behind the dispatcher's back (the sink discarded rollouts the
        gate had accepted): run a fill pass now rather than at the next poll."""
        self._wake.set()

    def stop_admitting_train(self) -> None:
        """The drain: no new train rollouts from now on; eval and in-flight work continue."""
        self.admission.stop_train()

    @property
    def idle(self) -> bool:
        """Nothing in flight and no eval work waiting: the drain is complete."""
        return not self.launcher.flights and not self.evals

    def train_in_flight(self) -> list[int]:
        """For each train rollout started and not yet on ``out_q``, the version its group opened
        at: a lower bound on its head version, for the loop's ``pace`` policy.

        Unstarted rollouts of a group started half-way (too few permits) do not count: they
        will start under the current version or a later one. They wait on permits, not on the
        gate (the group opened only with gate room for all of it, and open groups continue
        first), so a held trainer never keeps them from starting.
        """
        return self.launcher.train_in_flight()

    def check(self) -> None:
        """Re-raise the failure that killed the dispatcher's loop, if any."""
        if self._error is not None:
            raise self._error

    def schedule_eval(self, step: int) -> dict[str, int]:
        """Queue one eval pass; returns how many eval rollouts each env will emit for ``step``."""
        counts = self.evals.schedule(step)
        self._wake.set()
        return counts

    def drop_pending_evals(self) -> int:
        """Forget eval work not started yet (a forced drain); returns how many were dropped."""
        return self.evals.drop()

    def cancel_stale(self, min_version: int) -> int:
        """Cancel train work of groups opened before ``min_version``; returns rollouts cancelled.

        In-flight ones come out as error rollouts once their task unwinds; unstarted ones of
        those groups come out at once, so each group still yields ``group_size`` rollouts.
        """
        return self.launcher.cancel_stale(min_version)

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        """Checkpointable: each train source's cursor and the id counters. Rollouts in flight
        at save time are not part of it: on resume their prompts are not replayed."""
        return {
            "sources": {env: src.state() for env, src in self.sources.items()},
            "next_group_id": self.admission.next_group_id,
            "next_episode_id": self.launcher.next_episode_id,
            "train_groups": self.admission.train_groups,
        }

    def restore(self, state: dict[str, Any]) -> None:
        unknown = set(state["sources"]) - set(self.sources)
        if unknown:
            raise ValueError(
                f"saved sources {sorted(unknown)} are not train envs {sorted(self.sources)}"
            )
        for env, src_state in state["sources"].items():
            self.sources[env].restore(src_state)
        next_group_id = int(state["next_group_id"])
        self.admission.next_group_id = next_group_id
        self.launcher.next_episode_id = int(state["next_episode_id"])
        self.admission.train_groups = int(state.get("train_groups", next_group_id))

    def recover(self, recovery: Any) -> None:
        """A restart's plan (``recovery.Recovery``), before ``start()``: its groups are sent
        again before new data, and groups opening take the rollouts it kept."""
        self.admission.recover(recovery)

    # ------------------------------------------------------------------ the loop
    async def start(self) -> None:
        """Run the dispatch loop until ``stop()``. A failure is stored and re-raised here."""
        if self._run_task is not None:
            raise RuntimeError("RolloutDispatcher.start() called twice")
        self._run_task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        flights = self.launcher.flights
        watch = asyncio.create_task(self._watch_policy(), name="dispatcher-policy-watch")
        try:
            while not self._stopping:
                self._fill()
                if not flights.unreaped and not self._wake.is_set():
                    # A timer, not wait_for: wait_for wraps the wait in a Task every pass.
                    timer = loop.call_later(self.config.poll_interval_s, self._wake.set)
                    try:
                        await self._wake.wait()
                    finally:
                        timer.cancel()
                else:
                    await asyncio.sleep(0)  # one loop turn between passes, always
                self._wake.clear()
                flights.reap()
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
        await self.launcher.flights.stop(self.config.stop_timeout_s)
        run = self._run_task
        if run is not None and run is not asyncio.current_task() and not run.done():
            await asyncio.wait([run], timeout=self.config.stop_timeout_s)

    async def _watch_policy(self) -> None:
        # A new version moves the gate's bound: run a fill pass now rather than at the poll.
        while True:
            await self.policy.wait_advanced()
            self._wake.set()

    def _fill(self) -> None:
        # Rollouts that finish eagerly hand their permits straight back, so permits alone no
        # longer end a pass: one pass admits at most ``max_inflight``, then yields a loop turn
        # (the main loop drains out_q) and the next pass follows at once.
        launcher = self.launcher
        budget = launcher.admitted_total + launcher.eval_admitted_total + launcher.max_inflight
        while launcher.permits > 0 and not self._stopping:
            if launcher.admitted_total + launcher.eval_admitted_total >= budget:
                self._wake.set()
                return
            if not (self.admission.admit_eval() or self.admission.admit_train()):
                return

    # ------------------------------------------------------------------ metrics
    def gauges(self) -> dict[str, float]:
        launcher = self.launcher
        flights = launcher.flights
        return {
            "dispatcher/inflight": float(launcher.inflight),
            "dispatcher/permits_available": float(launcher.permits),
            "dispatcher/out_q_depth": float(self.out_q.qsize()),
            "dispatcher/admitted_total": float(launcher.admitted_total),
            "dispatcher/eval_admitted_total": float(launcher.eval_admitted_total),
            "dispatcher/emitted_total": float(flights.emitted_total),
            "dispatcher/errors_total": float(flights.errors_total),
            "dispatcher/env_timeouts_total": float(flights.timeouts_total),
            "dispatcher/cancelled_total": float(flights.cancelled_total),
            "dispatcher/open_groups": float(len(launcher.groups) + len(launcher.eval_groups)),
            "dispatcher/eval_pending": float(len(self.evals)),
        }
