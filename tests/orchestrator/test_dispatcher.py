"""RolloutDispatcher against fake pools, envs and sources on the virtual-time event loop.

``vclock.VirtualTimeLoop`` jumps its clock to the next timer whenever nothing is ready, so
rollouts that "take" seconds finish instantly and every run is deterministic.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_orch.orchestrator.dispatcher.dispatch import (
    DispatchConfig,
    EvalPlan,
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
    bad_type. ``run`` is a plain function so a call is recorded the moment it is dispatched."""

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


# --------------------------------------------------------------------------- properties


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    max_inflight=st.integers(1, 6),
    group_size=st.integers(1, 4),
    n_groups=st.integers(1, 10),
    drop_after=st.sampled_from([None, 0, 1]),
    gate_limit=st.integers(1, 8),
)
def test_every_dispatched_rollout_emitted_exactly_once(
    seed, max_inflight, group_size, n_groups, drop_after, gate_limit
):
    rng = random.Random(seed)
    outcomes = ["ok"] * 5 + ["raise", "empty", "hang", "bad_type", "sync_raise"]
    plan: dict[tuple[int, int], tuple[float, str]] = {}

    def script(g, e):
        # Delays: none at all (finishes in its eager first step), one bare loop turn, or real.
        delay = rng.choice([None, 0.0, rng.uniform(0, 3), rng.uniform(0, 3)])
        return plan.setdefault((g, e), (delay, rng.choice(outcomes)))

    async def scenario(loop):
        env = ScriptedEnv(script=script)
        d, gate, policy = make(
            loop,
            env,
            gate=FakeGate(gate_limit),
            source=CountingSource(limit=n_groups),
            max_inflight=max_inflight,
            group_size=group_size,
        )
        runner = asyncio.create_task(d.start())
        for _ in range(rng.randint(0, 6)):  # random version bumps and cancellations
            await asyncio.sleep(rng.uniform(0, 2))
            if rng.random() < 0.5:
                policy.advance(policy.version + 1)
                if drop_after is not None:  # what the loop's ``drop`` policy does
                    d.cancel_stale(policy.version - drop_after)
            else:
                d.cancel_stale(policy.version)
        await asyncio.sleep(200)  # every finite delay has elapsed; only hung rollouts remain
        d.stop_admitting_train()
        d.cancel_stale(1 << 30)  # releases hung rollouts and closes half-started groups
        await until(loop, lambda: d.idle)
        await d.stop()
        await runner
        return env, d, gate

    env, d, gate = run_virtual(scenario)
    episodes = drain(d)
    rollouts = [r for ep in episodes for r in ep]
    ids = [r.episode_id for r in rollouts]
    assert len(ids) == len(set(ids)), "a rollout was emitted twice"
    dispatched = {e for _, e, _, _ in env.calls}
    assert dispatched <= set(ids), "a dispatched rollout never reached out_q"
    never_started = [r for r in rollouts if r.episode_id not in dispatched]
    assert all("never started" in r.errors[0] for r in never_started)
    per_group: dict[int, int] = {}
    for r in rollouts:
        per_group[r.group_id] = per_group.get(r.group_id, 0) + 1
    if gate_limit < group_size:
        # A fresh group needs gate room for all of its rollouts: none could ever open.
        assert not rollouts and not env.calls
    else:
        assert set(per_group.values()) == {group_size}, "a group came out incomplete"
    assert d.permits == d.max_inflight, "permits leaked"
    assert gate.running == 0 and gate.admitted == len(dispatched)
    assert gate.accepted == sum(not r.has_error for r in rollouts)
    assert gate.max_running <= gate_limit
    assert d.gauges()["dispatcher/errors_total"] == sum(r.has_error for r in rollouts)
    for r in rollouts:
        outcome = plan.get((r.group_id, r.episode_id), (0, "never"))[1]
        if outcome in ("raise", "empty", "bad_type", "hang", "sync_raise"):
            assert r.has_error and not r.trainable


# --------------------------------------------------------------------------- behaviours


