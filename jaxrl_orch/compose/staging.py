"""A LoRA run's engine weights: the base placed on the engine once, the adapters each version.

Decided by measurement (``benchmarks/lora_serving.py``, docs/lora.md): the engine serves
*merged* weights. Each version's adapters (float32, a few MB) move to the engine's devices and
are folded into the engine's own copy of the frozen base there (``W + alpha / rank * A @ B`` in
float32, cast to the engine's weight dtype), so the decode step is the full-weight engine's,
unchanged. The cost is memory: the engine holds the base beside the merged weights it serves.

``AdapterMerge`` is the in-process engine's: its ``move`` is the weight path's hop (trainer
thread), what it returns is what the engine swaps in, and ``bytes_moved`` is what crossed from
the trainer's devices for that version.

``GroupStaging`` is a trainer group's, for engine replicas in other processes: every process of
the group stages, collectively and in the same order, what the replicas pull (with LoRA the
frozen base once, in a replica's decode layout and weight dtype, then each version's float32
adapters replicated over a replica's decode mesh; without, each version's weights). The
replicas merge there (``distributed.lora_source``). ``abstract_adapters`` is the adapters'
tree as the trainer and every replica build it from the config; ``final_policy`` the trees an
export needs, the same on every process.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_orch.compose.engines import to_engine
from jaxrl_orch.distributed.group import EngineStager
from jaxrl_orch.inference.engine_api import RLEngine
from jaxrl_orch.models.lora import merge_adapters
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.transformer import ModelConfig, Transformer
from jaxrl_orch.trainer.trainer import Trainer


def tree_nbytes(tree: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class AdapterMerge:
    """See the module docstring. ``frozen``: the trainer's base; ``scale``: ``alpha / rank``."""

    def __init__(self, engine: RLEngine, frozen: Any, scale: float) -> None:
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


def lora_line(lora: LoraConfig, moved: int, base: Any, where: str) -> str:
    """The console's line on a LoRA run's weights: what moves per version, where the base is."""
    held = "" if lora.quantize is None else f"; the trainer holds it {lora.quantize}"
    return (
        f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: {moved / 2**20:.2f} MiB of "
        f"adapters move per version; the frozen base ({tree_nbytes(base) / 2**20:.1f} MiB) "
        f"{where}{held}"
    )


def abstract_adapters(model_cfg: ModelConfig) -> Any:
    """The adapters of ``model_cfg`` (which names its LoRA) as abstract arrays: the trainer's
    tree, leaf for leaf, which is what a replica pulls each version into."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.LoRAParam, ...)[1]


def final_policy(trainer: Trainer) -> dict[str, Any]:
    """What an export writes: every weight (merged, for LoRA) and, for LoRA, the adapters and
    the frozen base. A trainer group gathers it on every process (a collective)."""
    out = {"params": trainer.merged_params()}
    if trainer.frozen is not None:
        out.update(adapters=trainer.params, base=trainer.dense_base())
    return out


class GroupStaging:
    """See the module docstring. ``engine``: a replica's engine (its decode layout on this
    process's devices); ``adapters``: ``abstract_adapters`` of a LoRA run, else None."""

    def __init__(self, trainer_mesh: Mesh, engine: RLEngine, adapters: Any = None) -> None:
        self.whole = EngineStager(trainer_mesh, engine.param_shardings, engine.param_dtype)
        self.adapters = None
        if adapters is not None:
            mesh = jax.tree.leaves(engine.param_shardings)[0].mesh
            everywhere = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), adapters)
            self.adapters = EngineStager(trainer_mesh, everywhere, jnp.float32)

    @classmethod
    def of(cls, trainer: Trainer, engine: RLEngine) -> GroupStaging:
        """The staging of ``trainer``'s weights for replicas shaped like ``engine``: with LoRA
        (its model names adapters) the base once, then the adapters."""
        lora = trainer.config.lora
        return cls(
            trainer.mesh, engine, None if lora is None else abstract_adapters(trainer.config)
        )

    @property
    def layout(self) -> dict[str, Any]:
        """How each version is laid out (a replica's ``layout`` of its pulls)."""
        return (self.adapters or self.whole).transfer_layout()

    @property
    def base_layout(self) -> dict[str, Any] | None:
        return None if self.adapters is None else self.whole.transfer_layout()

    def first(self, trainer: Trainer) -> tuple[Any, Any]:
        """``(base, version)`` this process holds for the replicas' first load (base None
        without LoRA): the base staged once, then the trainer's current version."""
        base = None
        if self.adapters is not None:
            base = self.whole.local(self.whole.stage(trainer.dense_base()))
        return base, self.version(trainer.params)

    def version(self, params: Any) -> Any:
        """After every step: the trained params staged, this process's copy returned."""
        stager = self.adapters or self.whole
        return stager.local(stager.stage(params))
