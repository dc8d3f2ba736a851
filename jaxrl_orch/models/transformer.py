"""Decoder-only transformer of the Llama / Qwen2 / Qwen3 family, in Flax NNX.

Owns the model's maths: token embedding, pre-norm blocks of grouped-query attention with RoPE
(optional Llama-3 frequency scaling, optional Qwen3 QK-norm, optional Qwen2 q/k/v bias) and a
SwiGLU MLP, a final RMSNorm and a tied or untied LM head. Two entry points share every block:

- ``Transformer.__call__(tokens, positions, segment_ids=None)``: the full causal forward used
  by the trainer. With ``segment_ids`` a token attends only to earlier tokens of its own segment,
  so several sequences can be packed into one row (segment 0 is padding).
- ``Transformer.forward_cached(tokens, positions, cache)``: the engine's prefill / decode step.
  Each token's k/v are written into the cache at index = its position (per row), and a query
  attends to the entries whose index is <= its own position. So a refilled slot never sees the
  previous occupant (every index it can attend was just written by its own sequence), and junk
  written by padding tokens beyond a row's true length is overwritten before anyone attends it.

Driven by the trainer (``__call__`` over packed rows) and the inference engine
(``forward_cached``); both ``nnx.split`` the module and ``jax.jit`` the merged call, passing the
config-free params ``State`` around, so nothing here may hold per-call Python state.

Params carry logical axis names in their ``logical_axes`` metadata (the names of the binding
interface, see ``logical_specs``). The key is deliberately not flax's ``out_sharding``: flax
eagerly shards a variable carrying that key whenever a mesh is set, which would read logical
names as mesh axes. This module never resolves names to a mesh (``sharding/rules.py`` does),
never places arrays on devices and never constrains shardings: XLA propagates them from the
params and inputs. It is written for auto-axis meshes (what ``sharding/mesh.py`` builds);
explicit-axis meshes would need an ``out_sharding`` on the embedding gather.
Numerics: params in ``param_dtype``, matmuls in ``dtype``, RMSNorm, RoPE, softmax and logits in
float32, KV cache in whatever dtype ``init_cache`` was given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_orch.models.attention import attend
from jaxrl_orch.models.configs import (
    BYTE_VOCAB_SIZE,
    CONFIG_NAMES,
    ModelConfig,
    RopeScaling,
    get_config,
)
from jaxrl_orch.models.kv_cache import (
    CACHE_AXES,
    cache_logical_specs,
    init_cache,
)
from jaxrl_orch.models.lora import Adaptable, project
from jaxrl_orch.models.rope import apply_rope as _apply_rope
from jaxrl_orch.models.rope import rope_inv_freq

__all__ = [
    "ACTIVATION_AXES",
    "BYTE_VOCAB_SIZE",
    "CACHE_AXES",
    "CONFIG_NAMES",
    "LOGITS_AXES",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "cache_logical_specs",
    "get_config",
    "init_cache",
    "logical_specs",
    "rope_inv_freq",
]

ACTIVATION_AXES = ("batch", "length", "embed")
LOGITS_AXES = ("batch", "length", "vocab")
# Logit of an id past ``ModelConfig.output_vocab`` (padding rows of the vocab).
MASKED_LOGIT = -1e9

_INIT = jax.nn.initializers.normal(stddev=0.02)  # HF initializer_range for these families
# ModelConfig.remat -> jax.checkpoint policy (None: save nothing, recompute the whole block).
_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, init=_INIT):
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, statistics in float32 (HF Llama/Qwen form)."""

    def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        del rngs
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)


