"""The orchestrator's main loop, driven by the simulator's engine and trainer on virtual time.

What it must show: async S=1 nearly doubles steps/s over the synchronous S=0 baseline when
engine and trainer take equal time; with long-tail latency the ``admit`` policy overshoots S
while ``pace`` and ``drop`` keep the observed age within S (pace losing nothing); a resume that
skips ``on_version_recovered`` trips the resume-burst alarm; faults (an environment that
raises, a NaN reward, a stalled trainer, a flat reward) are handled or fail loudly.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
import pytest

from jaxrl_orch.compose.orchestrator import Backend, Telemetry, Workload, build_orchestrator
from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopHooks
from jaxrl_orch.orchestrator.gate import ResumeBurstError
from jaxrl_orch.orchestrator.progress import PipelineStallError
from jaxrl_orch.orchestrator.shipping import EmptyBatchError
from jaxrl_orch.orchestrator.vclock import run_virtual
from jaxrl_orch.orchestrator.watcher import InProcessPublisher, WatcherStallError
from jaxrl_orch.tools.simulate import Scenario, SimEngine, SimEnv, SimSource, SimTrainer, simulate
from jaxrl_orch.types import PolicyHandle, SamplingParams


def test_async_staleness_one_nearly_doubles_throughput():
    sync = simulate(Scenario(max_staleness=0, steps=60))
    async_ = simulate(Scenario(max_staleness=1, steps=60))
    assert sync["age_max"] == 0  # S=0 is a correct synchronous run
    assert async_["age_max"] == 1
    assert async_["steps_per_second"] >= 1.8 * sync["steps_per_second"]
    assert sync["trainer_idle_fraction"] > 0.4 > async_["trainer_idle_fraction"]


def test_simulation_is_deterministic_for_a_seed():
    sc = Scenario(latency="lognormal:0:0.5", steps=20, seed=3)
    assert simulate(sc) == simulate(sc)


@pytest.mark.parametrize("policy", ["admit", "drop", "pace"])
def test_age_policies_under_long_tail_latency(policy):
    r = simulate(
        Scenario(max_staleness=1, latency="lognormal:0:0.6", steps=80, policy=policy, seed=1)
    )
    assert r["steps"] == 80
    if policy == "admit":
        assert r["age_max"] > 1  # the configured bound overshoots: completions land out of order
        assert r["dropped"] == 0
    else:
        assert r["age_max"] <= 1
    if policy == "pace":
        assert r["dropped"] == 0
    if policy == "drop":
        assert r["dropped"] > 0


def test_admissions_per_step_settle_at_one_batch():
    r = simulate(Scenario(max_staleness=2, steps=40))
    assert r["admissions_per_step"][0] <= (2 + 1) * 32
    assert np.mean(r["admissions_per_step"][5:]) == pytest.approx(32, abs=2)


def test_resume_with_recovered_gate_respects_the_first_step_bound():
    r = simulate(Scenario(max_staleness=2, steps=10, start_step=41))
    assert r["steps"] == 10 and r["age_max"] <= 2
    assert r["admissions_per_step"][0] <= 3 * 32


def test_resume_without_recovering_the_gate_trips_the_alarm():
    with pytest.raises(ResumeBurstError, match=r"\(S \+ 1\) \* B = 96"):
        simulate(
            Scenario(
                max_staleness=2,
                steps=10,
                start_step=41,
                recover_gate_on_resume=False,
                max_concurrent=10**6,
            )
        )


# --------------------------------------------------------------------------- faults


class FaultyEnv(SimEnv):
    """Raises on every 7th episode and returns a NaN reward on every 5th."""

    async def run(self, client, example, *, group_id, episode_id, sampling):
        if episode_id % 7 == 3:
            raise RuntimeError(f"tool server down (episode {episode_id})")
        r = await super().run(
            client, example, group_id=group_id, episode_id=episode_id, sampling=sampling
        )
        if episode_id % 5 == 1:
            r.reward = float("nan")
        return r


class FlatEnv(SimEnv):
    async def run(self, client, example, **kw):
        r = await super().run(client, example, **kw)
        r.reward = 0.0
        return r


class RecordingTrainer(SimTrainer):
    """Keeps every rollout it was shipped to train on."""

    def __init__(self, publisher, train_time):
        super().__init__(publisher, train_time)
        self.trained = []

    def submit(self, batch):
        self.trained.extend(batch.trained)
        super().submit(batch)


def _run(
    env_cls=SimEnv,
    *,
    train_time=1.0,
    publish=True,
    steps=12,
    start_step=1,
    latency="uniform:0.5:1.5",
    on_ship=None,
    store_dir=None,
    engine_held=None,
    on_landed=None,
    before_close=None,
    writers=(),
    **cfg_kw,
):
    async def main():
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(0)
        policy = PolicyHandle(start_step - 1)
        engine = SimEngine(latency, policy, rng)
        publisher = InProcessPublisher()
        trainer = RecordingTrainer(publisher, train_time)
        if not publish:
            trainer.publisher = type("Silent", (), {"publish": lambda self, v, p: None})()
        cfg = OrchestratorConfig(
            max_steps=start_step - 1 + steps,
            batch_size=16,
            group_size=4,
            max_concurrent=32,
            eval_at_start=False,
            **cfg_kw,
        )

        async def reload(version, params):
            return None

        def on_step(step, state):
            if on_ship is not None:
                on_ship(orch, step)

        orch = build_orchestrator(
            cfg,
            policy,
            backend=Backend(engine, trainer, publisher, reload),
            workload=Workload({"sim": env_cls(rng)}, SimSource(), SamplingParams(max_tokens=6)),
            clock=loop.time,
            hooks=LoopHooks(
                on_step=on_step,
                engine_held=engine_held,
                on_landed=on_landed,
                before_close=None
                if before_close is None
                else lambda done: before_close(orch, done),
            ),
            telemetry=Telemetry(writers=writers, log_interval_s=1e9, store_dir=store_dir),
        )
        try:
            await orch.run()
        finally:
            trainer.close()
        return orch, trainer.trained

    return run_virtual(main)[0]


def test_raising_env_and_nan_rewards_never_stop_the_run_or_get_trained(tmp_path, capsys):
    orch, trained = _run(FaultyEnv, steps=10, store_dir=str(tmp_path))
    assert len(orch.history) == 10 and orch.policy.version == 10
    assert all(np.isfinite(r.reward) and not r.has_error for r in trained)
    g = orch.train_sink.gauges()
    assert g["train_sink/errors_total"] > 0  # raised episodes became error rollouts
    assert orch.dispatcher.idle and orch.gate.running == 0
    # NaN rewards have their own counter, apart from the raised errors.
    nan = sum(rec.metrics["train/nonfinite_rewards"] for rec in orch.history)
    flagged = sum(rec.metrics.get("train/filtered/non_finite_reward", 0) for rec in orch.history)
    assert nan > 0 and nan == flagged
    # The exception text: on the console once per kind (episode ids masked), with a count...
    digest = orch.faults.digest()
    raised = [k for k in digest if "tool server down" in k]
    assert raised == ["sim: RuntimeError: tool server down (episode #)"] and digest[raised[0]] > 1
    err = capsys.readouterr().err
    assert err.count("tool server down") == 2  # the first one, and the closing digest
    # ...and on every error rollout's record.
    records = [json.loads(x) for x in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert sum("tool server down" in r["errors"][0] for r in records) == digest[raised[0]]
    assert all(r["env"] == "sim" and "prompt_ids" in r["example"] for r in records)


def test_the_caller_is_told_of_every_episode_the_loop_takes_first_one_before_any_ship():
    events = []
    orch, _ = _run(
        steps=3,
        on_ship=lambda o, step: events.append("ship"),
        on_landed=lambda: events.append("landed"),
    )
    assert events[0] == "landed" and events.count("ship") == 3
    # No eval here: every episode (one rollout each) went to the train sink.
    assert events.count("landed") == orch.train_sink.gauges()["train_sink/rollouts_seen_total"]


class Rows:
    """A metrics writer keeping its rows and whether it was closed."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.closed = False

    def write(self, step, metrics):
        assert not self.closed, "written after close"
        self.rows.append((step, metrics))

    def close(self):
        self.closed = True


