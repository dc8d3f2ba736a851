"""RolloutDispatcher against fake pools, envs and sources on the virtual-time event loop:
every rollout emitted exactly once, group pinning, stamping, stale cancellation, evals beside
training, stop and failure, per-env sources, state.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.dispatch_fakes import (
    SAMPLING,
    CountingSource,
    FakeGate,
    FakePool,
    ScriptedEnv,
    drain,
    make,
    run_virtual,
    until,
)

from jaxrl_orch.orchestrator.dispatcher.dispatch import DispatchConfig, EvalPlan, RolloutDispatcher
from jaxrl_orch.types import PolicyHandle, SamplingParams

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
    outcomes = ["ok"] * 5 + ["raise", "empty", "hang", "bad_type", "sync_raise", "cut"]
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
    # Accepted: trainable (an error, or a completion cut short, is not).
    assert gate.accepted == sum(r.trainable and not r.has_error for r in rollouts)
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
        await until(loop, lambda: len(env.calls) == 3)
        # Group 0 started three of its four: the fourth, not started, is not in flight.
        assert d.train_in_flight() == [0, 0, 0]
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
    outcomes = {0: "ok", 1: "raise", 2: "empty", 3: "bad_type", 4: "sync_raise", 5: "cut"}

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
    assert not by_id[5].has_error and by_id[5].cut == "abort"  # kept as the env returned it
    # A cut rollout is no error, but the gate does not count it as accepted for training.
    assert (gate.accepted, gate.rejected) == (1, 5)
    assert d.gauges()["dispatcher/errors_total"] == 4


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
        await until(loop, lambda: not d.launcher.eval_groups and not d.evals)
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


class BrokenGate(FakeGate):
    def capacity(self) -> int:
        return 1 // 0


def test_loop_failure_is_raised_from_start_and_check():
    async def scenario(loop):
        env = ScriptedEnv()
        d, _, _ = make(loop, env, gate=BrokenGate())
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
        await until(loop, lambda: d.admission.exhausted == {"a", "b"} and d.idle)
        await d.stop()
        await runner
        return a, b

    a, b = run_virtual(scenario)
    assert len(a.calls) == 2 and len(b.calls) == 10
    # Envs take turns opening groups until "a" runs dry after its two examples.
    assert {g for g, *_ in a.calls} == {0, 2} and {g for g, *_ in b.calls} == {1, 3, 4, 5, 6}


def test_train_in_flight_and_state_round_trip():
    async def scenario(loop):
        env = ScriptedEnv(script=lambda g, e: (0.0, "hang"))
        d, _, policy = make(loop, env, max_inflight=2, group_size=1)
        assert d.train_in_flight() == []
        runner = asyncio.create_task(d.start())
        await until(loop, lambda: len(env.calls) == 2)
        policy.advance(4)
        d.cancel_stale(1)  # frees both permits; new groups open at version 4
        await until(loop, lambda: len(env.calls) == 4)
        assert d.train_in_flight() == [4, 4]  # the cancelled ones have landed
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
