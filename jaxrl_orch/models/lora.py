"""LoRA adapters on the model's weight projections: the trainable part of a LoRA run.

A target projection ``W`` (its contracted axes lead: ``q/k/v [E, H, D]``, ``o [H, D, E]``,
``gate/up [E, F]``, ``down [F, E]``) gets two ``nnx.LoRAParam`` variables beside it on its
module, ``<name>_lora_a`` (``W``'s contracted axes + ``rank``) and ``<name>_lora_b`` (``rank`` +
``W``'s output axes), and the projection becomes ``x @ W + (alpha / rank) * (x @ A) @ B``.
``B`` starts at zero, so a fresh adapter leaves the model's outputs bit-identical; ``A`` starts
uniform in ``+-1/sqrt(fan_in)`` (PEFT's default for ``lora_A``). Adapters are float32 masters
whatever the base's ``param_dtype`` (bf16 for a frozen 8B base); their matmuls run in the
model's compute dtype through ``models.matmul`` like every other weight.

Why not qwix's ``apply_lora_to_model``: it finds a projection by intercepting
``jax.lax.dot_general`` / ``jnp.einsum`` calls on a module attribute. This model's weight matmul
runs inside a ``custom_vjp`` (``models.matmul``: the bf16 backward), and ``scan_layers`` calls
the blocks on stacked, merged copies of their params, so qwix would see neither the weight nor
the module; the adapters here are the same maths (and qwix's names: ``<weight>_lora_a/_b``,
``nnx.LoRAParam``), written against this model's projections (docs/design.md section 11).

No dropout: the RL loss takes the ratio of the trainer's log-probs to the engine's, and a
dropped-out adapter would make that ratio noisy even on-policy.

``merge_adapters`` folds adapters into the base (the engine serves merged weights);
``peft_tensors`` lays them out as a PEFT adapter of the HF checkpoint ``models.hf_import``
writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_orch.models.keys import by_names, key_names
from jaxrl_orch.models.lora_config import TARGETS, LoraConfig
from jaxrl_orch.models.matmul import matmul
from jaxrl_orch.models.qlora import quantized, weight

_BY_WEIGHT = {path[1]: (name, contract) for name, (path, contract, _) in TARGETS.items()}
RANK_AXIS = "lora_rank"  # no sharding rule names it: replicated


class Adaptable(nnx.Module):
    """A module whose weight projections a LoRA run adapts (the attention and MLP blocks): it
    adds its own adapters while it is built, so nothing patches it afterwards."""

    def add_adapters(self, cfg: LoraConfig | None, rngs: nnx.Rngs) -> None:
        """Give this module's target projections their adapters, and quantize its base weights
        for QLoRA (a no-op without ``cfg``)."""
        if cfg is None:
            return
        variables = {**_adapters(self, cfg, rngs), **quantized(self, cfg.quantize)}
        for name, variable in variables.items():
            setattr(self, name, variable)


def _adapters(module: nnx.Module, cfg: LoraConfig, rngs: nnx.Rngs) -> dict[str, nnx.LoRAParam]:
    """The adapters of ``module``'s target projections, by attribute name."""
    out: dict[str, nnx.LoRAParam] = {}
    for weight_name, (target, contract) in _BY_WEIGHT.items():
        if target not in cfg.targets or not hasattr(module, weight_name):
            continue
        w = getattr(module, weight_name)
        axes = tuple(w.get_metadata("logical_axes"))
        fan_in = math.prod(w.shape[:contract])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(
            rngs.params(), (*w.shape[:contract], cfg.rank), jnp.float32, -bound, bound
        )
        b = jnp.zeros((cfg.rank, *w.shape[contract:]), jnp.float32)
        a_axes = (*axes[:contract], RANK_AXIS)
        b_axes = (RANK_AXIS, *axes[contract:])
        out[f"{weight_name}_lora_a"] = nnx.LoRAParam(a, logical_axes=a_axes)
        out[f"{weight_name}_lora_b"] = nnx.LoRAParam(b, logical_axes=b_axes)
    return out