def test_before_close_runs_after_the_last_step_while_the_writers_still_take_rows():
    seen = []

    async def late_row(orch, finished):
        await asyncio.sleep(5.0)  # work of the caller's that ends after the loop (virtual time)
        orch.write_metrics(2, {"late/score": 1.0})
        seen.append(finished)

    rows = Rows()
    _run(steps=3, before_close=late_row, writers=[rows])
    assert seen == [True] and rows.closed
    assert rows.rows[-1] == (2, {"late/score": 1.0})
    assert [s for s, m in rows.rows if "train/reward_mean" in m] == [1, 2, 3]


def test_before_close_is_told_when_the_loop_failed():
    seen = []
    with pytest.raises(PipelineStallError):
        _run(
            HangingEnv,
            steps=40,
            env_timeout_s=None,
            stall_timeout_s=120.0,
            before_close=lambda orch, finished: seen.append(finished),
        )
    assert seen == [False]


class HangingEnv(SimEnv):
    """Every 9th episode awaits forever (a tool call that never answers)."""

    async def run(self, client, example, **kw):
        if kw["episode_id"] % 9 == 4:
            await asyncio.Event().wait()
        return await super().run(client, example, **kw)


def test_a_hanging_env_is_timed_out_and_the_run_finishes():
    orch, trained = _run(HangingEnv, steps=8, env_timeout_s=20.0)
    assert orch.policy.version == 8 and orch.dispatcher.idle
    timeouts = orch.dispatcher.gauges()["dispatcher/env_timeouts_total"]
    assert timeouts > 0
    key = "sim: EnvTimeout: env 'sim' rollout ran past env_timeout_s=#s and was cancelled"
    assert orch.faults.digest()[key] == timeouts
    assert all(not r.has_error for r in trained)


