"""What the main loop leans on to keep moving: progress, stalls, the next episode.

What it owns
- ``Progress``: when the pipeline last moved (a rollout landed, a step shipped, the trainer
  published a version). Past ``stall_timeout_s`` with none of that, ``check`` raises
  ``PipelineStallError`` with what the pipeline is waiting on (what holds the engine, when
  something the loop cannot see does: a caller's pause; in-flight rollouts, gate capacity,
  ready rollouts, awaited evals), so a stall ends the run with a reason instead of hanging it:
  whatever hangs (an environment past any timeout, an engine, the trainer).
- ``next_episode``: the next finished episode, or None after a poll or a new version;
  ``maybe_await``: await a callback's result if it is awaitable.

Helpers of the loop (``loop``, ``shipping``) only; they read the clock they are handed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_orch.types import PolicyHandle, Rollout


class PipelineStallError(RuntimeError):
    """Nothing moved for ``stall_timeout_s``: no rollout landed, no step shipped or trained."""


class Progress:
    """See the module docstring. ``describe`` returns what the pipeline waits on."""

    def __init__(
        self,
        clock: Callable[[], float],
        timeout_s: float | None,
        describe: Callable[[], str],
    ) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self.describe = describe
        self.last = clock()
        self._version: int | None = None

    def moved(self) -> None:
        self.last = self.clock()

    def check(self, version: int) -> None:
        if version != self._version:
            self._version = version
            self.moved()
            return
        if self.timeout_s is None:
            return
        idle = self.clock() - self.last
        if idle > self.timeout_s:
            raise PipelineStallError(
                f"no progress for {idle:.0f}s (stall_timeout_s={self.timeout_s:g}): no rollout "
                f"landed, no step was shipped and the trainer stayed at version {version}; "
                f"{self.describe()}"
            )


async def next_episode(
    q: asyncio.Queue, policy: PolicyHandle, poll_s: float
) -> list[Rollout] | None:
    """The next finished episode, or None after ``poll_s`` or when the policy version advances
    (the loop then re-checks its hold and drain)."""
    if not q.empty():
        return q.get_nowait()
    get = asyncio.ensure_future(q.get())
    advanced = asyncio.ensure_future(policy.wait_advanced())
    await asyncio.wait({get, advanced}, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
    advanced.cancel()
    if get.done():
        return get.result()
    # A cancelled Queue.get leaves any item it was about to take in the queue.
    get.cancel()
    try:
        await get
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
    return None


def waiting_on(
    dispatcher: Mapping[str, float],
    gate: Mapping[str, float],
    sink: Any,
    evals: int,
    held: str | None = None,
) -> str:
    """What a stalled pipeline waits on, from the dispatcher's and gate's gauges, led by what
    holds the engine (``held``) when something does."""
    return (
        ("" if held is None else f"{held}; ")
        + f"{dispatcher['dispatcher/inflight']:.0f} rollouts in flight, gate capacity "
        f"{gate['gate/capacity']:.0f}, {sink.ready_count} of {sink.batch_size} batch rollouts "
        f"ready, {evals} eval rollouts awaited; see gauges.jsonl"
    )


async def maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value