def test_group_pinned_to_one_client_and_open_groups_continue_first():
    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (random.Random(e).uniform(0.1, 2.0), "ok"))
        d, _, _ = make(loop, env, source=CountingSource(limit=6), max_inflight=3, group_size=4)
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: len(env.calls) == 24 and d.idle)
        await d.stop()
        await runner
        return env, d

    env, d = run_virtual(scenario)
    clients: dict[int, set[int]] = {}
    for gid, _, client, _ in env.calls:
        clients.setdefault(gid, set()).add(client)
    assert all(len(c) == 1 for c in clients.values()), clients
    assert len({next(iter(c)) for c in clients.values()}) == 3  # the pool spread the groups
    gids = [gid for gid, _, _, _ in env.calls]
    assert gids == sorted(gids), "a fresh group started while an open one had work left"
    for ep in drain(d):
        (r,) = ep
        assert r.env == "toy" and r.episode_id >= 0 and r.admitted_at <= r.finished_at


def test_rollouts_are_stamped_and_failures_become_error_rollouts():
    outcomes = {0: "ok", 1: "raise", 2: "empty", 3: "bad_type", 4: "sync_raise"}

    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (1.5, outcomes.get(e, "ok")))
        d, gate, policy = make(
            loop, env, source=CountingSource(limit=3), max_inflight=5, group_size=2
        )
        policy.advance(3)
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: d.gauges()["dispatcher/emitted_total"] == 6)
        await d.stop()
        await runner
        return d, gate

    d, gate = run_virtual(scenario)
    by_id = {r.episode_id: r for ep in drain(d) for r in ep if r.episode_id in outcomes}
    assert not by_id[0].has_error and by_id[0].trainable
    assert (
        by_id[0].group_id == 0 and by_id[0].env == "toy" and by_id[0].policy_version_at_start == 3
    )
    assert by_id[0].finished_at - by_id[0].admitted_at == pytest.approx(1.5)
    assert by_id[1].errors == ["RuntimeError: env blew up on episode 1"]
    assert by_id[2].errors[0].startswith("EmptyTrajectory")
    assert by_id[3].errors[0].startswith("TypeError") and "dict" in by_id[3].errors[0]
    assert by_id[4].errors == ["KeyError: 'failed before returning a coroutine'"]
    assert all(not r.trainable for i, r in by_id.items() if i)
    assert (gate.accepted, gate.rejected) == (2, 4)  # episode 5 is ok


def test_cancel_stale_cancels_inflight_and_closes_unstarted_remainder():
    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (0.0, "hang"))
        d, gate, policy = make(loop, env, max_inflight=1, group_size=3)
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: len(env.calls) == 1)
        policy.advance(1)
        assert d.cancel_stale(0) == 0  # version 0 is still trainable: nothing cancelled
        assert d.cancel_stale(1) == 3
        await until(loop, lambda: d.out_q.qsize() == 2)  # the placeholder episode, then ours
        await d.stop()
        await runner
        return d, gate

    d, gate = run_virtual(scenario)
    rollouts = [r for ep in drain(d) for r in ep if r.group_id == 0]
    assert len(rollouts) == 3 and all(r.errors[0].startswith("Cancelled") for r in rollouts)
    # Group 0's one started rollout, then group 1 (opened after the cancel, hung until stop).
    assert gate.admitted == 2 and gate.rejected == 2 and gate.running == 0
    assert d.gauges()["dispatcher/cancelled_total"] >= 3


