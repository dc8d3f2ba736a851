"""decode_state slot operations against NumPy row copies, on a synthetic 2-slot state (the
slot count equals the PRNG key's length on purpose: entries are told apart by name)."""

import jax
import numpy as np
import pytest

from jaxrl_orch.inference import decode_state
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.types import SamplingParams

CFG = ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8)


def random_state(slots, seed=0):
    state = decode_state.build(CFG, slots, 6, np.float32, 2, seed)
    rng = np.random.default_rng(seed)
    return {
        name: jax.tree.map(lambda x: (10 * rng.random(size=x.shape)).astype(x.dtype), value)
        if name not in ("rng", "active")
        else value
        for name, value in state.items()
    } | {"active": np.array([True, False, True, True][:slots])}


def as_numpy(state):
    return jax.tree.map(np.asarray, state)


@pytest.mark.parametrize("slots", [2, 4])
def test_head_then_put_head_round_trips_and_touches_only_the_head(slots):
    state = as_numpy(random_state(slots))
    head = as_numpy(decode_state.head(state, 1))
    assert head["cache"]["k"].shape[1] == 1 and head["tokens"].shape == (1,)
    np.testing.assert_array_equal(head["cache"]["v"], state["cache"]["v"][:, :1])
    np.testing.assert_array_equal(head["rng"], state["rng"])  # shared, never sliced
    changed = jax.tree.map(lambda x: x + 1 if x.dtype != bool else ~x, head)
    merged = as_numpy(decode_state.put_head(state, changed))
    for name in ("tokens", "pos", "top_p", "stop", "active", "seeded", "seed_key", "generated"):
        np.testing.assert_array_equal(merged[name][:1], changed[name])
        np.testing.assert_array_equal(merged[name][1:], state[name][1:])
    np.testing.assert_array_equal(merged["cache"]["k"][:, 1:], state["cache"]["k"][:, 1:])
    np.testing.assert_array_equal(merged["cache"]["k"][:, :1], changed["cache"]["k"])
    np.testing.assert_array_equal(merged["rng"], changed["rng"])


def test_move_copies_every_row_and_deactivates_the_source():
    state = as_numpy(random_state(4))
    moved = as_numpy(decode_state.move(state, np.int32(3), np.int32(1)))
    for name in ("tokens", "pos", "temperature", "stop", "max_tokens", "seeded", "seed_key"):
        expect = state[name].copy()
        expect[1] = state[name][3]
        np.testing.assert_array_equal(moved[name], expect)
    expect_k = state["cache"]["k"].copy()
    expect_k[:, 1] = state["cache"]["k"][:, 3]
    np.testing.assert_array_equal(moved["cache"]["k"], expect_k)
    assert list(moved["active"]) == [True, True, True, False]
    same = as_numpy(decode_state.move(state, np.int32(2), np.int32(2)))
    assert list(same["active"]) == list(state["active"])


def test_default_widths_halve_down_to_an_eighth():
    assert decode_state.default_widths(32) == (32, 16, 8, 4)
    assert decode_state.default_widths(6) == (6, 3)
    assert decode_state.default_widths(1) == (1,)


def test_insert_writes_the_seed_key_of_seed_and_prompt_length():
    state = decode_state.build(CFG, 4, 6, np.float32, 2, 0)
    prefix = {"token": np.int32(3), "pos": np.int32(4)}  # a 5-token prompt
    cache = jax.tree.map(lambda x: x[:, :1, :5], state["cache"])
    fields = decode_state.slot_fields(prefix, SamplingParams(seed=77), 2)
    state = decode_state.insert(state, cache, fields, np.int32(2))
    out = as_numpy(state)
    expect = jax.random.fold_in(jax.random.PRNGKey(77), 5)
    np.testing.assert_array_equal(out["seed_key"][2], expect)
    assert list(out["seeded"]) == [False, False, True, False]
    unseeded = decode_state.slot_fields(prefix, SamplingParams(), 2)
    out = as_numpy(decode_state.insert(state, cache, unseeded, np.int32(2)))
    assert not out["seeded"].any()
