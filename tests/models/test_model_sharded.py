"""The decoder under resolved param/cache shardings on the 8-device CPU mesh gives the same
logits as on one device (trainer fsdp x tp mesh, decode tp mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_orch.models.transformer import (
    ModelConfig,
    Transformer,
    cache_logical_specs,
    init_cache,
    logical_specs,
)
from sharding.mesh import make_meshes
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings

# Auto-axis meshes from the project's own builder (the model is written for those, not for
# explicit-axis meshes, which would need an out_sharding on every ambiguous gather/einsum).
DECODE_MESH, TRAINER_MESH = make_meshes({"tp": 8}, {"fsdp": 4, "tp": 2}, colocated=True)

# Sizes chosen so tp=2 divides heads, kv heads, mlp and vocab, and fsdp=4 divides embed.
CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    qk_norm=True,
    tie_embeddings=False,
    max_seq_len=64,
)


def _setup(mesh, rules):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0))))
    shardings = resolve_shardings(logical_specs(abstract), mesh, rules, shapes=abstract)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda x: (0.3 * rng.normal(size=x.shape)).astype(np.float32), abstract)
    return mesh, graphdef, jax.device_put(host, shardings)


def test_trainer_mesh_forward_matches_single_device():
    mesh, graphdef, params = _setup(TRAINER_MESH, TRAINER_RULES)
    q = params["layers"][0]["attn"]["q_proj"]
    assert q.sharding.spec == PartitionSpec("fsdp", "tp", None)  # the rules really applied
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 16)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape)
    fwd = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p))
    with jax.set_mesh(mesh):
        batch = NamedSharding(mesh, PartitionSpec("fsdp"))
        sharded = fwd(params, jax.device_put(tokens, batch), jax.device_put(positions, batch))
    local = jax.device_put(params, jax.devices()[0])
    single = fwd(local, jnp.asarray(tokens), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)


def test_decode_mesh_cached_step_matches_single_device():
    mesh, graphdef, params = _setup(DECODE_MESH, DECODE_RULES)
    cache_shape = jax.eval_shape(lambda: init_cache(CFG, 2, 16))
    cache_shardings = resolve_shardings(
        cache_logical_specs(CFG), mesh, DECODE_RULES, shapes=cache_shape
    )
    step = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s).forward_cached(t, p, c))
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 5)).astype(np.int32)
    positions = np.broadcast_to(np.arange(5, dtype=np.int32), tokens.shape)
    with jax.set_mesh(mesh):
        cache = jax.device_put(init_cache(CFG, 2, 16), cache_shardings)
        sharded, new_cache = step(params, tokens, positions, cache)
    local = jax.device_put(params, jax.devices()[0])
    single, _ = step(local, jnp.asarray(tokens), jnp.asarray(positions), init_cache(CFG, 2, 16))
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)
    # One array per layer: [batch, kv heads, length, dim]
    assert [k.shape for k in new_cache["k"]] == [(2, 2, 16, 8)] * CFG.n_layers