def test_eval_rollouts_run_alongside_training_outside_the_gate():
    async def scenario(loop):
        train, ev = ScriptedEnv("toy"), ScriptedEnv("evalenv")
        gate = FakeGate(2)
        d, _, _ = make(
            loop,
            train,
            gate=gate,
            max_inflight=6,
            group_size=2,
            eval_plan=EvalPlan(
                envs={"evalenv": ev},
                sources={"evalenv": CountingSource()},
                num_examples=3,
                sampling=SamplingParams(temperature=0.0),
            ),
        )
        runner = asyncio.create_task(d.start())
        assert d.schedule_eval(5) == {"evalenv": 3}
        await until(loop, lambda: len(ev.calls) == 3 and d.idle is False)
        assert d.schedule_eval(10) == {"evalenv": 3}
        await until(loop, lambda: len(ev.calls) == 6)
        await until(loop, lambda: not d._eval_groups and not d._eval_pending)
        await d.stop()
        await runner
        return d, gate, ev

    d, gate, ev = run_virtual(scenario)
    episodes = drain(d)
    evals = [r for ep in episodes for r in ep if r.is_eval]
    assert len(evals) == 6 and all(r.env == "evalenv" for r in evals)
    assert all(len(ep) == 1 for ep in episodes if ep[0].is_eval)  # one rollout per example
    assert sorted(r.eval_step for r in evals) == [5] * 3 + [10] * 3
    assert all(r.example == {"prompt": r.example["prompt"]} for r in evals)  # untouched
    assert all(r.eval_step is None for ep in episodes for r in ep if not r.is_eval)
    assert all(r.temperature == 0.0 for r in evals)
    # Every eval restarts its source: both passes saw prompts 0, 1, 2.
    assert [c[3]["prompt"] for c in ev.calls] == [0, 1, 2, 0, 1, 2]
    assert gate.max_running <= 2 and gate.admitted == d.admitted_total
    assert d.eval_admitted_total == 6


def test_stop_emits_hung_rollouts_as_cancelled_and_restores_permits():
    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (0.0, "hang"))
        d, gate, _ = make(loop, env, max_inflight=3, group_size=3)
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: len(env.calls) == 3)
        await d.stop()
        await runner
        return d, gate

    d, gate = run_virtual(scenario)
    rollouts = [r for ep in drain(d) for r in ep]
    assert len(rollouts) == 3 and all(
        r.errors == ["Cancelled: dispatcher stopped"] for r in rollouts
    )
    assert d.permits == 3 and gate.running == 0


def test_loop_failure_is_raised_from_start_and_check():
    async def scenario(loop):
        env = ScriptedEnv()
        d, _, _ = make(loop, env)
        d.capacity_fn = lambda: 1 // 0
        with pytest.raises(ZeroDivisionError):
            await d.start()
        with pytest.raises(ZeroDivisionError):
            d.check()

    run_virtual(scenario)


def test_per_env_sources_round_robin_and_finite_sources_run_dry():
    async def scenario(loop):
        a, b = ScriptedEnv("a"), ScriptedEnv("b")
        d = RolloutDispatcher(
            FakePool(1),
            {"a": a, "b": b},
            {"a": CountingSource(2), "b": CountingSource(5)},
            PolicyHandle(),
            DispatchConfig(max_inflight=2, group_size={"a": 1, "b": 2}, sampling=SAMPLING),
            clock=loop.time,
        )
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: d._exhausted == {"a", "b"} and d.idle)
        await d.stop()
        await runner
        return a, b

    a, b = run_virtual(scenario)
    assert len(a.calls) == 2 and len(b.calls) == 10
    # Envs take turns opening groups until "a" runs dry after its two examples.
    assert {g for g, *_ in a.calls} == {0, 2} and {g for g, *_ in b.calls} == {1, 3, 4, 5, 6}


def test_oldest_train_version_and_state_round_trip():
    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (0.0, "hang"))
        d, _, policy = make(loop, env, max_inflight=2, group_size=1)
        assert d.oldest_train_version() is None
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: len(env.calls) == 2)
        policy.advance(4)
        d.cancel_stale(1)  # frees both permits; new groups open at version 4
        await until(loop, lambda: len(env.calls) == 4)
        assert d.oldest_train_version() == 4
        saved = d.state()
        await d.stop()
        await runner
        fresh, _, _ = make(loop, ScriptedEnv(), max_inflight=2, group_size=1)
        fresh.restore(saved)
        return saved, fresh

    saved, fresh = run_virtual(scenario)
    assert saved == {
        "sources": {"toy": {"i": 4}},
        "next_group_id": 4,
        "next_episode_id": 4,
        "train_groups": 4,
    }
    assert fresh.sources["toy"].next_example() == {"prompt": 4}
    assert fresh.state()["next_episode_id"] == 4
    with pytest.raises(ValueError, match="'gone'"):
        fresh.restore({**saved, "sources": {"gone": {}}})


