"""The ``pace`` policy's promise, as a property on the virtual clock: over random latency
tails, bounds, batch sizes and seeds, fresh or resumed, every trained rollout's head age is at
most S and no rollout is lost (every admitted train rollout is trained, or still waiting in the
sink when the run ends).
Then its test, ``ledger.pace_wait``, on hand-built cases.

The real gate, dispatcher, sinks and loop run against the simulator's engine and trainer
(``tools/simulate.py``); only latencies and step times are simulated.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxrl_orch.orchestrator.ledger import pace_wait
from jaxrl_orch.orchestrator.vclock import run_virtual
from jaxrl_orch.orchestrator.watcher import InProcessPublisher
from jaxrl_orch.tools.simulate import Scenario, SimTrainer, build_scenario, simulate


class RecordingTrainer(SimTrainer):
    """Keeps every rollout it was shipped, with the step it trained in."""

    def __init__(self, publisher: InProcessPublisher, train_time: float) -> None:
        super().__init__(publisher, train_time)
        self.trained: list[tuple[int, object]] = []

    def submit(self, batch) -> None:
        self.trained.extend((batch.step, r) for r in batch.trained)
        super().submit(batch)


def _run_pace(latency: str, seed: int, *, bound: int, batch: int, steps: int, start: int = 1):
    # Concurrency never binds before the gate does: the gate alone decides what starts.
    # start > 1: a resumed run, the gate recovered by its rule.
    sc = Scenario(
        max_staleness=bound,
        batch_size=batch,
        group_size=4,
        max_concurrent=8 * batch,
        latency=latency,
        train_time=1.0,
        steps=steps,
        policy="pace",
        seed=seed,
        start_step=start,
    )

    async def main():
        orch, _, trainer = build_scenario(sc, RecordingTrainer)
        try:
            await orch.run()
        finally:
            trainer.close()
        return orch, trainer.trained

    return run_virtual(main)[0]


def _check_bound_and_nothing_lost(orch, trained, bound: int, batch: int, steps: int) -> None:
    ages = [(step - 1) - r.head_version for step, r in trained]
    assert max(ages) <= bound, f"trained at head age {max(ages)} > S={bound}"
    assert len(orch.history) == steps and len(trained) == steps * batch
    assert orch.dropped_total == 0 and orch.dispatcher.idle
    d = orch.dispatcher.gauges()
    assert d["dispatcher/errors_total"] == 0 and d["dispatcher/cancelled_total"] == 0
    # Nothing lost: every admitted train rollout was trained or is still in the sink.
    s = orch.train_sink.gauges()
    left = s["train_sink/ready_rollouts"] + s["train_sink/pending_group_rollouts"]
    assert s["train_sink/filtered_total"] == 0  # random rewards: no group is ever flat
    assert orch.dispatcher.admitted_total == len(trained) + left
    assert len({id(r) for _, r in trained}) == len(trained)  # and none trained twice


# Mostly long tails, where completions land far out of admission order and the bound is at risk.
LATENCIES = st.one_of(
    st.builds(lambda s: f"lognormal:0:{s:.2f}", st.floats(0.2, 1.6)),
    st.builds(lambda s: f"lognormal:-1:{s:.2f}", st.floats(0.8, 1.6)),
    st.builds(lambda a, w: f"uniform:{a:.2f}:{a + w:.2f}", st.floats(0, 1), st.floats(0, 4)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    latency=LATENCIES,
    seed=st.integers(0, 2**16),
    bound=st.integers(0, 3),
    groups_per_batch=st.integers(1, 4),
    start=st.sampled_from([1, 1, 1, 41]),
)
# Found by this property on the old ``pace``: step 2 took head-1 rollouts while head-0 ones
# were still in flight, so 20 head-0 rollouts were left for the last slot at S, 16 wide.
@example(latency="lognormal:0:1.20", seed=0, bound=2, groups_per_batch=4, start=1)
def test_pace_trains_within_the_bound_and_loses_nothing(
    latency, seed, bound, groups_per_batch, start
):
    batch, steps = 4 * groups_per_batch, 16
    orch, trained = _run_pace(latency, seed, bound=bound, batch=batch, steps=steps, start=start)
    _check_bound_and_nothing_lost(orch, trained, bound, batch, steps)


def test_pace_is_deterministic_for_a_seed():
    sc = Scenario(2, 16, latency="lognormal:0:1.2", steps=20, policy="pace", seed=3)
    assert simulate(sc) == simulate(sc)


# --------------------------------------------------------------------------- pace_wait


def test_a_batch_may_not_take_young_rollouts_while_too_many_old_ones_are_out():
    """The old ``pace`` bug, by hand: S = 2, 16 a batch, 48 rollouts started under version 0.
    Step 2 at version 1: 20 of them are still out. Taking 4 head-1 rollouts now would leave all
    20 for step 3, the last that may train them, which holds 16."""
    old, young = [0] * 12, [1] * 4
    assert pace_wait(2, 1, 2, 16, ready=old + young, unlanded=[0] * 20)
    # With 16 old ones ready, the batch is all old: the 16 still out fit in step 3.
    assert not pace_wait(2, 1, 2, 16, ready=[0] * 16 + young, unlanded=[0] * 16)


def test_the_last_batch_that_may_train_a_rollout_waits_for_it():
    # Step 4 at S = 2 is the last for head 1: one still in flight holds the batch...
    assert pace_wait(4, 2, 2, 4, ready=[1, 2, 2, 2, 2], unlanded=[1])
    # ...one of head 2 does not (step 5 may still train it), nor one that landed in time.
    assert not pace_wait(4, 2, 2, 4, ready=[1, 2, 2, 2, 2], unlanded=[2])
    assert not pace_wait(4, 2, 2, 4, ready=[1, 1, 2, 2, 2], unlanded=[])


def test_versions_the_trainer_has_not_moved_past_need_no_wait():
    # Version 1 is still live at step 4 (S = 2): the gate has stopped admitting under it once
    # the batches up to 4 could hold all of it, so nothing it started can miss its step.
    assert not pace_wait(4, 1, 2, 4, ready=[1] * 4, unlanded=[1] * 4)
    # S = 0 is synchronous: the hold alone keeps every batch within the bound.
    assert not pace_wait(5, 4, 0, 4, ready=[4] * 4, unlanded=[4] * 8)
