"""EvalQueue: the eval passes the dispatcher owes, as examples waiting for a permit.

What it owns
    The eval envs and sources (``settings.EvalPlan``, resolved against the train envs), each
    eval source's state at construction, the eval sampling and the eval examples not started
    yet. ``schedule(step)`` restores each eval source to its state at construction and draws
    ``EvalPlan.num_examples`` examples from it, so every eval runs the same prompts and evals
    at different steps are comparable; each example becomes one rollout (a group of one),
    emitted with ``Rollout.eval_step = step``. Eval rollouts are finite and step-aligned: the
    dispatcher starts them before train work (``admission.Admission``) and they never touch
    the gate.

Who drives it: only ``dispatch.RolloutDispatcher`` (``schedule``, ``drop``) and its
``admission.Admission`` (``pop``). A helper of the dispatcher: it holds no permit and starts
nothing.

Never: import another orchestrator component (gate, sinks, watcher, logger, store, loop).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from jaxrl_orch.orchestrator.dispatcher.settings import EvalPlan
from jaxrl_orch.types import Environment, SamplingParams

# One eval rollout not started yet: (env, example, step, index of the example in the pass).
PendingEval = tuple[str, dict[str, Any], int, int]


class EvalQueue:
    """The eval work not started yet (see the module docstring)."""

    def __init__(
        self,
        plan: EvalPlan,
        train_envs: Mapping[str, Environment],
        train_sampling: Mapping[str, SamplingParams],
    ) -> None:
        self.envs, self.sources = plan.resolve(train_envs, train_sampling)
        # Every eval restarts its sources here, so evals at different steps are comparable.
        self._source_state = {e: s.state() for e, s in self.sources.items()}
        self.num_examples = plan.num_examples
        self.sampling = plan.sampling
        self._pending: collections.deque[PendingEval] = collections.deque()

    def __len__(self) -> int:
        """Eval rollouts waiting for a permit."""
        return len(self._pending)

    def schedule(self, step: int) -> dict[str, int]:
        """Queue one eval pass; returns how many eval rollouts each env will emit for ``step``."""
        counts: dict[str, int] = {}
        for env, src in self.sources.items():
            src.restore(self._source_state[env])
            for i in range(self.num_examples):
                self._pending.append((env, src.next_example(), step, i))
            counts[env] = self.num_examples
        return counts

    def pop(self) -> PendingEval | None:
        """The next eval rollout to start, oldest pass first; None when none waits."""
        return self._pending.popleft() if self._pending else None

    def drop(self) -> int:
        """Forget eval work not started yet (a forced drain); returns how many were dropped."""
        n = len(self._pending)
        self._pending.clear()
        return n
