"""Fakes for driving a ``RolloutDispatcher`` on the virtual-time event loop: a pool of
clients, a counting source, a scripted env, a gate that counts, and ``make`` to wire them.

``vclock.VirtualTimeLoop`` jumps its clock to the next timer whenever nothing is ready, so
rollouts that "take" seconds finish instantly and every run is deterministic.
"""

from __future__ import annotations

import asyncio

from jaxrl_orch.orchestrator.dispatcher.dispatch import (
    DispatchConfig,
    GateHooks,
    RolloutDispatcher,
)
from jaxrl_orch.orchestrator.vclock import VirtualTimeLoop
from jaxrl_orch.types import PolicyHandle, Rollout, SamplingParams

SAMPLING = SamplingParams(temperature=0.7, max_tokens=4)


def run_virtual(coro_fn):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro_fn(loop))
    finally:
        # A failed scenario leaves tasks behind: unwind them so the failure reads cleanly.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()


class FakeClient:
    def __init__(self, idx: int) -> None:
        self.idx = idx


class FakePool:
    def __init__(self, n: int) -> None:
        self.clients = [FakeClient(i) for i in range(n)]
        self.selects = 0

    def select(self) -> FakeClient:
        self.selects += 1
        return self.clients[(self.selects - 1) % len(self.clients)]


class CountingSource:
    def __init__(self, limit: int | None = None, env: str | None = None) -> None:
        self.i, self.limit, self.env = 0, limit, env

    def next_example(self):
        if self.limit is not None and self.i >= self.limit:
            raise StopIteration
        self.i += 1
        ex = {"prompt": self.i - 1}
        return ex if self.env is None else {**ex, "env": self.env}

    def state(self):
        return {"i": self.i}

    def restore(self, state):
        self.i = state["i"]


class ScriptedEnv:
    """``script(group_id, episode_id) -> (delay_s, outcome)``; outcome in ok/raise/empty/hang/
    bad_type/cut (a rollout whose completion the engine ended short: not trainable). ``run`` is
    a plain function so a call is recorded the moment it is dispatched."""

    def __init__(self, name="toy", script=lambda g, e: (1.0, "ok")) -> None:
        self.name, self.script = name, script
        self.calls: list[tuple[int, int, int, dict]] = []

    def run(self, client, example, *, group_id, episode_id, sampling):
        self.calls.append((group_id, episode_id, client.idx, example))
        if self.script(group_id, episode_id)[1] == "sync_raise":
            raise KeyError("failed before returning a coroutine")
        return self._run(group_id, episode_id, example, sampling)

    async def _run(self, group_id, episode_id, example, sampling):
        delay, outcome = self.script(group_id, episode_id)
        if outcome == "hang":
            await asyncio.sleep(1e9)
        elif delay is not None:  # None: finish without ever suspending (an instant engine)
            await asyncio.sleep(delay)
        if outcome == "raise":
            raise RuntimeError(f"env blew up on episode {episode_id}")
        if outcome == "bad_type":
            return {"not": "a rollout"}
        return Rollout(
            env="wrong-name",
            group_id=-1,
            episode_id=-1,
            example=example,
            token_ids=[5, 6, 7],
            loss_mask=[False, True, True],
            logprobs=[0.0, -0.5, -0.25],
            versions=[-1, 0, 0],
            reward=float(example["prompt"]),
            num_turns=0 if outcome == "empty" else 1,
            temperature=sampling.temperature,
            trainable=outcome != "cut",
            cut="abort" if outcome == "cut" else None,
        )


class FakeGate:
    def __init__(self, limit: int = 1 << 30) -> None:
        self.limit, self.running, self.admitted, self.accepted, self.rejected = limit, 0, 0, 0, 0
        self.max_running = 0

    def capacity(self) -> int:
        return self.limit - self.running

    def on_admit(self, n: int) -> None:
        self.running += n
        self.admitted += n
        self.max_running = max(self.max_running, self.running)

    def on_finish(self, n: int, accepted: bool) -> None:
        assert n <= self.running, "on_finish for rollouts never admitted"
        self.running -= n
        if accepted:
            self.accepted += n
        else:
            self.rejected += n


def make(loop, env, *, gate=None, pool=None, source=None, eval_plan=None, **config):
    """A dispatcher of one env on ``loop``'s clock; ``config``: ``DispatchConfig`` fields."""
    gate = gate or FakeGate()
    policy = PolicyHandle()
    config = {"max_inflight": 4, "group_size": 2, "sampling": SAMPLING, **config}
    d = RolloutDispatcher(
        pool or FakePool(3),
        {env.name: env},
        source or CountingSource(),
        policy,
        DispatchConfig(**config),
        gate=GateHooks(gate.capacity, gate.on_admit, gate.on_finish),
        eval_plan=eval_plan,
        clock=loop.time,
    )
    return d, gate, policy


def drain(d) -> list[list[Rollout]]:
    out = []
    while not d.out_q.empty():
        out.append(d.out_q.get_nowait())
    return out


async def until(loop, cond, limit_s=1e5):
    deadline = loop.time() + limit_s
    while not cond():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.25)
