"""Packing: seed 003's numbers, segment ids / positions, every token exactly once."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_orch.algorithms.packing import PAD_TEMPERATURE, pack_samples
from jaxrl_orch.types import NO_VERSION, Sample


def make_sample(n: int, seed: int = 0, prompt: int = 0, temp: float = 1.0) -> Sample:
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, bool)
    mask[min(prompt, n) :] = True
    return Sample(
        token_ids=rng.integers(1, 500, n).astype(np.int32),
        loss_mask=mask,
        logprobs=np.where(mask, -rng.random(n), 0.0).astype(np.float32),
        advantages=np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
        temperatures=np.full(n, temp, np.float32),
        versions=np.where(mask, 0, NO_VERSION).astype(np.int32),
    )


def unpack(pb, i):
    row, start, n = pb.placement[i]
    sl = slice(start, start + n)
    return {
        "token_ids": pb.tokens[row, sl],
        "loss_mask": pb.loss_mask[row, sl],
        "logprobs": pb.logprobs[row, sl],
        "advantages": pb.advantages[row, sl],
        "temperatures": pb.temperatures[row, sl],
    }


def assert_exact_once(samples, pb):
    # Each sample is recovered bit-exactly from its placement ...
    for i, s in enumerate(samples):
        got = unpack(pb, i)
        for k, v in got.items():
            np.testing.assert_array_equal(v, getattr(s, k)[: len(v)], err_msg=f"sample {i} {k}")
        row, start, n = pb.placement[i]
        seg = pb.segment_ids[row, start]
        assert seg > 0
        np.testing.assert_array_equal(pb.segment_ids[row, start : start + n], seg)
        np.testing.assert_array_equal(pb.positions[row, start : start + n], np.arange(n))
    # ... placements never overlap, and every non-padding slot belongs to some sample.
    owner = np.full(pb.tokens.shape, -1)
    for i, (row, start, n) in enumerate(pb.placement):
        assert (owner[row, start : start + n] == -1).all(), "two samples share a slot"
        owner[row, start : start + n] = i
    np.testing.assert_array_equal(owner >= 0, pb.segment_ids > 0)
    assert pb.num_tokens == sum(int(n) for _, _, n in pb.placement)


def test_seed_003_numbers_exact_150():
    samples = [make_sample(150, seed=i, prompt=50) for i in range(128)]
    pb = pack_samples(samples, 2048)
    assert pb.num_tokens == 19_200
    assert pb.num_rows == 10
    per_row = pb.samples_per_row()
    assert per_row.max() == 13 and (per_row[:9] == 13).all() and per_row[9] == 128 - 9 * 13
    assert pb.fill_ratio == pytest.approx(19_200 / (10 * 2048))
    assert_exact_once(samples, pb)


def test_seed_003_numbers_about_150():
    rng = np.random.default_rng(3)
    lengths = rng.integers(148, 153, size=128)  # "about 150": 148..152
    samples = [make_sample(int(n), seed=i) for i, n in enumerate(lengths)]
    pb = pack_samples(samples, 2048)
    assert 18_900 <= pb.num_tokens <= 19_500
    assert pb.num_rows == 10
    assert pb.samples_per_row().max() == 13
    assert_exact_once(samples, pb)


def test_segments_positions_and_padding_values():
    samples = [make_sample(3, seed=0, temp=0.7), make_sample(5, seed=1), make_sample(4, seed=2)]
    pb = pack_samples(samples, 8, pad_id=9)
    # FFD: 5 first into row 0, then 4 (no room) -> row 1, then 3 -> row 0.
    assert pb.num_rows == 2
    np.testing.assert_array_equal(pb.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(pb.positions[0], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(pb.segment_ids[1], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(pb.positions[1], [0, 1, 2, 3, 0, 0, 0, 0])
    pad = pb.segment_ids == 0
    assert (pb.tokens[pad] == 9).all() and not pb.loss_mask[pad].any()
    assert (pb.advantages[pad] == 0).all() and (pb.logprobs[pad] == 0).all()
    assert (pb.temperatures[pad] == PAD_TEMPERATURE).all()
    np.testing.assert_allclose(pb.temperatures[0, 5:], 0.7)
    assert pb.tokens.dtype == np.int32 and pb.positions.dtype == np.int32
    assert pb.segment_ids.dtype == np.int32 and pb.loss_mask.dtype == bool
    for k in ("advantages", "logprobs", "temperatures"):
        assert getattr(pb, k).dtype == np.float32
    assert_exact_once(samples, pb)


def test_num_rows_pads_and_errors_when_too_small():
    samples = [make_sample(6, seed=i) for i in range(3)]
    pb = pack_samples(samples, 8, num_rows=5)
    assert pb.tokens.shape == (5, 8) and pb.num_rows == 5
    assert (pb.segment_ids[3:] == 0).all()
    assert_exact_once(samples, pb)
    with pytest.raises(ValueError, match="need 3 rows.*num_rows=2"):
        pack_samples(samples, 8, num_rows=2)


def test_too_long_sample_errors_or_truncates():
    samples = [make_sample(4), make_sample(12, seed=1)]
    with pytest.raises(ValueError, match="sample 1 has 12 tokens.*row_len=10"):
        pack_samples(samples, 10)
    pb = pack_samples(samples, 10, truncate=True)
    assert tuple(pb.placement[1][2:]) == (10,)
    np.testing.assert_array_equal(unpack(pb, 1)["token_ids"], samples[1].token_ids[:10])
    assert_exact_once(samples, pb)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="row_len"):
        pack_samples([make_sample(2)], 0)
    with pytest.raises(ValueError, match="empty"):
        pack_samples([make_sample(0)], 4)
    s = make_sample(4)
    s.advantages = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="advantages has shape"):
        pack_samples([s], 8)


def test_empty_input():
    pb = pack_samples([], 16, num_rows=2)
    assert pb.tokens.shape == (2, 16) and pb.num_tokens == 0 and pb.fill_ratio == 0.0


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=40),
    row_len=st.integers(64, 200),
)
def test_property_every_token_exactly_once(lengths, row_len):
    samples = [make_sample(n, seed=i, prompt=i % 3) for i, n in enumerate(lengths)]
    pb = pack_samples(samples, row_len)
    assert_exact_once(samples, pb)
    assert pb.num_tokens == sum(lengths)
    # First fit never leaves two rows at most half full, so R - 1 < 2 * total / row_len.
    assert pb.num_rows - 1 < 2 * sum(lengths) / row_len or pb.num_rows <= 1
