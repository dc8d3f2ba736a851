"""The dispatcher's settings: bad arguments are named, and every rollout samples with a seed
of its own derived from its place in the run.
"""

from __future__ import annotations

import asyncio

import pytest
from support.dispatch_fakes import (
    SAMPLING,
    CountingSource,
    FakePool,
    ScriptedEnv,
    make,
    run_virtual,
    until,
)

from jaxrl_orch.orchestrator.dispatcher.dispatch import (
    DispatchConfig,
    EvalPlan,
    RolloutDispatcher,
)
from jaxrl_orch.types import PolicyHandle


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