def test_without_a_timeout_a_hanging_env_ends_in_a_stall_error_naming_the_wait():
    # Hung rollouts hold their groups open: the gate's budget goes to rollouts that never
    # form a batch, and nothing moves after that (the deadlock of a hung tool call).
    stall = r"no progress for 120s .* 5 rollouts in flight, gate capacity 0, 12 of 16 batch"
    with pytest.raises(PipelineStallError, match=stall):
        _run(HangingEnv, steps=40, env_timeout_s=None, stall_timeout_s=120.0)


def test_a_stall_error_leads_with_what_holds_the_engine():
    held = "the engine is paused (by POST /pause from 127.0.0.1:5)"
    stall = rf"no progress for 120s .*; {re.escape(held)}; 5 rollouts in flight, gate capacity 0"
    with pytest.raises(PipelineStallError, match=stall):
        _run(
            HangingEnv,
            steps=40,
            env_timeout_s=None,
            stall_timeout_s=120.0,
            engine_held=lambda: held,
        )


def test_a_drain_past_its_deadline_cancels_what_is_in_flight_and_stops():
    def sigterm_after_step_1(orch, step):
        if step == 1:
            orch.request_drain(deadline_s=5.0)

    orch, _ = _run(HangingEnv, steps=30, env_timeout_s=None, on_ship=sigterm_after_step_1)
    assert orch.abandoned  # without the deadline the drain waits on hung rollouts forever
    assert orch.policy.version == 1 and [rec.step for rec in orch.history] == [1]
    assert orch.dispatcher.idle and orch.dispatcher.gauges()["dispatcher/cancelled_total"] > 0


class BlockingEnv(SimEnv):
    async def run(self, client, example, **kw):
        r = await super().run(client, example, **kw)
        if kw["episode_id"] == 5:
            time.sleep(0.8)  # blocking code on the event loop
        return r


def test_env_code_blocking_the_event_loop_is_reported_by_name(capsys):
    orch, _ = _run(BlockingEnv, steps=2, loop_block_warn_s=0.3)
    assert orch.policy.version == 2
    err = capsys.readouterr().err
    assert "the event loop has not turned for 0.3s; it is running run (" in err
    assert "test_loop.py" in err  # the env's own file and line
    assert orch.watchdog.blocked_total == 1 and orch.watchdog.blocked_max_s > 0.3


class NotAsyncEnv(SimEnv):
    def run(self, client, example, **kw):
        if kw["episode_id"] % 5 == 0:
            return None  # a plain function: no awaitable, no Rollout
        return super().run(client, example, **kw)


def test_an_env_returning_no_awaitable_becomes_error_rollouts():
    orch, _ = _run(NotAsyncEnv, steps=3)
    assert orch.policy.version == 3
    assert any("returned NoneType" in k for k in orch.faults.digest())


class WordRewardEnv(SimEnv):
    """Every 4th episode's reward is a word instead of a number (an env's bug)."""

    async def run(self, client, example, **kw):
        r = await super().run(client, example, **kw)
        if kw["episode_id"] % 4 == 2:
            r.reward = "good"
        return r


def test_a_non_numeric_reward_is_an_error_rollout_naming_the_env_and_value():
    orch, trained = _run(WordRewardEnv, steps=4)
    assert orch.policy.version == 4
    assert trained and all(isinstance(r.reward, float) for r in trained)
    kinds = [k for k in orch.faults.digest() if "reward" in k]
    assert kinds == [
        "sim: TypeError: env 'sim' returned the reward 'good' (str); a reward must be a real number"
    ], list(orch.faults.digest())


class HalfFlatEnv(SimEnv):
    async def run(self, client, example, **kw):
        r = await super().run(client, example, **kw)
        if r.group_id % 2 == 0:
            r.reward = 0.0
        return r


def test_resume_alarm_ignores_flat_groups_replaced_by_dynamic_sampling():
    """Replacing discarded flat groups admits more than (S + 1) * B rollouts in the first step
    after a resume, yet never has more than that in the system: no false alarm."""
    orch, _ = _run(HalfFlatEnv, steps=4, start_step=21, max_staleness=1)
    assert [rec.step for rec in orch.history] == [21, 22, 23, 24]
    assert orch.history[0].metrics["orch/admitted"] > 2 * 16


def test_stalled_trainer_fails_loudly_instead_of_halting():
    with pytest.raises(WatcherStallError, match="waited .* for policy version 1"):
        _run(publish=False, max_staleness=0, stall_timeout_s=30.0)


