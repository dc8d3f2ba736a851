"""A LoRA run's engine weights: the base placed on the engine once, the adapters each version.

Decided by measurement (``benchmarks/lora_serving.py``, DESIGN.md section 11): the engine serves
*merged* weights. Each version's adapters (float32, a few MB) move to the engine's devices and
are folded into the engine's own copy of the frozen base there (``W + alpha / rank * A @ B`` in
float32, cast to the engine's weight dtype), so the decode step is the full-weight engine's,
unchanged. The cost is memory: the engine holds the base beside the merged weights it serves.

``move`` is the weight path's hop (trainer thread): what it returns is what the engine swaps
in; ``bytes_moved`` is what crossed from the trainer's devices for that version.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_orch.build.engines import to_engine
from jaxrl_orch.models.lora import merge_adapters


def tree_nbytes(tree: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class AdapterMerge:
    """See the module docstring. ``frozen``: the trainer's base; ``scale``: ``alpha / rank``."""

    def __init__(self, engine: Any, frozen: Any, scale: float) -> None:
        self.base = to_engine(frozen, engine)  # once: it never changes
        mesh = jax.tree.leaves(engine.param_shardings)[0].mesh
        # Adapters are small: replicated on the engine mesh, each device merges its own shard.
        self._on_engine = NamedSharding(mesh, PartitionSpec())
        self._merge = jax.jit(
            lambda base, adapters: merge_adapters(base, adapters, scale),
            out_shardings=engine.param_shardings,
        )
        self.bytes_moved = 0

    def move(self, adapters: Any) -> Any:
        moved = jax.device_put(adapters, self._on_engine)
        self.bytes_moved = tree_nbytes(adapters)
        return jax.block_until_ready(self._merge(self.base, moved))