class Attention(Adaptable):
    """Grouped-query attention projections; the attention itself is ``attention.attend``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        h = cfg.n_heads
        kv = cfg.n_kv_heads
        hd = cfg.head_dim
        pd = cfg.param_dtype
        self.cfg = cfg
        self.q_proj = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), pd)
        self.k_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            zeros = jax.nn.initializers.zeros
            self.q_bias = _param(rngs, (h, hd), ("heads", "head_dim"), pd, zeros)
            self.k_bias = _param(rngs, (kv, hd), ("kv_heads", "head_dim"), pd, zeros)
            self.v_bias = _param(rngs, (kv, hd), ("kv_heads", "head_dim"), pd, zeros)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, pd, rngs=rngs)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, pd, rngs=rngs)
        self.add_adapters(cfg.lora, rngs)

    def project(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray):
        """``x[B,T,E]`` -> rotated ``q[B,T,H,D]``, ``k[B,T,Hkv,D]`` and ``v[B,T,Hkv,D]``."""
        cfg = self.cfg
        dt = self.cfg.dtype
        q = project(self, "q_proj", "bte,ehd->bthd", x, cfg)
        k = project(self, "k_proj", "bte,ehd->bthd", x, cfg)
        v = project(self, "v_proj", "bte,ehd->bthd", x, cfg)
        if self.cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if self.cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return _apply_rope(q, positions, inv_freq), _apply_rope(k, positions, inv_freq), v

    def output(self, o: jax.Array) -> jax.Array:
        return project(self, "o_proj", "bthd,hde->bte", o, self.cfg)


class MLP(Adaptable):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        f = cfg.d_ff
        pd = cfg.param_dtype
        self.cfg = cfg
        self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), pd)
        self.add_adapters(cfg.lora, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        gate = jax.nn.silu(project(self, "gate_proj", "bte,ef->btf", x, cfg))
        up = project(self, "up_proj", "bte,ef->btf", x, cfg)
        return project(self, "down_proj", "btf,fe->bte", gate * up, cfg)


class Block(nnx.Module):
    """Pre-norm residual block; split in two halves so the cached path can own the k/v step."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray):
        return self.attn.project(self.input_norm(x), positions, inv_freq)

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        x = x + self.attn.output(attn_out)
        return x + self.mlp(self.post_attn_norm(x))


