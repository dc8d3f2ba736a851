"""The accelerator settings of the decoder: remat, scanned layers and attention backends give the
plain path's numbers; bf16 compute stays within stated bounds of fp32; the CPU default is the
plain path itself."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_orch.compose.precision import accel_model_config, engine_param_dtype
from jaxrl_orch.config.load import make_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.configs import get_config
from jaxrl_orch.models.transformer import ModelConfig, Transformer

CFG = ModelConfig(
    vocab_size=97,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    max_seq_len=256,
    qkv_bias=True,
)
ROWS, LEN = 2, 128


def _state(cfg: ModelConfig, seed: int = 0):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    fill = lambda x: jnp.asarray(
        1.0 + 0.2 * rng.normal(size=x.shape) if x.ndim == 1 else 0.3 * rng.normal(size=x.shape),
        x.dtype,
    )
    return jax.tree.map(fill, state)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (ROWS, LEN)), jnp.int32)
    seg = np.ones((ROWS, LEN), np.int32)
    seg[0, 50:] = 2
    seg[1, 120:] = 0
    pos = np.concatenate([np.arange(50), np.arange(LEN - 50)])[None].repeat(ROWS, 0)
    return tokens, jnp.asarray(pos, jnp.int32), jnp.asarray(seg)


def _loss_and_grad(cfg: ModelConfig, state, batch):
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
    tokens, pos, seg = batch

    @jax.jit
    def f(state):
        logits = nnx.merge(graphdef, state)(tokens, pos, seg)
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1))

    return jax.value_and_grad(f)(state)


@pytest.fixture(scope="module")
def plain(batch):
    state = _state(CFG)
    return state, _loss_and_grad(CFG, state, batch)


def _close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "change",
    [
        {"remat": "full"},
        {"remat": "dots_no_batch", "scan_layers": True},
        {"attention": "chunked", "attention_block": 32, "remat": "dots"},
        {"attention": "xla"},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_memory_settings_keep_the_plain_numbers(plain, batch, change):
    """Remat recomputes the same ops (on CPU: bit-identical); scanning stacks the same params;
    chunked / XLA attention are the same function: loss and gradients within float32 rounding
    of the plain path."""
    state, (loss, grads) = plain
    loss2, grads2 = _loss_and_grad(dataclasses.replace(CFG, **change), state, batch)
    if change == {"remat": "full"}:
        assert float(loss2) == float(loss)
        _close(grads2, grads, rtol=0, atol=0)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    _close(grads2, grads, rtol=1e-4, atol=1e-6)


def test_bf16_compute_within_bounds_of_fp32(plain, batch):
    """bf16 matmuls (fp32 master weights, fp32 softmax / norms / logits) on O(1) random weights
    (sharper than trained ones): per-token log-probs within 0.5 nats of fp32, mean gap under
    0.05 nats, the mean loss within 1%."""
    state, (loss, _) = plain
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0))))[0]
    bf = dataclasses.replace(CFG, dtype=jnp.bfloat16)
    gbf = nnx.split(nnx.eval_shape(lambda: Transformer(bf, rngs=nnx.Rngs(0))))[0]
    tokens, pos, seg = batch

    def token_lp(gd, st):
        logits = nnx.merge(gd, st)(tokens, pos, seg)
        assert logits.dtype == jnp.float32  # logits / log-probs stay fp32 whatever the compute
        lp = jax.nn.log_softmax(logits[:, :-1])
        return np.asarray(jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0])

    a, b = token_lp(graphdef, state), token_lp(gbf, state)
    gap = np.abs(a - b)
    assert gap.max() < 0.5 and gap.mean() < 0.05, (gap.max(), gap.mean())
    assert abs(-b.mean() - float(loss)) / float(loss) < 0.01


def test_cpu_default_resolves_to_the_plain_model_with_blocked_attention():
    """TrainConfig's defaults on CPU build the preset (fp32, no remat, no scan) with chunked
    attention in 128-blocks (the CPU's fastest; same function); an explicit einsum is the preset."""
    base = get_config("tiny-byte")
    cpu = accel_model_config(base, TrainConfig(), "cpu")
    assert cpu == dataclasses.replace(base, attention="chunked", attention_block=128)
    einsum = make_config({"Model.attention": "einsum"})
    assert accel_model_config(base, einsum, "cpu") == base
    assert engine_param_dtype(TrainConfig(), "cpu") == jnp.float32
    tpu = accel_model_config(base, TrainConfig(), "tpu")
    assert (tpu.dtype, tpu.param_dtype, tpu.attention) == (
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float32),
        "splash",
    )
    assert engine_param_dtype(TrainConfig(), "tpu") == jnp.bfloat16


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="remat must be one of .*'sometimes'"):
        dataclasses.replace(CFG, remat="sometimes")
    with pytest.raises(ValueError, match="attention must be one of .*'flash'"):
        dataclasses.replace(CFG, attention="flash")
    with pytest.raises(ValueError, match="Model.compute_dtype must be one of .*'fp8'"):
        make_config({"Model.compute_dtype": "fp8"})
    with pytest.raises(ValueError, match="Trainer.logprob_chunk must be >= 0"):
        make_config({"Trainer.logprob_chunk": -1})


def test_scanned_cached_forward_matches_unrolled():
    """Prefill then one decode step through the cache: scanning the layers changes nothing."""
    from jaxrl_orch.models.transformer import init_cache

    state = _state(CFG)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32)[None], (2, 12))
    outs = []
    for scan in (False, True):
        cfg = dataclasses.replace(CFG, scan_layers=scan, attention="chunked")
        gd = nnx.split(nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0))))[0]

        @jax.jit
        def run(state, gd=gd, cfg=cfg):
            model = nnx.merge(gd, state)
            _, cache = model.forward_cached(tokens[:, :10], pos[:, :10], init_cache(cfg, 2, 16))
            return model.forward_cached(tokens[:, 10:11], pos[:, 10:11], cache)

        outs.append(run(state))
    (l0, c0), (l1, c1) = outs
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-5, atol=1e-5)
    # Unrolled: one array per layer; scanned: the same layers stacked.
    np.testing.assert_allclose(np.asarray(c1["k"]), np.stack(c0["k"]), rtol=1e-5, atol=1e-5)
