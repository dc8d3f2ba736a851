"""The masked-tail measurement (benchmarks/masked_tail.py) that docs/staleness.md quotes."""

from masked_tail import measure

from jaxrl_orch.tools.simulate import Scenario


def _scenario(latency: str) -> Scenario:
    return Scenario(
        max_staleness=1, batch_size=8, group_size=4, max_concurrent=32, latency=latency, steps=30
    )


def test_a_uniform_fast_engine_leaves_every_token_trained():
    # Every rollout lands within a step: no token can fall more than S behind.
    row = measure(_scenario("fixed:0.5"))
    assert row["rollouts_emptied"] == 0
    assert row["tokens_masked_share"] == 0.0
    assert row["rollouts"] == 30 * 8


def test_a_long_tail_empties_rollouts_and_keeps_no_trained_token_past_the_bound():
    row = measure(_scenario("lognormal:0:1.2"))
    assert row["rollouts_emptied"] > 0
    assert 0 < row["tokens_masked_share"] < 1
    assert row["trained_token_age_max"] <= 1