def project(module: nnx.Module, name: str, spec: str, x: jax.Array, cfg: Any) -> jax.Array:
    """``einsum(spec, x, W)`` of ``module.<name>`` in ``cfg.dtype``, plus its adapter if any.

    ``spec`` is the projection's ``"<x axes>,<W axes>-><out axes>"``; the adapter path is
    ``x -> [.., rank] -> out`` (two thin matmuls), never the merged ``[in, out]`` delta."""
    dt = cfg.dtype
    tc = cfg.grad_transpose_copy
    y = matmul(spec, x, weight(module, name), dt, tc)
    a = getattr(module, f"{name}_lora_a", None) if cfg.lora is not None else None
    if a is None:
        return y
    ins, out = spec.split("->")
    x_axes, w_axes = ins.split(",")
    contract = w_axes[: _BY_WEIGHT[name][1]]
    rest = "".join(c for c in x_axes if c not in contract)
    t = matmul(f"{x_axes},{contract}r->{rest}r", x, a[...], dt, tc)
    b = getattr(module, f"{name}_lora_b")[...]
    d = matmul(f"{rest}r,r{w_axes[len(contract) :]}->{out}", t, b, dt, tc)
    return y + (d * cfg.lora.scale).astype(dt)


def delta(a: jax.Array, b: jax.Array, shape: Sequence[int]) -> jax.Array:
    """``A @ B`` as a float32 array of the weight's ``shape`` (the unscaled update)."""
    r = a.shape[-1]
    return (a.reshape(-1, r).astype(jnp.float32) @ b.reshape(r, -1).astype(jnp.float32)).reshape(
        shape
    )


def _adapter_of(names: tuple[Any, ...], suffix: str) -> tuple[Any, ...]:
    """The names of the adapter ``suffix`` of the weight named ``names`` (its last key)."""
    *head, last = names
    return (*head, f"{last}{suffix}")


def merge_adapters(base: Any, adapters: Any, scale: float) -> Any:
    """``base`` with every adapted weight replaced by ``W + scale * A @ B`` (in ``W``'s dtype,
    summed in float32). ``base`` is the base model's state (or pure dict), ``adapters`` the
    ``nnx.LoRAParam`` state of the same model: the two are matched by their key names."""
    found = by_names(adapters)
    used = 0

    def merge(path: tuple[Any, ...], w: jax.Array) -> jax.Array:
        nonlocal used
        names = key_names(path)
        a = found.get(_adapter_of(names, "_lora_a"))
        if a is None:
            return w
        used += 1
        d = delta(a, found[_adapter_of(names, "_lora_b")], w.shape)
        return (w.astype(jnp.float32) + scale * d).astype(w.dtype)

    merged = jax.tree_util.tree_map_with_path(merge, base)
    if 2 * used != len(found):
        raise ValueError(
            f"adapters do not match the base: {len(found)} adapter arrays, {used} adapted "
            "weights found"
        )
    return merged


def peft_tensors(adapters: dict[str, Any], n_layers: int, cfg: LoraConfig) -> dict[str, np.ndarray]:
    """A PEFT adapter's tensors (``lora_A.weight [r, in]``, ``lora_B.weight [out, r]``, HF
    names under ``base_model.model.``) from pure-dict adapters (``nnx.to_pure_dict``)."""
    out: dict[str, np.ndarray] = {}
    for i in range(n_layers):
        layer = adapters["layers"][i]
        for target in cfg.targets:
            (module, weight), _, hf_name = TARGETS[target]
            a = np.asarray(layer[module][f"{weight}_lora_a"], np.float32)
            b = np.asarray(layer[module][f"{weight}_lora_b"], np.float32)
            r = a.shape[-1]
            prefix = f"base_model.model.model.layers.{i}.{hf_name}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return out


def peft_config(cfg: LoraConfig, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of ``peft_tensors``: plain LoRA, no dropout, no bias."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(TARGETS[t][2].split(".")[-1] for t in cfg.targets),
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
    }
