"""A trainer's first params, and what a LoRA run's frozen base is known by.

``initial_params`` returns ``(params, frozen)``: what the step trains and the frozen base.
Without LoRA, ``params`` is every weight (``init_params``: the warm-up's arrays, moved onto the
shardings, or an ``HFCheckpoint`` read straight onto them, each device its own shard; or fresh
ones from ``seed`` by a jitted init whose outputs land sharded) and ``frozen`` is None. With
LoRA, ``init_params`` (or a fresh model) is the base, placed the same way on the frozen
shardings (QLoRA: quantized there, ``models.qlora``), and ``params`` are
fresh adapters from ``seed`` (``B = 0``: the run starts exactly at the base); the jitted init
returns only them, so no random base is built beside a given one. ``BaseWeights`` gives the
base back dense, alone or merged with adapters.

``Restoring()`` as ``init_params``: every weight comes from the checkpoint restore that follows
(a resumed full fine-tune), so nothing is drawn or placed: ``params`` are abstract arrays on
their shardings until ``Trainer.load_state``, and a resume holds one copy of the weights at its
peak, not two. A LoRA trainer's base is not in its checkpoints, so it cannot be restored so.

``fingerprint(frozen)`` names a base by its content (one float32 sum per array, hashed): a
checkpoint of adapters records it, and a resume onto another base is refused (adapters are
only meaningful on the weights they were trained over).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl_orch.models.hf_sharded import HFCheckpoint
from jaxrl_orch.models.lora import merge_adapters
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.qlora import dequantize_base, quantize_base
from jaxrl_orch.models.transformer import ModelConfig, Transformer
from jaxrl_orch.trainer.programs import TrainPrograms
from sharding.rules import abstract_arrays


class Restoring:
    """``init_params`` of a trainer a checkpoint restore fills (see the module docstring)."""

    def __repr__(self) -> str:
        return "Restoring()"


def initial_params(
    programs: TrainPrograms, model_config: ModelConfig, mesh: Mesh, seed: int, init_params: Any
) -> tuple[Any, Any]:
    """``(params, frozen)`` on their shardings (see the module docstring)."""
    build = lambda: Transformer(model_config, rngs=nnx.Rngs(seed))
    if isinstance(init_params, Restoring):
        if model_config.lora is not None:
            raise ValueError(
                "a LoRA trainer cannot be built from its restore alone (Restoring()): its "
                "checkpoints hold the adapters, not the frozen base; give the base"
            )
        return abstract_arrays(programs.abstract_params, programs.param_shardings), None
    if model_config.lora is None:
        if init_params is not None:
            return _place(init_params, programs.abstract_params, programs.param_shardings), None
        with jax.set_mesh(mesh):
            fresh = jax.jit(lambda: nnx.split(build())[1], out_shardings=programs.param_shardings)
            return fresh(), None

    def adapters_and_base() -> tuple[Any, Any]:
        _, adapters, base = nnx.split(build(), nnx.LoRAParam, ...)
        return adapters, base

    shardings = (programs.param_shardings, programs.frozen_shardings)
    with jax.set_mesh(mesh):
        if init_params is None:
            return jax.jit(adapters_and_base, out_shardings=shardings)()
        adapters = jax.jit(lambda: adapters_and_base()[0], out_shardings=shardings[0])()
    base = _place(init_params, programs.abstract_base, programs.base_shardings)
    qtype = model_config.lora.quantize
    if qtype is not None:  # QLoRA: held quantized from here on
        quantized = lambda b: quantize_base(b, programs.abstract_frozen, qtype)
        base = jax.jit(quantized, out_shardings=programs.frozen_shardings)(base)
    return adapters, base


class BaseWeights:
    """A LoRA trainer's frozen base as dense weights (``dense``: QLoRA's dequantized; the
    weights the engine holds and the export writes) and merged with adapters (``merged``)."""

    def __init__(self, programs: TrainPrograms, lora: LoraConfig) -> None:
        target = programs.abstract_base
        shardings = programs.base_shardings
        dense = lambda f: f if lora.quantize is None else dequantize_base(f, target)
        # Unquantized, the base is already dense: no copy of it (an 8B base is 16 GB).
        self.dense = dense if lora.quantize is None else jax.jit(dense, out_shardings=shardings)
        merge = lambda f, a: merge_adapters(dense(f), a, lora.scale)
        self.merged = jax.jit(merge, out_shardings=shardings)


def fingerprint(frozen: Any) -> str:
    """A short content hash of a base: its arrays' paths, shapes, dtypes and float32 sums."""
    leaves = jax.tree_util.tree_leaves_with_path(frozen)
    sums = jax.device_get(
        jax.jit(lambda xs: [jnp.sum(x.astype(jnp.float32)) for x in xs])([x for _, x in leaves])
    )
    h = hashlib.sha256()
    for (path, x), total in zip(leaves, sums, strict=True):
        h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}:".encode())
        h.update(np.float32(total).tobytes())
    return h.hexdigest()[:16]


def _place(init_params: Any, abstract: Any, shardings: Any) -> Any:
    """``init_params`` on ``shardings``: a checkpoint handle is read there shard by shard (its
    own checks name a tensor that does not fit), arrays are moved there."""
    if isinstance(init_params, HFCheckpoint):
        return init_params.load(abstract, shardings)
    _check_same_shapes(init_params, abstract)
    return jax.device_put(init_params, shardings)


def _check_same_shapes(params: Any, abstract: Any) -> None:
    """``init_params`` must match the model built from ``model_config`` leaf for leaf."""
    got = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
    if got.keys() != want.keys():
        extra = sorted(got.keys() - want.keys())
        missing = sorted(want.keys() - got.keys())
        raise ValueError(
            f"init_params do not match the model config: missing {missing[:3]}, "
            f"unexpected {extra[:3]}"
        )
    for k, w in want.items():
        if tuple(np.shape(got[k])) != tuple(w.shape):
            raise ValueError(
                f"init_params{k} has shape {tuple(np.shape(got[k]))}, the model config "
                f"needs {tuple(w.shape)}"
            )
