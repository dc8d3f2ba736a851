"""summary.py: the summary keys from eval metrics, and the console's eval line."""

from types import SimpleNamespace

from jaxrl_orch.run.summary import (
    eval_line,
    eval_summary,
    first_eval,
    merge_evals,
    train_reward_ends,
)


def _evals():
    batches = []
    for step, reward, full in ((0, 0.4, 0.2), (10, 0.6, 0.5), (20, 0.85, 0.9)):
        batches.append(
            SimpleNamespace(
                step=step,
                metrics={
                    "eval/rev/reward_mean": reward,
                    "eval/rev/behaviour/full": full,
                    "eval/rev/behaviour/word_order": 1 - full,
                },
            )
        )
        batches.append(SimpleNamespace(step=step, metrics={"eval/rev@t1/reward_mean": reward / 2}))
    return merge_evals(batches)


def test_eval_summary_curves_and_behaviour_shares():
    s = eval_summary(_evals(), "rev", "rev@t1")
    assert s["eval_reward_before_rl"] == 0.4 and s["eval_reward_final"] == 0.85
    assert s["eval_sampled_reward_before_rl"] == 0.2 and s["eval_sampled_reward_final"] == 0.425
    assert s["eval_rewards"] == {"0": 0.4, "10": 0.6, "20": 0.85}
    assert s["behaviour"]["greedy"]["20"] == {"full": 0.9, "word_order": 1 - 0.9}
    assert s["behaviour"]["sampled"] == {}  # that env labelled no behaviours


def test_a_resumed_run_reports_the_first_eval_it_no_longer_holds():
    evals = _evals()
    before = first_eval(evals, "rev", "rev@t1")
    resumed = {k: v for k, v in evals.items() if k > 0}
    s = eval_summary(resumed, "rev", "rev@t1", before)
    assert s["eval_reward_before_rl"] == 0.4 and s["eval_sampled_reward_before_rl"] == 0.2
    assert list(s["behaviour"]["greedy"]) == ["0", "10", "20"]
    assert s["behaviour"]["greedy"]["0"] == {"full": 0.2, "word_order": 1 - 0.2}
    assert first_eval(resumed, "rev", "rev@t1") is None


def test_train_reward_ends_and_eval_line():
    rows = [{"orch/step_s": 1.0}, {"train/reward_mean": 0.3}, {"train/reward_mean": 0.7}]
    assert train_reward_ends(rows) == {"train_reward_first": 0.3, "train_reward_last": 0.7}
    line = eval_line(_evals()[20])
    assert line == "rev 0.850 (full 90% word_order 10%); rev@t1 0.425"
    assert eval_line({}) == "no eval landed"
