"""decode_state slot operations against NumPy row copies, on a synthetic 2-slot state (the
slot count equals the PRNG key's length on purpose: entries are told apart by name)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_orch.inference import decode_state
from jaxrl_orch.models.transformer import ModelConfig, init_cache
from jaxrl_orch.types import SamplingParams

CFG = ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8)
# Both cache layouts: one array per layer (slot axis 0) and scan_layers' stacked one (axis 1).
LAYOUTS = {"per-layer": CFG, "stacked": dataclasses.replace(CFG, scan_layers=True)}


def kv(state, name):
    """``state``'s cache ``name`` as one ``[layers, slots, kv, length, dim]`` array."""
    cache = state["cache"][name]
    return np.stack(cache) if isinstance(cache, list) else np.asarray(cache)


def random_state(slots, seed=0, cfg=CFG):
    state = decode_state.build(cfg, slots, 6, np.float32, 2, seed)
    rng = np.random.default_rng(seed)
    return {
        name: jax.tree.map(lambda x: (10 * rng.random(size=x.shape)).astype(x.dtype), value)
        if name not in ("rng", "active")
        else value
        for name, value in state.items()
    } | {"active": np.array([True, False, True, True][:slots])}


def as_numpy(state):
    return jax.tree.map(np.asarray, state)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("slots", [2, 4])
def test_head_then_put_head_round_trips_and_touches_only_the_head(slots, layout):
    state = as_numpy(random_state(slots, cfg=LAYOUTS[layout]))
    head = as_numpy(decode_state.head(state, 1))
    assert kv(head, "k").shape[1] == 1 and head["tokens"].shape == (1,)
    np.testing.assert_array_equal(kv(head, "v"), kv(state, "v")[:, :1])
    np.testing.assert_array_equal(head["rng"], state["rng"])  # shared, never sliced
    changed = jax.tree.map(lambda x: x + 1 if x.dtype != bool else ~x, head)
    merged = as_numpy(decode_state.put_head(state, changed))
    for name in ("tokens", "pos", "top_p", "stop", "active", "seeded", "seed_key", "generated"):
        np.testing.assert_array_equal(merged[name][:1], changed[name])
        np.testing.assert_array_equal(merged[name][1:], state[name][1:])
    np.testing.assert_array_equal(kv(merged, "k")[:, 1:], kv(state, "k")[:, 1:])
    np.testing.assert_array_equal(kv(merged, "k")[:, :1], kv(changed, "k"))
    np.testing.assert_array_equal(merged["rng"], changed["rng"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_move_copies_every_row_and_deactivates_the_source(layout):
    state = as_numpy(random_state(4, cfg=LAYOUTS[layout]))
    moved = as_numpy(decode_state.move(state, np.int32(3), np.int32(1)))
    for name in ("tokens", "pos", "temperature", "stop", "max_tokens", "seeded", "seed_key"):
        expect = state[name].copy()
        expect[1] = state[name][3]
        np.testing.assert_array_equal(moved[name], expect)
    expect_k = kv(state, "k").copy()
    expect_k[:, 1] = kv(state, "k")[:, 3]
    np.testing.assert_array_equal(kv(moved, "k"), expect_k)
    assert list(moved["active"]) == [True, True, True, False]
    same = as_numpy(decode_state.move(state, np.int32(2), np.int32(2)))
    assert list(same["active"]) == list(state["active"])


def test_default_widths_halve_down_to_an_eighth():
    assert decode_state.default_widths(32) == (32, 16, 8, 4)
    assert decode_state.default_widths(6) == (6, 3)
    assert decode_state.default_widths(1) == (1,)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_insert_writes_the_prefix_kv_into_its_slot(layout):
    cfg = LAYOUTS[layout]
    state = jax.tree.map(jax.numpy.asarray, random_state(4, cfg=cfg))
    prefix = init_cache(cfg, 1, 5)
    prefix = jax.tree.map(lambda x: np.full(x.shape, 7.0, x.dtype), prefix)
    fields = decode_state.slot_fields(
        {"token": np.int32(3), "pos": np.int32(4)}, SamplingParams(), 2
    )
    out = as_numpy(decode_state.insert(state, prefix, fields, np.int32(2)))
    expect = kv(as_numpy(state), "v").copy()
    expect[:, 2, :, :5] = 7.0  # the prompt's 5 positions of slot 2; the rest untouched
    np.testing.assert_array_equal(kv(out, "v"), expect)


def test_insert_writes_the_seed_key_of_seed_and_prompt_length():
    state = decode_state.build(CFG, 4, 6, np.float32, 2, 0)
    prefix = {"token": np.int32(3), "pos": np.int32(4)}  # a 5-token prompt
    cache = init_cache(CFG, 1, 5)
    fields = decode_state.slot_fields(prefix, SamplingParams(seed=77), 2)
    state = decode_state.insert(state, cache, fields, np.int32(2))
    out = as_numpy(state)
    expect = jax.random.fold_in(jax.random.PRNGKey(77), 5)
    np.testing.assert_array_equal(out["seed_key"][2], expect)
    assert list(out["seeded"]) == [False, False, True, False]
    unseeded = decode_state.slot_fields(prefix, SamplingParams(), 2)
    out = as_numpy(decode_state.insert(state, cache, unseeded, np.int32(2)))
    assert not out["seeded"].any()