def _dispatcher(*, envs=None, source=None, eval_plan=None, **config):
    """A dispatcher with valid defaults, overridden by the arguments."""
    envs = {"toy": ScriptedEnv()} if envs is None else envs
    config = {"max_inflight": 4, "group_size": 2, "sampling": SAMPLING, **config}
    return RolloutDispatcher(
        FakePool(1),
        envs,
        CountingSource() if source is None else source,
        PolicyHandle(),
        DispatchConfig(**config),
        eval_plan=eval_plan,
    )


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: DispatchConfig(0, 2, SAMPLING), "max_inflight must be an int >= 1, got 0"),
        (lambda: DispatchConfig(4, 2, SAMPLING, poll_interval_s=0), "poll_interval_s .* got 0"),
        (lambda: DispatchConfig(4, 2, SAMPLING, stop_timeout_s=-1), "stop_timeout_s .* got -1"),
        (lambda: EvalPlan(num_examples=0), "eval num_examples must be an int >= 1, got 0"),
        (lambda: _dispatcher(envs={}), "at least one training environment"),
        (lambda: _dispatcher(group_size=0), "group_size for env 'toy' must be an int >= 1"),
        (lambda: _dispatcher(group_size={"other": 2}), "group_size keys"),
        (lambda: _dispatcher(sampling="greedy"), "sampling for env 'toy' must be a Sampling"),
        (
            lambda: _dispatcher(source={"toy": CountingSource(), "x": CountingSource()}),
            "source keys",
        ),
        (
            lambda: _dispatcher(envs={"a": ScriptedEnv("a"), "b": ScriptedEnv("b")}),
            "need a source per env",
        ),
        (
            lambda: _dispatcher(eval_plan=EvalPlan(sources={"nope": CountingSource()})),
            "eval source 'nope'",
        ),
        (
            lambda: _dispatcher(
                eval_plan=EvalPlan(envs={"ev": ScriptedEnv("ev")}, sources={"ev": CountingSource()})
            ),
            r"eval envs \['ev'\] have no train sampling params",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_config_must_be_a_dispatch_config():
    with pytest.raises(TypeError, match="config must be a DispatchConfig, got dict"):
        RolloutDispatcher(FakePool(1), {"toy": ScriptedEnv()}, CountingSource(), PolicyHandle(), {})


def test_runs_on_a_standard_event_loop_with_real_time():
    async def main():
        loop = asyncio.get_running_loop()
        rng = random.Random(0)
        env = ScriptedEnv(script=lambda g, e: (rng.uniform(0, 0.002), rng.choice(["ok", "raise"])))
        d, gate, _ = make(
            loop,
            env,
            source=CountingSource(limit=8),
            max_inflight=3,
            group_size=3,
            poll_interval_s=0.01,
        )
        runner = asyncio.create_task(d.start())
        deadline = loop.time() + 60  # a safety cap, not a timing assertion
        while d.gauges()["dispatcher/emitted_total"] < 24:
            assert loop.time() < deadline, "rollouts never all came out"
            await asyncio.sleep(0.001)
        await d.stop()
        await runner
        return d, gate

    d, gate = asyncio.run(main())
    assert sorted(r.episode_id for ep in drain(d) for r in ep) == list(range(24))
    assert d.permits == 3 and gate.running == 0 and gate.admitted == 24


def test_fresh_group_opens_only_when_the_gate_has_room_for_all_of_it():
    """A group of 4 never starts with capacity 3 (it would be half-admitted and age in the sink
    waiting for a version); with capacity 4 all four start even though permits come one by one."""

    async def scenario(loop, limit):
        env = ScriptedEnv(script=lambda g, e: (1.0, "ok"))
        gate = FakeGate(limit=limit)
        d, _, _ = make(loop, env, gate=gate, max_inflight=8, group_size=4)
        runner = asyncio.create_task(d.start())
        await asyncio.sleep(0.5)
        started = len(env.calls)
        await d.stop()
        await runner
        return started

    assert run_virtual(lambda loop: scenario(loop, 3)) == 0
    assert run_virtual(lambda loop: scenario(loop, 4)) == 4
    assert run_virtual(lambda loop: scenario(loop, 7)) == 4


def test_rollouts_that_never_suspend_are_emitted_in_the_same_pass_without_tasks():
    async def scenario(loop):
        # Episodes 0-3 finish in their first step; the rest suspend once on the engine.
        env = ScriptedEnv(script=lambda g, e: (None if e < 4 else 1.0, "ok"))
        d, gate, _ = make(loop, env, max_inflight=6, group_size=2)
        tasks_before = len(asyncio.all_tasks())
        d._fill()  # one scheduling pass, no loop turn
        instant = drain(d)
        assert [len(ep) for ep in instant] == [1, 1, 1, 1]  # still one episode per rollout
        assert [r.episode_id for ep in instant for r in ep] == [0, 1, 2, 3]
        assert all(not r.has_error and r.group_id in (0, 1) for ep in instant for r in ep)
        # Instant ones gave their permits back at once; the pass stopped at max_inflight
        # admissions, and the two that suspended are still running.
        assert (gate.accepted, gate.running, gate.admitted) == (4, 2, 6)
        assert d.inflight == 2 and len(asyncio.all_tasks()) == tasks_before + 2
        assert d.oldest_train_version() == 0
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: d.out_q.qsize() >= 2)  # the suspended ones land as usual
        await d.stop()
        await runner
        return d, gate

    d, gate = run_virtual(scenario)
    assert d.permits == d.max_inflight and gate.running == 0
    assert gate.accepted + gate.rejected == gate.admitted == d.gauges()["dispatcher/emitted_total"]