def test_flat_rewards_trip_the_empty_batch_guard():
    with pytest.raises(EmptyBatchError, match="groups in a row contributed nothing trainable"):
        _run(FlatEnv, empty_batch_limit=3)


def test_drain_finishes_trained_work_and_emits_no_extra_step():
    orch, _ = _run(steps=7, max_staleness=2)
    assert [rec.step for rec in orch.history] == list(range(1, 8))
    assert orch.policy.version == 7  # the trainer finished every shipped step before exit
    ages = [a for a, n in orch.age_histogram.items() for _ in range(n)]
    assert max(ages) <= 3 and orch.dispatcher.idle


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="age_policy must be one of"):
        OrchestratorConfig(max_steps=1, batch_size=4, group_size=2, age_policy="yolo")
    with pytest.raises(ValueError, match=r"batch_size \(6\) must be a multiple of group_size"):
        OrchestratorConfig(max_steps=1, batch_size=6, group_size=4)
    with pytest.raises(ValueError, match=r"max_concurrent \(2\) must be >= group_size"):
        OrchestratorConfig(max_steps=1, batch_size=4, group_size=4, max_concurrent=2)


def test_concurrency_defaults_to_what_the_gate_can_admit_ahead_of_the_trainer():
    """Unset, max_concurrent is (S + 1) * B: concurrency never binds before staleness."""
    cfg = OrchestratorConfig(max_steps=1, batch_size=8, group_size=4, max_staleness=2)
    assert cfg.max_concurrent == 24
    assert OrchestratorConfig(max_steps=1, batch_size=8, group_size=4).max_concurrent == 16
    assert OrchestratorConfig(1, 8, 4, max_concurrent=12).max_concurrent == 12


def test_slots_freed_by_discarded_flat_groups_are_refilled_at_once():
    """An instant engine, S=0: half the groups are flat and discarded by dynamic sampling. The
    sink's discard wakes the dispatcher, so replacements start at once instead of at its next
    poll (0.5 s): every step ships the moment the previous version lands."""
    orch, _ = _run(HalfFlatEnv, steps=5, max_staleness=0, latency="fixed:0")
    assert [rec.step for rec in orch.history] == [1, 2, 3, 4, 5]
    assert orch.history[0].metrics["orch/step_s"] == 0.0
    assert [rec.metrics["orch/step_s"] for rec in orch.history[1:]] == pytest.approx([1.0] * 4)
    assert all(rec.metrics["train/groups_seen"] > 4 for rec in orch.history)  # flat ones replaced


def _built(start_step, **cfg_kw):
    """An orchestrator over the simulator's parts, built for a trainer at ``start_step - 1``."""
    rng = np.random.default_rng(0)
    publisher = InProcessPublisher()
    cfg = OrchestratorConfig(
        max_steps=start_step + 10, batch_size=16, group_size=4, max_concurrent=32, **cfg_kw
    )

    async def reload(version, params):
        return None

    policy = PolicyHandle(start_step - 1)
    return build_orchestrator(
        cfg,
        policy,
        backend=Backend(
            SimEngine("fixed:1", policy, rng), SimTrainer(publisher, 1.0), publisher, reload
        ),
        workload=Workload({"sim": SimEnv(rng)}, SimSource(), SamplingParams(max_tokens=6)),
        telemetry=Telemetry(log_interval_s=1e9),
    )


def test_restore_mirrors_state():
    """A run's state, restored into an orchestrator built for its trainer's version, gives the
    same data cursor, counters and step back; the gate's accepted counter follows its recovery
    rule ((version) * B), not the saved value."""
    done, _ = _run(steps=5, max_staleness=1)
    saved = done.state()
    again = _built(start_step=saved["step"], max_staleness=1)
    again.restore(saved)
    got = again.state()
    assert got["step"] == saved["step"] == 6
    assert got["dispatcher"] == saved["dispatcher"]
    assert got["train_sink"]["totals"] == saved["train_sink"]["totals"]
    assert got["train_sink"]["step"] == 6
    assert got["gate"] == {"version": 5, "accepted": 5 * 16}
    # A state saved by a loop that had shipped ahead of its trainer (up to S + 1 steps)
    # still restores; one from another run's step does not.
    _built(start_step=6, max_staleness=1).restore({**saved, "step": 8})
    with pytest.raises(ValueError, match=r"resumes at step 6 .* steps 6\.\.8"):
        _built(start_step=6, max_staleness=1).restore({**saved, "step": 9})
    with pytest.raises(ValueError, match=r"gate version 5\) but .* resumes at step 5"):
        _built(start_step=5, max_staleness=1).restore(saved)
    with pytest.raises(ValueError, match="lacks"):
        _built(start_step=6).restore({"step": 6})
