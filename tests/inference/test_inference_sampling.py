"""sample_tokens against a plain NumPy reference of temperature / top-k / top-p sampling."""

import jax
import numpy as np
import pytest

from jaxrl_orch.inference.sampling import request_key, row_keys, sample_tokens, token_key


def ref_distribution(logits, temperature, top_k, top_p):
    """NumPy: the truncated, renormalised sampling distribution of one row."""
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros_like(scaled, dtype=bool)
    k = len(scaled) if top_k == 0 else top_k
    head = order[:k]
    p = np.exp(scaled[head] - scaled[head].max())
    p /= p.sum()
    mass_before = np.cumsum(p) - p
    keep[head[mass_before < top_p]] = True
    keep |= scaled >= scaled[keep].min()  # documented rule: ties at the cut-off are all kept
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    return probs / probs.sum()


def ref_logprob(logits, temperature, token):
    scaled = logits / (temperature if temperature > 0 else 1.0)
    scaled = scaled - scaled.max()
    return scaled[token] - np.log(np.exp(scaled).sum())


@pytest.fixture(scope="module")
def sample():
    return jax.jit(jax.vmap(sample_tokens, in_axes=(None, 0, None, None, None)))


ROWS = np.array(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
        [0.1, 0.3, 0.2, 1.5, 1.4, -0.2],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [5.0, -1.0, 0.0, 4.0, 3.0, 2.0],
    ],
    np.float32,
)
SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.8)]


def test_empirical_distribution_matches_the_reference(sample):
    temp = np.array([s[0] for s in SETTINGS], np.float32)
    top_k = np.array([s[1] for s in SETTINGS], np.int32)
    top_p = np.array([s[2] for s in SETTINGS], np.float32)
    n = 4000
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logprobs = sample(ROWS, keys, temp, top_k, top_p)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    for row in range(len(ROWS)):
        ref = ref_distribution(ROWS[row].astype(np.float64), *SETTINGS[row])
        counts = np.bincount(tokens[:, row], minlength=ROWS.shape[1]) / n
        assert np.all(counts[ref == 0] == 0), (row, counts, ref)
        # 4000 draws: binomial std <= 0.008, so 0.035 is > 4 sigma.
        np.testing.assert_allclose(counts, ref, atol=0.035)
        expect = [ref_logprob(ROWS[row].astype(np.float64), temp[row], t) for t in tokens[:, row]]
        np.testing.assert_allclose(logprobs[:, row], expect, atol=1e-5)


def test_greedy_rows_take_argmax_with_t1_logprobs(sample):
    temp = np.array([0.0, 0.0, 1.0, 0.0], np.float32)
    keys = jax.random.split(jax.random.key(1), 8)
    tokens, logprobs = sample(ROWS, keys, temp, np.zeros(4, np.int32), np.ones(4, np.float32))
    tokens = np.asarray(tokens)
    for row in (0, 1, 3):
        assert np.all(tokens[:, row] == ROWS[row].argmax())
        np.testing.assert_allclose(
            np.asarray(logprobs)[:, row], ref_logprob(ROWS[row], 0.0, ROWS[row].argmax()), atol=1e-6
        )


def test_top_k_one_is_argmax_and_tiny_top_p_keeps_the_head(sample):
    keys = jax.random.split(jax.random.key(2), 64)
    temp = np.full(4, 2.0, np.float32)
    tokens, _ = sample(ROWS, keys, temp, np.ones(4, np.int32), np.ones(4, np.float32))
    np.testing.assert_array_equal(
        np.asarray(tokens)[:, [0, 1, 3]], np.tile(ROWS.argmax(1)[[0, 1, 3]], (64, 1))
    )
    tokens, _ = sample(ROWS, keys, temp, np.zeros(4, np.int32), np.full(4, 1e-6, np.float32))
    np.testing.assert_array_equal(
        np.asarray(tokens)[:, [0, 1, 3]], np.tile(ROWS.argmax(1)[[0, 1, 3]], (64, 1))
    )


def test_untruncated_batch_takes_the_fast_path_with_the_same_draws(sample):
    """No row truncates -> the sort is skipped (lax.cond); each row's draws must equal the ones
    it gets when another row of the same batch forces the truncating branch."""
    keys = jax.random.split(jax.random.key(3), 4000)
    temp = np.array([1.0, 0.7, 1.3, 0.5], np.float32)
    plain_k, plain_p = np.zeros(4, np.int32), np.ones(4, np.float32)
    fast, fast_lp = map(np.asarray, sample(ROWS, keys, temp, plain_k, plain_p))
    forced_k = plain_k.copy()
    forced_k[3] = 2  # only row 3 truncates; rows 0-2 still keep every token
    slow, slow_lp = map(np.asarray, sample(ROWS, keys, temp, forced_k, plain_p))
    np.testing.assert_array_equal(fast[:, :3], slow[:, :3])
    np.testing.assert_allclose(fast_lp[:, :3], slow_lp[:, :3], atol=1e-6)
    assert set(np.unique(slow[:, 3])) <= set(np.argsort(-ROWS[3])[:2])
    for row in range(4):
        ref = ref_distribution(ROWS[row].astype(np.float64), temp[row], 0, 1.0)
        counts = np.bincount(fast[:, row], minlength=ROWS.shape[1]) / len(keys)
        np.testing.assert_allclose(counts, ref, atol=0.035)


def test_row_keys_take_the_request_key_where_seeded_and_the_engine_stream_elsewhere():
    step = jax.random.PRNGKey(9)
    requests = jax.vmap(request_key)(np.array([5, 6, 7, 8], np.int32), np.full(4, 3, np.int32))
    seeded = np.array([True, False, True, False])
    index = np.array([0, 4, 2, 1], np.int32)
    keys = np.asarray(row_keys(step, requests, seeded, index))
    split = np.asarray(jax.random.split(step, 4))
    for b in range(4):
        base = jax.random.fold_in(jax.random.PRNGKey(5 + b), 3)
        expect = jax.random.fold_in(base, index[b]) if seeded[b] else split[b]
        np.testing.assert_array_equal(keys[b], expect)
    # No row seeded: exactly the draws of the one-key call (unseeded behaviour unchanged).
    settings = (np.full(4, 1.0, np.float32), np.zeros(4, np.int32), np.ones(4, np.float32))
    none = row_keys(step, requests, np.zeros(4, bool), index)
    a = sample_tokens(ROWS, step, *settings)
    b = sample_tokens(ROWS, None, *settings, keys=none)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_seeded_draws_follow_the_truncated_reference_distribution():
    """Seeds 0..3999 at one token index: per-request keys are as random as the engine's."""
    n = 4000
    temp = np.array([s[0] for s in SETTINGS], np.float32)
    top_k = np.array([s[1] for s in SETTINGS], np.int32)
    top_p = np.array([s[2] for s in SETTINGS], np.float32)

    def draw(seed):
        keys = jax.vmap(lambda r: token_key(request_key(seed, 7), r))(np.arange(4, dtype=np.int32))
        return sample_tokens(ROWS, None, temp, top_k, top_p, keys=keys)[0]

    tokens = np.asarray(jax.jit(jax.vmap(draw))(np.arange(n, dtype=np.int32)))
    for row in range(len(ROWS)):
        ref = ref_distribution(ROWS[row].astype(np.float64), *SETTINGS[row])
        counts = np.bincount(tokens[:, row], minlength=ROWS.shape[1]) / n
        assert np.all(counts[ref == 0] == 0), (row, counts, ref)
        np.testing.assert_allclose(counts, ref, atol=0.035)