def test_instant_failures_and_bad_results_become_error_rollouts():
    outcomes = {0: "raise", 1: "empty", 2: "bad_type", 3: "sync_raise"}

    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (None, outcomes.get(e, "ok")))
        d, gate, _ = make(
            loop,
            env,
            source=CountingSource(limit=3),
            gate=FakeGate(6),
            group_size=2,
            max_inflight=6,
        )
        d._fill()
        return drain(d), d, gate

    episodes, d, gate = run_virtual(scenario)
    rollouts = {r.episode_id: r for ep in episodes for r in ep}
    assert sorted(rollouts) == list(range(6))
    assert "RuntimeError" in rollouts[0].errors[0]
    assert "EmptyTrajectory" in rollouts[1].errors[0]
    assert "TypeError" in rollouts[2].errors[0] and "expected 1 Rollout" in rollouts[2].errors[0]
    assert "KeyError" in rollouts[3].errors[0]
    assert not rollouts[4].has_error and not rollouts[5].has_error
    assert (gate.accepted, gate.rejected, gate.running) == (2, 4, 0)
    assert d.permits == d.max_inflight


def test_notify_runs_a_fill_pass_without_waiting_for_the_poll():
    from jaxrl_orch.orchestrator.gate import StalenessGate

    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (None, "ok"))
        gate = StalenessGate(max_staleness=0, batch_size=2, max_concurrent=8)
        d, _, _ = make(loop, env, gate=gate, group_size=2, poll_interval_s=1e6)
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: d.out_q.qsize() == 2)
        t0 = loop.time()
        gate.on_discard(2)  # what the sink reports when it drops a flat group
        for _ in range(5):
            await asyncio.sleep(0)
        assert d.out_q.qsize() == 2  # asleep: nothing told it
        d.notify()
        for _ in range(5):
            await asyncio.sleep(0)
        assert d.out_q.qsize() == 4 and loop.time() == t0
        await d.stop()
        await runner

    run_virtual(scenario)


