"""The run's precision and kernels, resolved for a backend.

What it owns: turning the ``Model`` section (``compute_dtype``, ``param_dtype``, ``attention``,
``remat``, ``scan_layers``, with their ``"auto"`` values) and the ``Engine`` section's dtypes
into what the parts are built with: the ``ModelConfig`` the trainer and the engine share
(``accel_model_config``) and the engine's dtypes (``engine_model_config``).

``"auto"`` (the defaults) resolve by backend: on TPU and GPU bfloat16 compute (and engine
params), splash attention on TPU and XLA's on GPU; on CPU float32 and ``"chunked"`` attention in
blocks of ``CPU_ATTENTION_BLOCK``: tiles that skip what no query sees (causally and by segment,
``models/tiled_attention.py``) in the trainer, the length-aware cache read in the engine. Same
function as the einsum reference up to float rounding, and on CPU several times faster than it
for long rows (``benchmarks/train_step.py``, ``benchmarks/engine_throughput.py``; the figures
are in docs/benchmarks.md). Master weights, Adam moments, log-probs, the loss and the ratios
stay float32 unless ``Model.param_dtype`` says ``bfloat16`` (log-probs and the loss are float32
always).

Pure functions of the config; nothing here touches devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.configs import ModelConfig

BACKENDS = ("cpu", "gpu", "tpu")


def _backend(backend: str | None) -> str:
    backend = backend or jax.default_backend()
    backend = "gpu" if backend in ("cuda", "rocm") else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def compute_dtype(cfg: TrainConfig, backend: str | None = None) -> jnp.dtype:
    if cfg.model.compute_dtype != "auto":
        return jnp.dtype(cfg.model.compute_dtype)
    return jnp.dtype(jnp.float32 if _backend(backend) == "cpu" else jnp.bfloat16)


# CPU blocks: 128 measured fastest for rows of 512-2048 with the query blocks (64: too many
# unrolled blocks; 256 / 512: bigger score tensors than the caches hold) and about even with the
# tiles (8 x 512 / 2 x 2048 steps: 64 0.70 / 1.03 s, 128 0.68 / 0.97, 256 0.87 / 0.89).
CPU_ATTENTION_BLOCK = 128


def attention_impl(cfg: TrainConfig, backend: str | None = None) -> str:
    if cfg.model.attention != "auto":
        return cfg.model.attention
    return {"tpu": "splash", "gpu": "xla", "cpu": "chunked"}[_backend(backend)]


def attention_block(cfg: TrainConfig, model_cfg: ModelConfig, backend: str | None = None) -> int:
    if cfg.model.attention == "auto" and _backend(backend) == "cpu":
        return CPU_ATTENTION_BLOCK
    return model_cfg.attention_block


def accel_model_config(
    model_cfg: ModelConfig, cfg: TrainConfig, backend: str | None = None
) -> ModelConfig:
    """``model_cfg`` with the config's compute / master dtypes, attention and remat."""
    dtype = compute_dtype(cfg, backend)
    return dataclasses.replace(
        model_cfg,
        dtype=dtype,
        param_dtype=jnp.dtype(cfg.model.param_dtype),
        attention=attention_impl(cfg, backend),
        attention_block=attention_block(cfg, model_cfg, backend),
        remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
        # Read by low-precision matmuls only (models/matmul.py): XLA:CPU's bf16 dot layout.
        grad_transpose_copy=_backend(backend) == "cpu" and dtype != jnp.float32,
    )


def engine_compute_dtype(cfg: TrainConfig, backend: str | None = None) -> jnp.dtype:
    if cfg.engine.compute_dtype is not None:
        return jnp.dtype(cfg.engine.compute_dtype)
    return compute_dtype(cfg, backend)


def engine_param_dtype(cfg: TrainConfig, backend: str | None = None) -> jnp.dtype:
    if cfg.engine.param_dtype is not None:
        return jnp.dtype(cfg.engine.param_dtype)
    return engine_compute_dtype(cfg, backend)


def engine_model_config(
    model_cfg: ModelConfig, cfg: TrainConfig, backend: str | None = None
) -> ModelConfig:
    """The run's model config (``accel_model_config``) as the engine runs it: its matmuls in
    ``Engine.compute_dtype``, its weights in ``Engine.param_dtype``. Two settings, because the
    fast pair depends on the chip: on a 2-core Sapphire Rapids CPU (AMX) a bf16 train step is
    ~1.5x faster than float32 and a bf16 decode step ~1.6x slower (docs/benchmarks.md), so
    ``Model.compute_dtype=bfloat16, Engine.compute_dtype=float32`` is the fast pair there."""
    return dataclasses.replace(
        model_cfg,
        dtype=engine_compute_dtype(cfg, backend),
        param_dtype=engine_param_dtype(cfg, backend),
    )
