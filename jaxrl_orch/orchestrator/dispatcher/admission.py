"""Admission: which rollout the dispatcher starts next, and the opening of its group.

What it owns
    The train side's data (each env's ``Source``, group size and sampling), the envs' turns,
    the envs whose finite source ran dry, the group ids, the train groups' ordinal, and whether
    train work is admitted at all (the drain stops it: ``stop_train``).

The order, one rollout at a time (``RolloutDispatcher._fill`` asks while permits are free)
    1. a pending eval rollout (``evals.EvalQueue``): finite and step-aligned, it takes a free
       permit before train work does, and never asks the gate;
    2. the oldest open train group with rollouts left to start: open groups continue first, so
       a group's rollouts land close together on one client and reuse its prompt cache;
    3. a fresh group of the next env in turn (one ``Source`` per env; a single source only with
       a single env), and only when the gate has room for all of it (``capacity_fn() >=
       group_size``): a group half-admitted when the gate closes would wait for the next
       version to finish, and its early rollouts would age in the sink past the bound (the
       gate's promise is per group, like AReaL's). A source that raises ``StopIteration``
       has run dry: its env opens no more groups, the others continue.
    After a restart, the groups its plan sends again (``reissue``: drawn before the checkpoint,
    not finished) come before the fresh groups of 3, with their own ordinals; a group opening
    takes the finished rollouts the plan kept for its ordinal (``recovery.Recovery.take``).
    A group is stamped with ``policy.version`` when it opens (``policy_version_at_start``) and
    with where it sits in the run (``position``: its rollouts' sampling seeds).

Who drives it: only ``dispatch.RolloutDispatcher``. A helper of the dispatcher: it starts what
it admits through ``launch.Launcher`` and holds no permit itself.

Never: import another orchestrator component (gate, sinks, watcher, logger, store, loop); call
the gate except through the ``capacity_fn`` it is handed.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_orch.orchestrator.dispatcher.evals import EvalQueue
from jaxrl_orch.orchestrator.dispatcher.groups import GroupInFlight
from jaxrl_orch.orchestrator.dispatcher.launch import Launcher
from jaxrl_orch.types import PolicyHandle, SamplingParams, Source


class Admission:
    """Admits the next rollout (see the module docstring)."""

    def __init__(
        self,
        sources: Mapping[str, Source],
        group_size: Mapping[str, int],
        sampling: Mapping[str, SamplingParams],
        policy: PolicyHandle,
        capacity_fn: Callable[[], int],
        launcher: Launcher,
        evals: EvalQueue,
        *,
        on_open: Callable[[str, int, Any], None] | None = None,
    ) -> None:
        self.sources = sources
        self.group_size = group_size
        self.sampling = sampling
        self.policy = policy
        self.capacity_fn = capacity_fn
        self.launcher = launcher
        self.evals = evals
        self.admitting_train = True
        self.exhausted: set[str] = set()
        self.next_group_id = 0
        self.train_groups = 0
        # A restart's plan (recovery.Recovery): groups to send again before new data, and the
        # finished rollouts a group takes instead of running them; ``on_open(env, ordinal,
        # example)`` hears of each group drawn from the data (the rollout journal).
        self.recovery: Any = None
        self.reissue: collections.deque = collections.deque()
        self.on_open = on_open
        self._env_cycle = itertools.cycle(sorted(sources))

    def recover(self, recovery: Any) -> None:
        """A restart's plan (``recovery.Recovery``): its groups first, its kept rollouts."""
        self.recovery = recovery
        self.reissue = recovery.reissue

    def stop_train(self) -> None:
        """The drain: no new train rollouts from now on; eval and in-flight work continue."""
        self.admitting_train = False

    def admit_eval(self) -> bool:
        """Start the next pending eval rollout, if any (a permit is free: ``_fill`` checked)."""
        pending = self.evals.pop()
        if pending is None:
            return False
        env, example, step, i = pending
        sampling = self.evals.sampling or self.sampling[env]
        g = self._open(env, example, 1, sampling, is_eval=True, eval_step=step)
        g.position = ("eval", env, step, i)
        self.launcher.add(g)
        return self.launcher.launch(g, self.launcher.permits) > 0

    def admit_train(self) -> bool:
        if not self.admitting_train:
            return False
        launcher = self.launcher
        for g in launcher.groups.values():
            if g.unscheduled:
                return launcher.launch(g, min(launcher.permits, self.capacity_fn())) > 0
        if self.reissue:
            return self._admit_again()
        env = self._next_train_env()
        if env is None:
            return False
        size = self.group_size[env]
        capacity = self.capacity_fn()
        if size > capacity:
            return False
        try:
            example = self.sources[env].next_example()
        except StopIteration:
            self.exhausted.add(env)
            return False
        ordinal = self.train_groups
        self.train_groups += 1
        if self.on_open is not None:
            self.on_open(env, ordinal, example)
        return self._start_group(env, ordinal, example, capacity)

    def _admit_again(self) -> bool:
        """A group drawn before the checkpoint and not finished: sent again, same ordinal."""
        env, ordinal, example = self.reissue[0]
        capacity = self.capacity_fn()
        if self.group_size[env] > capacity:
            return False
        self.reissue.popleft()
        return self._start_group(env, ordinal, example, capacity)

    def _start_group(self, env: str, ordinal: int, example: dict[str, Any], capacity: int) -> bool:
        g = self._open(env, example, self.group_size[env], self.sampling[env], is_eval=False)
        g.position = ("train", env, ordinal)
        if self.recovery is not None:
            g.kept = self.recovery.take(ordinal, env, example)
        launcher = self.launcher
        launcher.add(g)
        return launcher.launch(g, min(launcher.permits, capacity)) > 0

    def _next_train_env(self) -> str | None:
        for _ in range(len(self.sources)):
            env = next(self._env_cycle)
            if env not in self.exhausted:
                return env
        return None

    def _open(
        self,
        env: str,
        example: dict[str, Any],
        size: int,
        sampling: SamplingParams,
        *,
        is_eval: bool,
        eval_step: int | None = None,
    ) -> GroupInFlight:
        gid = self.next_group_id
        self.next_group_id += 1
        version = self.policy.version
        return GroupInFlight(
            gid, env, example, size, sampling, version, is_eval, eval_step, None, size
        )