class Transformer(nnx.Module):
    """The decoder. See the module docstring for the two forward contracts."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        cfg = config
        self.config = cfg
        self.embed = _param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.param_dtype
        )
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype
            )

    @property
    def _inv_freq(self) -> np.ndarray:
        cfg = self.config
        return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.config.dtype)

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """LM head on final-normed ``hidden[..., E]`` -> float32 ``logits[..., V]``.

        With ``hidden_states`` this lets a trainer chunk the vocab projection over the length
        (a 150k vocab makes full ``[B, T, V]`` float32 logits the largest tensor by far).
        """
        dt = self.config.dtype
        if self.config.tie_embeddings:
            w = self.embed[...].astype(dt)
            logits = jnp.einsum("...e,ve->...v", hidden, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head[...].astype(dt)
            logits = jnp.einsum("...e,ev->...v", hidden, w, preferred_element_type=jnp.float32)
        logits = logits.astype(jnp.float32)
        n_out = self.config.output_vocab
        if n_out is not None and n_out < self.config.vocab_size:
            # Finite, not -inf: probabilities are exactly 0 yet p * log p stays 0 (no NaN in
            # entropies), and dividing by a sampling temperature cannot overflow.
            real = jnp.arange(self.config.vocab_size) < n_out
            logits = jnp.where(real, logits, MASKED_LOGIT)
        return logits

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        *,
        splash_specs: Any = None,
    ) -> jax.Array:
        """The full forward up to and including the final norm: ``hidden[B,T,E]`` in ``dtype``.

        Attention follows ``config.attention``; each block is rematerialised per
        ``config.remat``. ``splash_specs``: the ``(q, kv, segment)`` PartitionSpecs the splash
        kernel runs under (the caller resolves them; see ``attention.splash_attention``).
        """
        _check_tokens(tokens, positions)
        cfg = self.config
        b, t = tokens.shape
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(
                f"segment_ids shape {segment_ids.shape} must equal tokens {tokens.shape}"
            )
        q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        inv_freq = self._inv_freq

        def block(layer: Block, x: jax.Array) -> jax.Array:
            q, k, v = layer.qkv(x, positions, inv_freq)
            o = attend(
                q,
                k,
                v,
                q_index=q_index,
                segment_ids=segment_ids,
                self_attention=True,
                impl=cfg.attention,
                block=cfg.attention_block,
                splash_specs=splash_specs,
            )
            return layer.finish(x, o)

        x = self._embed(tokens)
        if cfg.scan_layers:
            # One compiled block for all layers (compile time independent of depth): the
            # layers' params are stacked for the scan, each step one block.
            gdef, stacked = self._stacked_layers()
            body = lambda x, st: (block(nnx.merge(gdef, st), x), None)
            if cfg.remat != "none":
                body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
            return self.final_norm(jax.lax.scan(body, x, stacked)[0])
        for layer in self.layers:
            if cfg.remat == "none":
                x = block(layer, x)
                continue
            gdef, state = nnx.split(layer)
            pure = lambda st, x, gdef=gdef: block(nnx.merge(gdef, st), x)
            x = jax.checkpoint(pure, policy=_REMAT[cfg.remat], prevent_cse=True)(state, x)
        return self.final_norm(x)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """Full causal forward: ``tokens, positions[B,T]`` -> float32 ``logits[B,T,V]``."""
        return self.logits_from_hidden(self.hidden_states(tokens, positions, segment_ids))

    def forward_cached(
        self, tokens: jax.Array, positions: jax.Array, cache: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Prefill or decode ``tokens[B,T]`` against ``cache``; returns ``(logits, new_cache)``.

        ``cache`` comes from ``init_cache`` with the same batch (either layout). Writes land at
        index = position; positions at or beyond the cache length are dropped (never attended).
        """
        _check_tokens(tokens, positions)
        ck = cache["k"]
        cv = cache["v"]
        stacked = not isinstance(ck, (list, tuple))
        n_layers, b = ck.shape[:2] if stacked else (len(ck), ck[0].shape[0])
        if n_layers != self.config.n_layers or b != tokens.shape[0]:
            raise ValueError(
                f"cache [layers={n_layers}, batch={b}] does not match model layers "
                f"{self.config.n_layers} / tokens batch {tokens.shape[0]}"
            )
        rows = jnp.arange(b)[:, None]
        cfg = self.config
        inv_freq = self._inv_freq
        dt = self.config.dtype

        def block(layer: Block, x: jax.Array, ck: jax.Array, cv: jax.Array):
            """One layer against its own cache ``[b, kv, length, d]``."""
            q, k, v = layer.qkv(x, positions, inv_freq)
            # [b, t] index pairs around the heads' slice: the update is k's own [b, t, kv, d]
            ck = ck.at[rows, :, positions].set(k.astype(ck.dtype), mode="drop")
            cv = cv.at[rows, :, positions].set(v.astype(cv.dtype), mode="drop")
            o = attend(
                q,
                ck.astype(dt),
                cv.astype(dt),
                q_index=positions,
                kv_heads_first=True,
                impl=cfg.attention,
                block=cfg.attention_block,
            )
            return layer.finish(x, o), ck, cv

        x = self._embed(tokens)
        if stacked:
            if not cfg.scan_layers:
                raise ValueError(
                    "a stacked [layers, ...] cache is for scan_layers models; init_cache "
                    "builds one array per layer for this config"
                )
            gdef, stacked_params = self._stacked_layers()

            def body(x, xs):
                st, cki, cvi = xs  # one layer's params and cache slice in, its update out
                x, cki, cvi = block(nnx.merge(gdef, st), x, cki, cvi)
                return x, (cki, cvi)

            x, (ck, cv) = jax.lax.scan(body, x, (stacked_params, ck, cv))
        else:
            ck = list(ck)
            cv = list(cv)
            # A per-layer cache runs the layers unrolled (a scan_layers model too: its params
            # are stored per layer), each against its own arrays.
            for i, layer in enumerate(self.layers):
                x, ck[i], cv[i] = block(layer, x, ck[i], cv[i])
        return self.logits_from_hidden(self.final_norm(x)), {"k": ck, "v": cv}

    def _stacked_layers(self) -> tuple[Any, Any]:
        """``(graphdef, params)`` of one block with every layer's params stacked (scan_layers)."""
        states = [nnx.split(layer)[1] for layer in self.layers]
        return nnx.split(self.layers[0])[0], jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def _check_tokens(tokens: jax.Array, positions: jax.Array) -> None:
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(
            f"tokens and positions must both be [batch, length], got {tokens.shape} and "
            f"{positions.shape}"
        )


def logical_specs(state: Any) -> Any:
    """Same-structure tree of logical axis-name tuples for a model or its ``nnx.State``.

    Leaves are ``tuple[str | None, ...]`` (one name per array dim) at the position of each
    variable; consumers mapping over it should treat tuples as leaves.
    """
    if isinstance(state, nnx.Module):
        state = nnx.state(state)

    def spec(var: Any) -> tuple[str | None, ...]:
        if not isinstance(var, nnx.Variable):
            raise TypeError(
                f"logical_specs needs nnx Variables (a Module or nnx.State), got a "
                f"{type(var).__name__} leaf; pure-dict states carry no axis metadata"
            )
        axes = var.get_metadata("logical_axes", None)
        if axes is None:
            raise ValueError(f"variable {type(var).__name__} has no logical_axes metadata")
        return tuple(axes)

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
