"""LoRA adapters (models/lora.py): exact at init, merged == unmerged, gradients against NumPy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.trainer_batches import TINY

from jaxrl_orch.models.lora import Adaptable, merge_adapters, project
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.transformer import ModelConfig, Transformer

# The trainer tests' tiny model, with Qwen2's q/k/v biases and an untied head: every weight kind.
BASE = dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=False)
LORA = LoraConfig(rank=4, alpha=8.0)


def _split(cfg: ModelConfig, seed: int = 0):
    """``(graphdef, adapters, base state)`` of a LoRA model."""
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)), nnx.LoRAParam, ...)


def _base_model(cfg: ModelConfig, base_state) -> Transformer:
    """The model without adapters, on the given base weights."""
    plain = dataclasses.replace(cfg, lora=None)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, base_state)


def _tokens(b: int = 2, t: int = 12):
    tokens = jax.random.randint(jax.random.PRNGKey(3), (b, t), 0, BASE.vocab_size)
    return tokens, jnp.broadcast_to(jnp.arange(t)[None], (b, t))


def _randomise_b(adapters, seed: int = 1):
    """Non-zero ``B`` matrices (a trained adapter)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    leaves = [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(tree, leaves)


@pytest.mark.parametrize("targets", [LORA.targets, ("q", "v"), ("down",)])
def test_fresh_adapters_leave_the_logits_bit_identical(targets):
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=4, alpha=8.0, targets=targets))
    graphdef, adapters, base = _split(cfg)
    n_adapted = sum(1 for _ in jax.tree.leaves(adapters)) // 2
    assert n_adapted == len(targets) * cfg.n_layers
    tokens, positions = _tokens()
    ours = nnx.merge(graphdef, adapters, base)(tokens, positions)
    plain = _base_model(cfg, base)(tokens, positions)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))


@pytest.mark.parametrize("layout", ["unrolled", "scan", "scan+remat"])
def test_merged_weights_equal_the_unmerged_adapters(layout):
    extra = {"scan": {"scan_layers": True}, "scan+remat": {"scan_layers": True, "remat": "full"}}
    cfg = dataclasses.replace(BASE, lora=LORA, **extra.get(layout, {}))
    graphdef, adapters, base = _split(cfg)
    adapters = _randomise_b(adapters)
    tokens, positions = _tokens()
    unmerged = nnx.merge(graphdef, adapters, base)(tokens, positions)
    merged_state = merge_adapters(base, adapters, LORA.scale)
    merged = _base_model(cfg, merged_state)(tokens, positions)
    plain = _base_model(cfg, base)(tokens, positions)
    assert float(jnp.max(jnp.abs(unmerged - plain))) > 1e-2  # the adapters do something
    np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), atol=2e-5, rtol=2e-5)


def test_merge_refuses_adapters_of_another_model():
    cfg = dataclasses.replace(BASE, lora=LORA)
    _, adapters, base = _split(cfg)
    pruned = jax.tree.map(lambda x: x, base)
    del pruned["layers"][0]["attn"]["q_proj"]
    with pytest.raises(ValueError, match="adapters do not match the base"):
        merge_adapters(pruned, adapters, LORA.scale)


def test_merge_matches_a_pure_dict_base_to_state_adapters():
    # The engine may hold its base as a pure dict: arrays are matched by name, not by the
    # state's ``.value`` steps.
    cfg = dataclasses.replace(BASE, lora=LORA)
    _, adapters, base = _split(cfg)
    adapters = _randomise_b(adapters)
    from_state = merge_adapters(base, adapters, LORA.scale)
    from_dict = merge_adapters(nnx.to_pure_dict(base), adapters, LORA.scale)
    assert jax.tree.leaves(from_dict) and len(jax.tree.leaves(from_dict)) == len(
        jax.tree.leaves(from_state)
    )
    for x, y in zip(jax.tree.leaves(from_dict), jax.tree.leaves(from_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    changed = sum(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(from_dict), jax.tree.leaves(base), strict=True)
    )
    assert changed == len(LORA.targets) * cfg.n_layers


class _Proj(Adaptable):
    """One adapted projection, as the MLP's ``gate`` holds it."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate_proj = nnx.Param(
            jax.random.normal(rngs.params(), (5, 7)), logical_axes=("a", "b")
        )
        self.add_adapters(cfg.lora, rngs)

    def __call__(self, x):
        return project(self, "gate_proj", "bte,ef->btf", x, self.cfg)


def test_adapter_gradients_match_numpy():
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=3, alpha=6.0, targets=("gate",)))
    graphdef, adapters, base = nnx.split(_Proj(cfg, nnx.Rngs(0)), nnx.LoRAParam, ...)
    adapters = _randomise_b(adapters)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (2, 4, 5)), np.float64)
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(6), (2, 4, 7)), np.float64)

    def loss(ad):
        return jnp.sum(nnx.merge(graphdef, ad, base)(jnp.asarray(x, jnp.float32)) * g)

    grads = jax.grad(loss)(adapters)
    a = np.asarray(adapters["gate_proj_lora_a"][...], np.float64)
    b = np.asarray(adapters["gate_proj_lora_b"][...], np.float64)
    s = cfg.lora.scale
    # y = x W + s (x A) B, L = sum(y * g):  dL/dA = s x^T (g B^T),  dL/dB = s (x A)^T g
    x2, g2 = x.reshape(-1, 5), g.reshape(-1, 7)
    want_a = s * x2.T @ (g2 @ b.T)
    want_b = s * (x2 @ a).T @ g2
    np.testing.assert_allclose(grads["gate_proj_lora_a"][...], want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads["gate_proj_lora_b"][...], want_b, rtol=1e-5, atol=1e-5)
    assert "gate_proj" not in grads  # the base is not differentiated


def test_adapters_are_float32_masters_over_a_bf16_base():
    cfg = dataclasses.replace(BASE, lora=LORA, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    _, adapters, base = _split(cfg)
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": -1}, "Lora.rank must be >= 0, got -1"),
        ({"rank": 1.5}, "Lora.rank must be an int, got 1.5"),
        ({"alpha": 0.0}, "Lora.alpha must be > 0, got 0.0"),
        ({"targets": ("q", "qkv")}, r"Lora.targets must be a non-empty tuple of distinct names"),
        ({"targets": ()}, "Lora.targets must be a non-empty tuple of distinct names"),
        ({"quantize": "int8"}, r"Lora.quantize = 'int8' quantizes a LoRA run's frozen base"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_a_model_with_adapters_of_rank_0_is_refused():
    with pytest.raises(ValueError, match="rank 0 is a run without them"):
        dataclasses.replace(BASE, lora=LoraConfig(rank=0))
