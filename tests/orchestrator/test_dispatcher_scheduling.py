"""When the dispatcher starts work: on a real event loop, only whole groups the gate has room
for, instant rollouts in the same pass without tasks, a fill pass on ``notify``, and never
starving the event loop.
"""

from __future__ import annotations

import asyncio
import random

from support.dispatch_fakes import (
    CountingSource,
    FakeGate,
    ScriptedEnv,
    drain,
    make,
    run_virtual,
    until,
)


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
        assert d.train_in_flight() == [0, 0]
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
