"""What this start of the RL stage cost: ``RestartClock``.

What it owns: the seconds from the command's start (``RunParts.started``: ``train.main``
entered, before the config is read and JAX imported) to the first rollout the loop takes and to
the first RL train step done, in this process; and whether the start was cold or warm. Warm:
more of the programs before the first train step were loaded (from the persistent compilation
cache, ``compose.compile_cache``, or kept whole, ``compose.executables``) than compiled; cold:
no more were, or the cache is off. Not "any hit": a program compiled twice in one process loads
its own entry the second time (a run on an empty cache had 1 hit and 38 misses by its first
step). Decided at the first step, not at the end, for the same reason.

Also what the start took back from the rollout journal (``LoopHooks.on_recovered``: kept,
sent again, not trusted), said when the loop starts and kept in ``restart["rollouts"]``.

Told by the loop (``LoopHooks.on_landed``, the event loop) and the weight path
(``WeightPath.on_trained``, the trainer's thread), each time; only the first counts. Said once
on the console when the first step is done (``== restart: ...``), and in ``summary.json``
(``restart``: ``cold``, ``first_rollout_s``, ``first_step_s``; None where the run never got
there) and the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxrl_orch.compose.compile_cache import CompileCache
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.tools.report import kept_text, start_cost_text


class RestartClock:
    """The stage's first rollout and first step, timed from ``started`` (see the module
    docstring); ``clock``: ``time.monotonic``, what ``started`` was read from."""

    def __init__(
        self,
        started: float,
        cache: CompileCache,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._started = started
        self._cache = cache
        self._clock = clock
        self.first_rollout_s: float | None = None
        self.first_step_s: float | None = None
        self.cold: bool | None = None
        self.rollouts: dict[str, int] | None = None  # None: no journal (keep_pending off)

    def recovered(self, counts: dict[str, int], named: list[str]) -> None:
        """What the loop took back from the rollout journal at its start (the event loop)."""
        self.rollouts = counts
        stage("journal", kept_text(counts))
        for line in named:
            stage("journal", f"not trusted: {line}")

    def landed(self) -> None:
        """An episode reached the loop (the event loop)."""
        if self.first_rollout_s is None:
            self.first_rollout_s = self._clock() - self._started

    def trained(self) -> None:
        """A version was trained (the trainer's thread)."""
        if self.first_step_s is not None:
            return
        self.first_step_s = self._clock() - self._started
        self.cold = _cold(self._cache)
        stage("restart", self.line())

    def line(self) -> str:
        """The console's line: ``warm start: first rollout 3.1 s, first train step 4.0 s after
        the command started; compile cache DIR: 40 hits, 2 misses (95%)``."""
        return start_cost_text({**self.summary(), "compile_cache": self._cache.summary()})

    def summary(self) -> dict[str, Any]:
        cold = self.cold
        if cold is None:  # no step was trained: as far as the run got
            cold = _cold(self._cache)
        return {
            "restart": {
                "cold": cold,
                "first_rollout_s": self.first_rollout_s,
                "first_step_s": self.first_step_s,
                "rollouts": self.rollouts,
            }
        }


def _cold(cache: CompileCache) -> bool:
    reused, compiled = cache.reused()
    return reused <= compiled
