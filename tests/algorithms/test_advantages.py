"""Advantage estimators against plain NumPy / hand-computed references."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_orch.algorithms.advantages import (
    ALGORITHM_NAMES,
    NonFiniteRewardError,
    get_algorithm,
)
from jaxrl_orch.types import Algorithm

REWARDS = np.array([0.99, 0.40, 0.62, 0.47], np.float64)


def reference(name: str, r: np.ndarray) -> np.ndarray:
    g = len(r)
    if name in ("grpo", "dr_grpo"):
        return r - r.mean()
    if name == "grpo_std":
        return (r - r.mean()) / (r.std(ddof=1) + 1e-4)
    if name == "rloo":
        return np.array([r[i] - np.mean(np.delete(r, i)) for i in range(g)])
    raise AssertionError(name)


def test_names_are_the_documented_four():
    assert set(ALGORITHM_NAMES) == {"grpo", "grpo_std", "dr_grpo", "rloo"}


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_matches_numpy_reference(name):
    algo = get_algorithm(name)
    assert isinstance(algo, Algorithm)
    assert algo.name == name
    got = algo.advantages(REWARDS)
    assert got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, reference(name, REWARDS), rtol=1e-5, atol=1e-6)


def test_seed_003_group_mean_numbers():
    # Group averaging 0.62: the 0.99 answer gets +0.37, the 0.40 answer gets -0.22.
    r = np.array([0.99, 0.40, 0.62, 0.47, 0.62], np.float64)
    assert r.mean() == pytest.approx(0.62)
    adv = get_algorithm("grpo").advantages(r)
    assert adv[0] == pytest.approx(0.37, abs=1e-6)
    assert adv[1] == pytest.approx(-0.22, abs=1e-6)


def test_rloo_hand_values():
    # r = [1, 0, 0]: baselines 0, 0.5, 0.5.
    adv = get_algorithm("rloo").advantages(np.array([1.0, 0.0, 0.0]))
    np.testing.assert_allclose(adv, [1.0, -0.5, -0.5])


def test_dr_grpo_flags_token_sum_normalisation():
    assert get_algorithm("dr_grpo").token_sum_normalization is True
    assert get_algorithm("grpo").token_sum_normalization is False


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_identical_rewards_give_exact_zero(name):
    adv = get_algorithm(name).advantages(np.full(16, 0.7))
    assert np.array_equal(adv, np.zeros(16, np.float32))


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_single_rollout_group_is_zero(name):
    np.testing.assert_array_equal(get_algorithm(name).advantages(np.array([3.0])), [0.0])


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_reward_raises_naming_index_and_value(name, bad):
    r = np.array([0.1, bad, 0.3])
    with pytest.raises(NonFiniteRewardError, match=r"\[1\]=") as e:
        get_algorithm(name).advantages(r)
    assert e.value.indices == [1]
    assert isinstance(e.value, ValueError)


def test_input_not_mutated_and_2d_rejected():
    r = REWARDS.copy()
    get_algorithm("grpo_std").advantages(r)
    np.testing.assert_array_equal(r, REWARDS)
    with pytest.raises(ValueError, match="1-D"):
        get_algorithm("grpo").advantages(np.zeros((2, 2)))


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="choose one of.*grpo.*rloo"):
        get_algorithm("ppo")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=32))
def test_property_reference_and_zero_sum(rewards):
    r = np.array(rewards)
    for name in ALGORITHM_NAMES:
        got = get_algorithm(name).advantages(r)
        np.testing.assert_allclose(got, reference(name, r), rtol=1e-4, atol=1e-4)
        # Every estimator here is centred: advantages sum to zero within a group.
        assert abs(float(np.sum(got, dtype=np.float64))) < 1e-3 * len(r) * max(1.0, np.abs(r).max())


def test_permuted_control_shuffles_the_pairing_and_keeps_everything_else():
    rewards = np.array([0.1, 0.9, 0.4, 0.4, 0.7, 0.0])
    control = get_algorithm("permuted:grpo")
    assert control.name == "permuted:grpo" and isinstance(control, Algorithm)
    real = get_algorithm("grpo").advantages(rewards)
    shuffled = [control.advantages(rewards) for _ in range(20)]
    for adv in shuffled:
        np.testing.assert_allclose(np.sort(adv), np.sort(real), rtol=0, atol=0)
        assert adv.dtype == np.float32
    assert any(not np.array_equal(adv, real) for adv in shuffled)  # the pairing really moves
    # Seeded: a fresh control replays the same shuffles (a run is reproducible).
    again = get_algorithm("permuted:grpo")
    np.testing.assert_array_equal(again.advantages(rewards), shuffled[0])
    # Flat groups stay flat (zero signal is still spotted by the sink), and flags carry over.
    np.testing.assert_array_equal(control.advantages(np.full(4, 0.3)), np.zeros(4))
    assert get_algorithm("permuted:dr_grpo").token_sum_normalization
    with pytest.raises(ValueError, match="unknown advantage algorithm 'nope'"):
        get_algorithm("permuted:nope")
