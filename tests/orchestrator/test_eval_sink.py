"""EvalSink: per-(step, env) collection and metrics against a NumPy reference."""

import math

import numpy as np
import pytest

from jaxrl_orch.orchestrator.eval_sink import EvalSink
from jaxrl_orch.types import Rollout


def ev(env, reward, *, n_model=3, error=None, step=None, eid=0, example=None):
    r = Rollout(
        env=env,
        group_id=0,
        episode_id=eid,
        example=dict(example or {}),
        token_ids=[1] * (2 + n_model),
        loss_mask=[False, False] + [True] * n_model,
        logprobs=[0.0] * (2 + n_model),
        versions=[0] * (2 + n_model),
        reward=reward,
        is_eval=True,
        eval_step=step,
    )
    if error:
        r.capture_error(RuntimeError(error))
    return r


def test_batch_returned_when_all_expected_arrived_with_reference_metrics():
    sink = EvalSink()
    sink.expect(10, "rev", 5)
    sink.expect(10, "math", 1)
    rs = [ev("rev", 0.95, n_model=4), ev("rev", 0.4, n_model=2), ev("rev", 1.0, n_model=6)]
    rs.append(ev("rev", 0.0, error="boom"))
    rs.append(ev("rev", math.nan))
    assert sink.add([ev("math", 1.0)]).env == "math"
    for r in rs[:-1]:
        assert sink.add([r]) is None
    assert sink.pending() == {(10, "rev"): 1}
    batch = sink.add([rs[-1]])
    assert batch.step == 10 and batch.env == "rev" and batch.rollouts == rs
    scored = np.array([0.95, 0.4, 1.0])
    m = batch.metrics
    assert m["eval/rev/rollouts"] == 5 and m["eval/rev/errors"] == 1
    assert m["eval/rev/nonfinite_rewards"] == 1
    assert m["eval/rev/reward_mean"] == pytest.approx(scored.mean())
    assert m["eval/rev/reward_std"] == pytest.approx(scored.std())
    assert m["eval/rev/pass_rate"] == pytest.approx(1 / 3)  # a full score passes
    assert m["eval/rev/model_tokens_mean"] == pytest.approx(4.0)
    assert sink.pending() == {}
    assert sink.gauges()["eval_sink/batches_total"] == 2


def test_all_errored_has_no_reward_stats():
    sink = EvalSink()
    sink.expect(1, "e", 2)
    b = sink.add([ev("e", 0.0, error="x"), ev("e", 0.0, error="y")])
    assert b.metrics["eval/e/errors"] == 2 and "eval/e/reward_mean" not in b.metrics


def test_fifo_per_env_and_explicit_step_tag():
    sink = EvalSink()
    sink.expect(5, "e", 2)
    sink.expect(10, "e", 1)
    # Rollout.eval_step names step 10: goes there even though step 5 is older.
    b10 = sink.add([ev("e", 1.0, step=10)])
    assert b10.step == 10
    # eval_step None: the oldest open expectation of the env. A key of that name in the
    # example is the dataset's business, not a step tag.
    assert sink.add([ev("e", 0.0, example={"eval_step": 10})]) is None
    b5 = sink.add([ev("e", 1.0)])
    assert b5.step == 5 and b5.metrics["eval/e/pass_rate"] == 0.5


def test_errors_are_clear():
    sink = EvalSink()
    with pytest.raises(ValueError, match="no open expectation"):
        sink.add([ev("e", 1.0)])
    sink.expect(1, "e", 1)
    with pytest.raises(ValueError, match="already expected"):
        sink.expect(1, "e", 3)
    with pytest.raises(ValueError, match="only 1 of the expected 1"):
        sink.add([ev("e", 1.0), ev("e", 1.0)])
    with pytest.raises(ValueError, match="step 7 arrived"):
        sink.add([ev("e", 1.0, step=7)])
    train = ev("e", 1.0)
    train.is_eval = False
    with pytest.raises(ValueError, match="train rollout"):
        sink.add([train])
    with pytest.raises(ValueError, match="n=0"):
        sink.expect(2, "e", 0)
    with pytest.raises(ValueError, match="mixes envs"):
        sink.add([ev("e", 1.0), ev("f", 1.0)])


def test_gauges_and_lifecycle():
    sink = EvalSink()
    sink.start()
    sink.expect(1, "e", 3)
    sink.add([ev("e", 1.0)])
    g = sink.gauges()
    assert all(k.startswith("eval_sink/") for k in g)
    assert g["eval_sink/open_evals"] == 1 and g["eval_sink/awaited_rollouts"] == 2
    assert g["eval_sink/running"] == 1.0
    sink.stop()
    assert sink.gauges()["eval_sink/running"] == 0.0


def test_behaviour_shares_over_scored_rollouts():
    """An env's one-hot ``behaviour/*`` labels become shares of the scored answers; errored
    rollouts are not answers, and a label no rollout carries is absent, not 0."""
    sink = EvalSink()
    sink.expect(0, "rev", 5)
    kinds = ["full", "word_order", "word_order", "full"]
    rs = []
    for i, k in enumerate(kinds):
        r = ev("rev", 0.5, eid=i)
        r.metrics = {
            "behaviour/full": float(k == "full"),
            "behaviour/word_order": float(k != "full"),
        }
        rs.append(r)
    rs.append(ev("rev", 0.0, error="boom", eid=9))
    rs[-1].metrics = {"behaviour/other": 1.0}
    batch = None
    for r in rs:
        batch = sink.add([r]) or batch
    m = batch.metrics
    assert m["eval/rev/behaviour/full"] == 0.5
    assert m["eval/rev/behaviour/word_order"] == 0.5
    assert "eval/rev/behaviour/other" not in m
