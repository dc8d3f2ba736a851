"""LoraSource: a LoRA run's replica takes the frozen base once and each version's adapters.

What it owns: the replica's copy of the frozen base (in its decode shardings and weight dtype,
pulled once: ``load_base``) and the merge of each version's adapters into it (``load_adapters``:
float32 adapters, pulled replicated over the decode mesh, folded in as ``W + scale * A @ B``
in float32 and cast to the weight dtype, landing in the decode shardings). The decode step is
then the full-weight engine's, unchanged: the same choice as the in-process engine's
(``compose.staging``, measured in ``benchmarks/lora_serving.py``).

Why the replica merges: an 8B model's bf16 weights are 16 GB, its rank-16 adapters 168 MB; the
base crosses the network once per replica (at its first load, or when it comes back after a
restart) and only the adapters every version.

The adapters' tree (``adapters``: abstract arrays) is the trainer's, built from the same config
on both sides (``compose.staging.abstract_adapters``); ``merge_adapters`` matches them to the
base's weights by name and refuses a tree that does not fit it.

Errors: ``load_adapters`` before any ``load_base`` is an ``UpdateRefused`` (HTTP 400) naming the
order; a failed pull leaves the base and the served weights as they were.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_orch.distributed.source import TransferSource
from jaxrl_orch.inference.engine_api import ReplicaEngine
from jaxrl_orch.models.lora import merge_adapters
from jaxrl_orch.serving.host import UpdateRefused


class LoraSource(TransferSource):
    """See the module docstring. ``scale``: the adapters' ``alpha / rank``."""

    def __init__(
        self, engine: ReplicaEngine, address: str, adapters: Any, scale: float, **how: Any
    ) -> None:
        super().__init__(engine, address, **how)  # transport, api_key, host: TransferSource's
        # Adapters are small: replicated, so each device merges its own shard of every weight.
        everywhere = NamedSharding(engine.mesh, PartitionSpec())
        self._adapter_shardings = jax.tree.map(lambda _: everywhere, adapters)
        self._adapter_targets = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=everywhere), adapters
        )
        self._merge = jax.jit(
            lambda base, a: merge_adapters(base, a, scale), out_shardings=engine.param_shardings
        )
        self.base: Any = None

    def load_base(self, uuid: int, layout: Any, timeout_s: float) -> None:
        """Keep offer ``uuid`` (the frozen base, laid out like whole weights) for the merges."""
        self.base = self(uuid, layout, timeout_s)

    def load_adapters(self, uuid: int, layout: Any, timeout_s: float) -> Any:
        """The weights to serve: offer ``uuid``'s adapters merged into the base held."""
        if self.base is None:
            raise UpdateRefused(
                "part 'adapters' before any part 'base': this replica holds no LoRA base yet"
            )
        adapters = self.fetch(
            uuid, layout, timeout_s, self._adapter_targets, self._adapter_shardings
        )
        return jax.block_until_ready(self._merge(self.base, adapters))
