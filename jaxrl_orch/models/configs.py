"""Model shapes: the ``ModelConfig`` record and the named presets.

Owns the single description of a decoder's shape and numerics that every other part of the
stack reads (the trainer to build and shard the model, the engine to size its KV cache, the HF
importer to check a checkpoint against). A config is frozen and hashable so it can be a static
argument of a jitted function.

Presets:
- ``tiny-byte`` / ``small-byte``: byte-level models whose vocab equals ``ByteTokenizer``'s
  (``BYTE_VOCAB_SIZE``); ~1M / ~3M params, sized to run on 2 CPU cores.
- ``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``qwen2.5-3b``, ``qwen3-0.6b``, ``llama-3.2-1b``,
  ``llama-3.1-8b``, ``qwen2.5-7b``, ``qwen3-8b``: the published shapes of those checkpoints
  (from their ``config.json``), so ``hf_import.load_hf_checkpoint`` of the real weights agrees
  with ``get_config`` of the same name. ``PUBLISHED`` names these: a run starts one from its
  checkpoint, or at random only when asked to.

Invariants checked on construction: positive sizes, ``n_heads`` divisible by ``n_kv_heads``
(grouped-query attention), even ``head_dim`` (RoPE rotates pairs). This module never touches
arrays or devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxrl_orch.models.lora_config import LoraConfig

# Must equal ByteTokenizer().vocab_size: 256 bytes + specials, padded to 512 so that new special
# tokens (e.g. tool-call tags) can be added without changing checkpoint shapes.
BYTE_VOCAB_SIZE = 512
# Kept here (not imported from attention.py / transformer.py) so configs stay array-free.
ATTENTION_IMPLS = ("einsum", "xla", "chunked", "splash")
# "none": keep every activation; "full": keep only block inputs (recompute the block);
# "dots": keep matmul outputs; "dots_no_batch": keep matmul outputs without batch dims
# (weights-shaped), i.e. recompute the activations' matmuls too.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (HF ``rope_type: "llama3"``).

    Long wavelengths (> original_max_position / low_freq_factor) are slowed by ``factor``,
    short ones (< original_max_position / high_freq_factor) are kept, and the band in between
    is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position <= 0:
            raise ValueError(f"RopeScaling needs factor > 0 and original_max_position > 0: {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling needs high_freq_factor > low_freq_factor, got {self.high_freq_factor}"
                f" <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama / Qwen2 / Qwen3 family decoder."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    dtype: Any = jnp.float32  # activation / compute dtype
    param_dtype: Any = jnp.float32
    qkv_bias: bool = False  # Qwen2: bias on the q, k and v projections
    rope_scaling: RopeScaling | None = None
    # Ids >= output_vocab are padding rows of the vocab (shapes rounded up past what the
    # tokenizer can produce): their logits are masked, so they are never sampled and hold no
    # probability mass in any log-prob, engine or trainer. None: every id is a real output.
    output_vocab: int | None = None
    # The dtype an imported HF checkpoint stores its tensors in (its torch_dtype), which export
    # writes back; None: export in param_dtype. Params live in param_dtype whatever it is.
    checkpoint_dtype: str | None = None
    # Memory / kernels (models/attention.py, transformer.Block remat). "einsum" and "none" are
    # the reference path; TPU configs pick "splash" and a remat policy.
    attention: str = "einsum"  # one of attention.IMPLS
    attention_block: int = 512  # tile / query block of "chunked", block of "splash"
    remat: str = "none"  # one of REMAT_POLICIES: what a block keeps for its backward pass
    # The trainer's forward as a lax.scan over stacked layers: compile time independent of
    # depth (28 unrolled layers take minutes to compile for TPU on 2 cores); same maths.
    scan_layers: bool = False
    # Low-precision weight gradients copy one operand contracted-axes-last (models/matmul.py):
    # XLA:CPU's fast bf16 dot needs that layout; compose/precision.py sets it on CPU only.
    grad_transpose_copy: bool = False
    # LoRA adapters on the projections (models/lora.py): the trainer's model trains only them,
    # over a frozen base in param_dtype; None: every weight is the model's own.
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and self.lora.rank < 1:
            raise ValueError(
                f"ModelConfig.lora has rank {self.lora.rank}: a model with adapters needs rank "
                ">= 1 (rank 0 is a run without them: lora None)"
            )
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(
                f"ModelConfig.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"ModelConfig.remat must be one of {REMAT_POLICIES}, got {self.remat!r}"
            )
        if not isinstance(self.attention_block, int) or self.attention_block < 8:
            raise ValueError(
                f"ModelConfig.attention_block must be an int >= 8, got {self.attention_block!r}"
            )
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.d_ff <= 0 or self.max_seq_len <= 0:
            raise ValueError(
                f"d_ff and max_seq_len must be > 0, got {self.d_ff}, {self.max_seq_len}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"rope_theta and norm_eps must be > 0: {self.rope_theta}, {self.norm_eps}"
            )
        if self.output_vocab is not None and not 1 <= self.output_vocab <= self.vocab_size:
            raise ValueError(
                f"output_vocab must be in [1, vocab_size={self.vocab_size}] or None, "
                f"got {self.output_vocab!r}"
            )
        # Normalise so that configs built with jnp.float32 vs "float32" compare and hash equal.
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))

    @property
    def num_params(self) -> int:
        """Parameter count implied by the shape (no array is built)."""
        d = self.d_model
        h = self.n_heads
        kv = self.n_kv_heads
        hd = self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        if self.qkv_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * d * self.d_ff + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * layer + d + head


_PRESETS: dict[str, ModelConfig] = {
    "tiny-byte": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        d_ff=512,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=2048,
    ),
    "small-byte": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        d_ff=768,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=2048,
    ),
    # Shapes below are the published config.json values of the Hugging Face checkpoints.
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        d_ff=4864,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=32768,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        tie_embeddings=True,
        max_seq_len=40960,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936,
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        head_dim=128,
        d_ff=8960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=32768,
    ),
    "qwen2.5-3b": ModelConfig(
        vocab_size=151936,
        d_model=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=2,
        head_dim=128,
        d_ff=11008,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=32768,
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=131072,
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
        ),
    ),
    # The 7-8B class (LoRA's main users: one or two TPU hosts), untied embeddings.
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        max_seq_len=131072,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
        ),
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        head_dim=128,
        d_ff=18944,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=False,
        max_seq_len=32768,
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        tie_embeddings=False,
        max_seq_len=40960,
    ),
}

CONFIG_NAMES: tuple[str, ...] = tuple(_PRESETS)
# The presets that stand for a published model: their point is that model's weights, so a run
# of one without its checkpoint (a random initialisation) must be asked for (``Model.random_init``).
# The byte presets have no published weights: random is what they are.
PUBLISHED: frozenset[str] = frozenset(CONFIG_NAMES) - {"tiny-byte", "small-byte"}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, optionally with fields replaced (e.g. ``dtype=jnp.bfloat16``)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model config {name!r}; known names: {', '.join(CONFIG_NAMES)}")
    config = _PRESETS[name]
    if overrides:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"unknown ModelConfig fields {bad}; allowed: {sorted(fields)}")
        config = dataclasses.replace(config, **overrides)
    return config
