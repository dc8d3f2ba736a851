"""Drain: how the loop ends, after its last step or on request, bounded when a deadline is set.

What it owns: whether the loop is draining (``draining``: no new train work is admitted), the
drain's deadline (the SIGTERM path) and whether it passed (``abandoned``: the work still in
flight was cancelled), the final eval, and the test of when the drain is complete.

Complete means: nothing in flight or queued on ``out_q``; every awaited eval rollout landed
(unless abandoned); the trainer trained every shipped step, so the final state matches the
data; and, after the last step, the final eval ran on the final weights, not on whatever
version was live when the drain began.

Who drives it: ``loop.Orchestrator`` (``request`` for its caller; ``overdue``, ``abandon`` and
``complete`` on each pass of the main loop) and ``shipping.BatchShipper`` (``after_last_step``
once ``step > max_steps``). The last shipped step is handed in; it never reads the shipper.

Never: admits, ships or cancels work on its own account: it stops the dispatcher's train
admissions and, past the deadline only, drops the queued evals and stops the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopComponents
from jaxrl_orch.orchestrator.faults import warn
from jaxrl_orch.types import PolicyHandle


class Drain:
    """The loop's ending (see the module docstring)."""

    def __init__(
        self,
        config: OrchestratorConfig,
        policy: PolicyHandle,
        parts: LoopComponents,
        schedule_eval: Callable[[int], None],
        clock: Callable[[], float],
    ) -> None:
        self.timeout_s = config.drain_timeout_s
        self.policy = policy
        self.dispatcher = parts.dispatcher
        self.eval_sink = parts.eval_sink
        self.schedule_eval = schedule_eval
        self.clock = clock
        self.draining = False
        self.abandoned = False  # the deadline passed: in-flight work was cancelled
        self._deadline: float | None = None
        self._final_eval_due = False

    def request(self, deadline_s: float | None = None) -> None:
        """Stop admitting train work; let in-flight work land, then stop. With ``deadline_s``
        (the SIGTERM path), work still in flight after it is cancelled (``abandon``)."""
        if deadline_s is not None and self._deadline is None:
            self._deadline = self.clock() + deadline_s
        if not self.draining:
            self.draining = True
            self.dispatcher.stop_admitting_train()

    def after_last_step(self) -> None:
        """Every step is shipped: drain, then evaluate the final weights (with eval sources)."""
        self.request()
        self._final_eval_due = bool(self.dispatcher.eval_sources)

    def overdue(self) -> bool:
        return self._deadline is not None and self.clock() > self._deadline

    def complete(self, last_shipped: int) -> bool:
        if not self.dispatcher.idle or not self.dispatcher.out_q.empty():
            return False
        if self.eval_sink.pending() and not self.abandoned:
            return False
        if self.policy.version < last_shipped:
            return False
        if self._final_eval_due:
            self._final_eval_due = False
            self.schedule_eval(last_shipped)
            return False
        return True

    async def abandon(self, last_shipped: int) -> None:
        """The deadline passed: cancel what is in flight (it lands as cancelled rollouts) and
        queued evals; the drain then ends once the trainer has trained what was shipped."""
        self._deadline = None
        self.abandoned = True
        self._final_eval_due = False
        n = self.dispatcher.inflight
        dropped = self.dispatcher.drop_pending_evals()
        await self.dispatcher.stop()
        warn(
            f"!! drain deadline (drain_timeout_s={self.timeout_s:g}) passed: "
            f"cancelled {n} rollouts in flight and {dropped} queued eval rollouts; stopping "
            f"after the trainer's step {last_shipped}"
        )
