"""Filters flag in place, with reasons, and never edit anything else."""

import math

import pytest

from jaxrl_orch.algorithms.filters import (
    Filter,
    LengthFilter,
    NoModelTokensFilter,
    RepetitionFilter,
    ZeroVarianceFilter,
    apply_filters,
    model_tokens,
    ngram_repeat_ratio,
)
from jaxrl_orch.types import Rollout


def make(group_id=0, reward=0.0, prompt=(1, 2, 3), completion=(4, 5), metrics=None):
    toks = list(prompt) + list(completion)
    mask = [False] * len(prompt) + [True] * len(completion)
    return Rollout(
        env="t",
        group_id=group_id,
        episode_id=0,
        example={},
        token_ids=toks,
        loss_mask=mask,
        logprobs=[0.0] * len(toks),
        versions=[0] * len(toks),
        reward=reward,
        metrics=dict(metrics or {}),
    )


def test_stock_filters_satisfy_protocol():
    for f in (ZeroVarianceFilter(), RepetitionFilter(), LengthFilter(), NoModelTokensFilter()):
        assert isinstance(f, Filter)


def test_zero_variance_flags_whole_flat_group_only():
    flat = [make(group_id=1, reward=1.0) for _ in range(4)]
    mixed = [make(group_id=2, reward=r) for r in (0.0, 1.0, 1.0, 0.5)]
    counts = apply_filters([ZeroVarianceFilter()], flat + mixed)
    assert counts == {"zero_variance": 4}
    assert all(r.filtered and r.filter_reasons == ["zero_variance"] for r in flat)
    assert not any(r.filtered or r.filter_reasons for r in mixed)


def test_zero_variance_tolerance_and_singleton():
    near = [make(group_id=1, reward=0.5), make(group_id=1, reward=0.5 + 1e-9)]
    alone = [make(group_id=2, reward=0.3)]
    apply_filters([ZeroVarianceFilter()], near + alone)
    assert all(r.filtered for r in near + alone)


def test_ngram_repeat_ratio_reference():
    assert ngram_repeat_ratio([1, 2, 3, 4, 5], 2) == 0.0
    # 1 2 1 2 1 2: bigrams (1,2)(2,1)(1,2)(2,1)(1,2): 2 unique of 5.
    assert ngram_repeat_ratio([1, 2, 1, 2, 1, 2], 2) == pytest.approx(1 - 2 / 5)
    assert ngram_repeat_ratio([1, 2], 4) == 0.0
    with pytest.raises(ValueError, match="n-gram size"):
        ngram_repeat_ratio([1], 0)


def test_repetition_uses_model_tokens_only():
    loop = (7, 8, 9) * 20  # degenerate completion
    varied = tuple(range(100, 160))
    bad = make(completion=loop)
    good = make(completion=varied)
    # A repetitive *prompt* must not count: only loss-masked tokens do.
    prompt_loop = make(prompt=loop, completion=varied)
    counts = apply_filters([RepetitionFilter(n=4, max_ratio=0.5)], [bad, good, prompt_loop])
    assert counts == {"repetition": 1}
    assert bad.filter_reasons == ["repetition"]
    assert not good.filtered and not prompt_loop.filtered
    assert model_tokens(prompt_loop) == list(varied)


def test_repetition_ignores_short_completions():
    short = make(completion=(5, 5, 5, 5, 5, 5))
    apply_filters([RepetitionFilter(n=2, min_ngrams=16)], [short])
    assert not short.filtered
    apply_filters([RepetitionFilter(n=2, min_ngrams=1)], [short])
    assert short.filtered


def test_length_filter_max_tokens_and_truncated_flag():
    long_ = make(completion=tuple(range(10)))
    ok = make(completion=tuple(range(5)))
    trunc = make(completion=(1,), metrics={"truncated": 1.0})
    not_trunc = make(completion=(1,), metrics={"truncated": 0.0})
    nan_trunc = make(completion=(1,), metrics={"truncated": math.nan})
    batch = [long_, ok, trunc, not_trunc, nan_trunc]
    counts = apply_filters([LengthFilter(max_model_tokens=8)], batch)
    assert counts == {"length": 1, "truncated": 1}
    assert long_.filter_reasons == ["length"] and trunc.filter_reasons == ["truncated"]
    assert not (ok.filtered or not_trunc.filtered or nan_trunc.filtered)


def test_length_filter_truncation_can_be_kept():
    trunc = make(metrics={"truncated": 1.0})
    apply_filters([LengthFilter(drop_truncated=False)], [trunc])
    assert not trunc.filtered


def test_reasons_accumulate_and_other_fields_untouched():
    r = make(completion=())
    r2 = make(completion=(1,))
    apply_filters([NoModelTokensFilter(), ZeroVarianceFilter()], [r, r2])
    assert r.filter_reasons == ["no_model_tokens", "zero_variance"]
    assert r2.filter_reasons == ["zero_variance"]
    assert r.token_ids == [1, 2, 3] and r.reward == 0.0 and r.advantage is None


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="max_ratio"):
        RepetitionFilter(max_ratio=1.5)
    with pytest.raises(ValueError, match="max_model_tokens"):
        LengthFilter(max_model_tokens=0)


def test_filter_returning_wrong_count_is_an_error():
    class Broken:
        name = "broken"

        def reject(self, rollouts):
            return []

    with pytest.raises(ValueError, match="broken"):
        apply_filters([Broken()], [make()])
