"""step_stats against plain NumPy: summaries == np.max/np.mean/np.percentile, head_versions ==
Rollout.head_version."""

import numpy as np
import pytest

from jaxrl_orch.orchestrator.samples import trace_to_sample
from jaxrl_orch.orchestrator.stats import head_versions, summaries
from jaxrl_orch.types import NO_VERSION, Rollout


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 101])
def test_summaries_equal_numpy(n):
    rng = np.random.default_rng(n)
    series = {
        "ints": rng.integers(0, 5, n).tolist(),
        "floats": rng.normal(size=n).tolist(),
        "tail": rng.lognormal(0, 2, n).tolist(),
    }
    got = summaries(series)
    assert len(got) == 15
    for name, values in series.items():
        a = np.asarray(values, np.float64)
        assert got[f"{name}_max"] == a.max()
        assert got[f"{name}_mean"] == a.mean()
        for q in (50, 95, 99):
            assert got[f"{name}_p{q}"] == np.percentile(a, q)


def test_summaries_of_nothing_is_empty():
    assert summaries({"a": [], "b": []}) == {}
    assert summaries({}) == {}


def _rollout(versions, mask, start=7):
    n = len(versions)
    return Rollout(
        env="t",
        group_id=0,
        episode_id=0,
        example={},
        token_ids=list(range(n)),
        loss_mask=mask,
        logprobs=[0.0] * n,
        versions=versions,
        policy_version_at_start=start,
        num_turns=1,
    )


def test_head_versions_equal_the_property():
    rs = [
        _rollout([NO_VERSION, 4, 3, 5], [False, True, True, True]),
        _rollout([2, 9, NO_VERSION], [False, True, True]),  # prompt version ignored
        _rollout([NO_VERSION, NO_VERSION], [False, True]),  # no versioned model token
        _rollout([1], [True]),
    ]
    for r in rs:
        r.samples = [trace_to_sample(r)]
    assert head_versions(rs) == [r.head_version for r in rs] == [3, 9, 7, 1]
    # Without exactly one non-empty sample each, the property is used.
    rs[1].samples = []
    empty = _rollout([], [])
    empty.samples = [trace_to_sample(empty)]
    assert head_versions(rs + [empty]) == [3, 9, 7, 1, 7]
    assert head_versions([]) == []