def test_an_instant_env_cannot_starve_the_event_loop():
    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (None, "ok"))
        d, _, _ = make(loop, env, max_inflight=3, group_size=1)  # no gate bound, endless source
        runner = asyncio.create_task(d.start())
        sizes = []
        for _ in range(4):
            await asyncio.sleep(0)
            sizes.append(d.out_q.qsize())
        # Control came back every turn, and each pass admitted at most max_inflight.
        assert 0 < sizes[0] <= 3 and sizes[-1] > sizes[0]
        assert all(b - a <= 3 for a, b in zip(sizes, sizes[1:], strict=False))
        await d.stop()
        await runner

    run_virtual(scenario)


class SeedEnv(ScriptedEnv):
    """Records the sampling seed each rollout was dispatched with."""

    def __init__(self, name="toy") -> None:
        super().__init__(name, lambda g, e: (1.0, "ok"))
        self.seeds: list[tuple[int, int | None]] = []  # (prompt, seed)

    def run(self, client, example, *, group_id, episode_id, sampling):
        self.seeds.append((example["prompt"], sampling.seed))
        return super().run(
            client, example, group_id=group_id, episode_id=episode_id, sampling=sampling
        )


def _seeded_run(request_seed, *, pool_size=3, max_inflight=4, groups=4, restore=None):
    async def scenario(loop):
        env, ev = SeedEnv(), SeedEnv("evalenv")
        plan = EvalPlan({"evalenv": ev}, {"evalenv": CountingSource()}, 2, SAMPLING)
        d, _, _ = make(
            loop,
            env,
            pool=FakePool(pool_size),
            source=CountingSource(
                limit=groups + (restore or {}).get("sources", {}).get("toy", {"i": 0})["i"]
            ),
            max_inflight=max_inflight,
            group_size=3,
            request_seed=request_seed,
            eval_plan=plan,
        )
        if restore is not None:
            d.restore(restore)
        runner = asyncio.create_task(d.start())
        d.schedule_eval(5)
        await until(loop, lambda: len(env.seeds) == 3 * groups and len(ev.seeds) == 2)
        await until(loop, lambda: d.idle)
        state = d.state()
        await d.stop()
        await runner
        return env.seeds, ev.seeds, state

    return run_virtual(scenario)


def test_every_rollout_gets_its_own_seed_from_its_place_in_the_run():
    from jaxrl_orch.orchestrator.dispatcher.settings import rollout_seed

    train, evals, state = _seeded_run(7)
    by_prompt: dict[int, list[int]] = {}
    for prompt, seed in train:
        by_prompt.setdefault(prompt, []).append(seed)
    # Group k (the k-th train group of the run) sample i: rollout_seed(7, "train", env, k, i).
    assert by_prompt == {
        k: [rollout_seed(7, "train", "toy", k, i) for i in range(3)] for k in range(4)
    }
    assert len({s for _, s in train}) == 12 and all(0 <= s < 2**31 for _, s in train)
    assert sorted(s for _, s in evals) == sorted(
        rollout_seed(7, "eval", "evalenv", 5, i, 0)
        for i in range(2)  # groups of one
    )
    # Scheduling (replicas, permits) does not change which rollout gets which seed ...
    again, _, _ = _seeded_run(7, pool_size=1, max_inflight=1)
    assert sorted(again) == sorted(train)
    # ... the run's seed does, and without one the engine's own RNG samples (no seed).
    other, _, _ = _seeded_run(8)
    assert {s for _, s in other}.isdisjoint({s for _, s in train})
    unseeded, evals_unseeded, _ = _seeded_run(None)
    assert {s for _, s in unseeded + evals_unseeded} == {None}
    # A resumed dispatcher continues the group count: the next groups get the next seeds.
    assert state["train_groups"] == 4
    resumed, _, _ = _seeded_run(7, groups=2, restore=state)
    assert sorted(s for _, s in resumed) == sorted(
        rollout_seed(7, "train", "toy", k, i) for k in (4, 5) for i in range(3)
    )
