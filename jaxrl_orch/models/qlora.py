"""QLoRA: a LoRA run's frozen base held quantized (int8 or int4), through ``qwix``.

Each projection weight ``W`` (q, k, v, o, gate, up, down, whether or not it has an adapter) is
stored as ``qwix.quantize``'s ``QArray`` split over two frozen ``nnx.Param``: ``<name>`` holds
the quantized values (``W``'s shape and logical axes, dtype int8 or int4) and ``<name>_scale``
one scale per output channel (absmax, size 1 on the contracted axes, so those axes are
replicated however ``W`` is sharded). The projection uses ``qwix.dequantize`` of the pair, in the
scale's dtype (the base's ``param_dtype``), right before its matmul, so a dense weight exists
only while its layer runs (compiled for the 8B config, the train step's temporaries are smaller
than over a bf16 base: ``docs/lora.md``).

Why this and not ``qwix.quantize_model``: qwix's providers find a weight by intercepting the dot
on a module attribute, the mechanism its LoRA uses, which failed on this model's custom-VJP
matmul and scanned layers (``benchmarks/qwix_lora_probe.py``); the quantization itself
(calibration, scales, int4, dequantize) is qwix's.

What a base is elsewhere: the engine, the merge, the export and the PEFT base take the *dense*
base, ``dequantize_base`` of the quantized one (the weights the adapters were trained over, so
trainer and engine score the same policy). ``quantize_base`` turns a dense base (a warm-up's or
an imported checkpoint's) into the quantized tree the trainer's model expects.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from jaxrl_orch.models.keys import by_names, key_names

QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
# Weight name -> how many leading axes its matmul contracts (models/lora.py's TARGETS).
WEIGHTS = {
    "q_proj": 1,
    "k_proj": 1,
    "v_proj": 1,
    "o_proj": 2,
    "gate_proj": 1,
    "up_proj": 1,
    "down_proj": 1,
}
SCALE = "_scale"


def quantize(w: jax.Array, name: str, qtype: str) -> tuple[jax.Array, jax.Array]:
    """``(values, scale)`` of projection weight ``name``: per output channel, absmax."""
    outputs = tuple(range(WEIGHTS[name], w.ndim))
    q = qwix.quantize(w, QTYPES[qtype], channelwise_axes=outputs)
    return q.qvalue, q.scale


def dequantize(values: jax.Array, scale: jax.Array) -> jax.Array:
    """The dense weight of a ``quantize`` pair, in the scale's dtype."""
    return qwix.dequantize(qwix.QArray(qvalue=values, scale=scale, qtype=values.dtype))


def quantized(module: nnx.Module, qtype: str | None) -> dict[str, nnx.Param]:
    """The quantized pairs that replace ``module``'s projection weights, by attribute name
    (none for None)."""
    out: dict[str, nnx.Param] = {}
    if qtype is None:
        return out
    for name in WEIGHTS:
        if not hasattr(module, name):
            continue
        param = getattr(module, name)
        axes = tuple(param.get_metadata("logical_axes"))
        values, scale = quantize(param[...], name, qtype)
        out[name] = nnx.Param(values, logical_axes=axes)
        out[f"{name}{SCALE}"] = nnx.Param(scale, logical_axes=axes)
    return out


def weight(module: nnx.Module, name: str) -> jax.Array:
    """``module.<name>`` as a dense array: dequantized when the base is quantized."""
    w = getattr(module, name)[...]
    scale = getattr(module, f"{name}{SCALE}", None)
    return w if scale is None else dequantize(w, scale[...])


def quantize_base(base: Any, target: Any, qtype: str) -> Any:
    """``base`` (dense, the plain model's state) as ``target``'s tree (the quantized model's
    frozen state: abstract arrays), matched by key names."""
    dense = by_names(base)

    def fill(path: tuple[Any, ...], _: Any) -> jax.Array:
        *head, last = key_names(path)
        if isinstance(last, str) and last.endswith(SCALE):
            name = last[: -len(SCALE)]
            return quantize(dense[(*head, name)], name, qtype)[1]
        if last in WEIGHTS:
            return quantize(dense[(*head, last)], last, qtype)[0]
        return dense[(*head, last)]

    return jax.tree_util.tree_map_with_path(fill, target)


def dequantize_base(frozen: Any, target: Any) -> Any:
    """``frozen`` (quantized) as ``target``'s tree (the plain model's state), dense."""
    held = by_names(frozen)

    def fill(path: tuple[Any, ...], _: Any) -> jax.Array:
        names = key_names(path)
        scale = held.get((*names[:-1], f"{names[-1]}{SCALE}"))
        return held[names] if scale is None else dequantize(held[names], scale)

    return jax.tree_util.tree_map_with_path(fill, target)
