"""QLoRA (models/qlora.py): a LoRA run's frozen base held int8 / int4 through qwix.

The quantized model must compute exactly what the plain model computes on the dequantized
weights (the only change is where the weights come from), under every layer layout; a dense
base quantizes into the tree the model's own init builds; and the dequantized base is within
half a quantization step of the dense one, channel by channel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.trainer_batches import TINY

from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.qlora import WEIGHTS, dequantize, dequantize_base, quantize, quantize_base
from jaxrl_orch.models.transformer import Transformer

BASE = dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=False)


def _abstract(cfg):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.LoRAParam, ...)


def _plain_state(seed: int = 5):
    return nnx.split(Transformer(BASE, rngs=nnx.Rngs(seed)))[1]


def _tokens(b: int = 2, t: int = 12):
    tokens = jax.random.randint(jax.random.PRNGKey(3), (b, t), 0, BASE.vocab_size)
    return tokens, jnp.broadcast_to(jnp.arange(t)[None], (b, t))


@pytest.mark.parametrize("qtype, dtype", [("int8", jnp.int8), ("int4", jnp.int4)])
def test_a_weight_quantizes_per_output_channel_within_half_a_step(qtype, dtype):
    w = jax.random.normal(jax.random.PRNGKey(0), (16, 4, 8), jnp.float32)  # q: [E, H, D]
    values, scale = quantize(w, "q_proj", qtype)
    assert values.dtype == dtype and values.shape == w.shape
    assert scale.shape == (1, 4, 8) and scale.dtype == w.dtype  # one per output channel
    back = np.asarray(dequantize(values, scale))
    err = np.abs(back - np.asarray(w))
    assert np.all(err <= np.asarray(scale) / 2 + 1e-6)
    assert err.max() > 0  # really quantized, not stored as it was
    o = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 16), jnp.float32)  # o: [H, D, E]
    assert quantize(o, "o_proj", qtype)[1].shape == (1, 1, 16)


@pytest.mark.parametrize("layout", ["unrolled", "scan+remat"])
@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_the_quantized_model_is_the_plain_model_on_the_dequantized_base(qtype, layout):
    layouts = {"unrolled": {}, "scan+remat": {"scan_layers": True, "remat": "full"}}
    plain_cfg = dataclasses.replace(BASE, **layouts[layout])
    cfg = dataclasses.replace(plain_cfg, lora=LoraConfig(rank=4, alpha=8.0, quantize=qtype))
    graphdef, adapters_abs, frozen_abs = _abstract(cfg)
    plain_graph, plain_abs = nnx.split(
        nnx.eval_shape(lambda: Transformer(plain_cfg, rngs=nnx.Rngs(0)))
    )
    dense = nnx.split(Transformer(plain_cfg, rngs=nnx.Rngs(5)))[1]
    frozen = quantize_base(dense, frozen_abs, qtype)
    adapters = nnx.split(Transformer(cfg, rngs=nnx.Rngs(1)), nnx.LoRAParam, ...)[1]
    stored = {x.dtype for x in jax.tree.leaves(frozen) if x.ndim >= 2 and x.shape[0] > 1}
    assert jnp.dtype(qtype) in stored
    tokens, positions = _tokens()
    ours = nnx.merge(graphdef, adapters, frozen)(tokens, positions)  # B = 0 at init
    restored = dequantize_base(frozen, plain_abs)
    plain = nnx.merge(plain_graph, restored)(tokens, positions)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))
    # ... and the quantization changed the policy only a little.
    exact = nnx.merge(plain_graph, dense)(tokens, positions)
    assert 0 < float(jnp.max(jnp.abs(plain - exact))) < 0.5


def test_a_dense_base_quantizes_into_the_tree_the_model_builds():
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=2, alpha=4.0, quantize="int8"))
    _, _, frozen_abs = _abstract(cfg)
    frozen = quantize_base(_plain_state(), frozen_abs, "int8")
    want = jax.tree.map(lambda a: (a.shape, a.dtype), frozen_abs)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), frozen) == want
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(frozen)]
    scales = [n for n in names if "_scale'" in n]
    assert len(scales) == len(WEIGHTS) * BASE.n_layers  # every projection, adapted or not
    # Dequantized, every weight is the dense one within half a step of its channel's scale;
    # what is not a projection (embeddings, norms, biases) is carried over exactly.
    plain_abs = nnx.split(nnx.eval_shape(lambda: Transformer(BASE, rngs=nnx.Rngs(0))))[1]
    dense = dict(jax.tree_util.tree_leaves_with_path(_plain_state()))
    back = dict(jax.tree_util.tree_leaves_with_path(dequantize_base(frozen, plain_abs)))
    held = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(frozen)}
    assert back.keys() == dense.keys()
    for path, w in dense.items():
        name = jax.tree_util.keystr(path)
        scale = held.get(name.replace("'].value", "_scale'].value"))
        if scale is None or not name.endswith("_proj'].value"):
            np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(w))
        else:
            assert np.all(np.abs(back[path] - w) <= np.asarray(scale) / 2 + 1e-6), name


def test_quantize_names_the_types_allowed():
    with pytest.raises(
        ValueError, match=r"Lora.quantize must be one of \(None, 'int8', 'int4'\), got 'nf4'"
    ):
        LoraConfig(rank=2, quantize="nf4")
