"""What a trainer compiles, without allocating: shapes, shardings, optimizer and the jitted step.

``build_programs`` is shared by ``trainer.Trainer`` (which then allocates onto the shardings) and
``jaxrl-aot`` (which lowers ``step_fn`` against the abstract arrays deviceless for
a TPU topology). ``step_programs``: what a trainer calls each step (the step, its logged
learning rate, its key split), each through the run's executable store when it has one.
``splash_specs`` resolves the PartitionSpecs splash attention runs under.

The trained part: with ``ModelConfig.lora`` the model's state splits in two, the adapters
(``nnx.LoRAParam``: ``abstract_params``, what the optimizer updates and the step donates) and the
frozen base (``abstract_frozen``, every other weight: an argument of the step, never
differentiated, no optimizer state). Without it, ``abstract_params`` is every weight and
``abstract_frozen`` is None. ``abstract_base`` is the frozen base as the plain model holds it:
``abstract_frozen`` itself, or for QLoRA (``LoraConfig.quantize``) the dense tree its quantized
weights stand for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl_orch.models.transformer import ModelConfig, Transformer, logical_specs
from jaxrl_orch.trainer import optim as optim_lib
from jaxrl_orch.trainer import step as step_lib
from sharding.rules import TRAINER_RULES, Rules, logical_to_mesh_spec, resolve_shardings


@dataclasses.dataclass(frozen=True)
class TrainPrograms:
    """What a trainer compiles, built without allocating anything (``jaxrl-aot``
    lowers ``step_fn`` against ``abstract_params`` / ``abstract_opt_state`` deviceless)."""

    graphdef: Any
    abstract_params: Any
    param_shardings: Any
    optimizer: Any
    abstract_opt_state: Any
    opt_shardings: Any
    step_fn: Any
    abstract_frozen: Any = None
    frozen_shardings: Any = None
    abstract_base: Any = None  # LoRA: the frozen base dense (QLoRA dequantizes to it)
    base_shardings: Any = None


def splash_specs(model_config: ModelConfig, mesh: Mesh, rules: Rules, rows: int, row_len: int):
    """``(mesh, q, kv, segment)`` PartitionSpecs splash attention runs under on this mesh, or
    None when the model does not use splash (resolved by ``sharding.rules``, like all specs)."""
    if model_config.attention != "splash":
        return None
    c = model_config
    spec = lambda axes, shape: logical_to_mesh_spec(axes, rules, mesh=mesh, shape=shape)
    q = spec(("batch", "length", "heads", "head_dim"), (rows, row_len, c.n_heads, c.head_dim))
    kv = spec(
        ("batch", "length", "kv_heads", "head_dim"), (rows, row_len, c.n_kv_heads, c.head_dim)
    )
    return mesh, q, kv, spec(("batch", "length"), (rows, row_len))


def build_programs(
    model_config: ModelConfig,
    mesh: Mesh,
    step_cfg: step_lib.StepConfig,
    optim_cfg: optim_lib.OptimConfig,
    rules: Rules = TRAINER_RULES,
    seed: int = 0,
    row_len: int = 2048,
) -> TrainPrograms:
    """Shapes, shardings, optimizer and the jitted step of a trainer (no arrays built)."""
    abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(seed)))
    if model_config.lora is None:
        graphdef, abstract_state = nnx.split(abstract)
        frozen = frozen_shardings = base = base_shardings = None
    else:
        graphdef, abstract_state, frozen = nnx.split(abstract, nnx.LoRAParam, ...)
        frozen_shardings = resolve_shardings(logical_specs(frozen), mesh, rules, shapes=frozen)
        base = frozen
        base_shardings = frozen_shardings
        if model_config.lora.quantize is not None:
            plain = dataclasses.replace(model_config, lora=None)
            base = nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(seed))))[1]
            base_shardings = resolve_shardings(logical_specs(base), mesh, rules, shapes=base)
    param_shardings = resolve_shardings(
        logical_specs(abstract_state), mesh, rules, shapes=abstract_state
    )
    optimizer = optim_lib.make_optimizer(optim_cfg)
    opt_shape = jax.eval_shape(optimizer.init, abstract_state)
    opt_shardings = optim_lib.opt_state_shardings(opt_shape, abstract_state, param_shardings, mesh)
    step_fn = step_lib.build_train_step(
        graphdef,
        optimizer,
        step_cfg,
        param_shardings=param_shardings,
        opt_shardings=opt_shardings,
        mesh=mesh,
        splash_specs=splash_specs(model_config, mesh, rules, step_cfg.chunk_rows, row_len),
        frozen_shardings=frozen_shardings,
    )
    return TrainPrograms(
        graphdef,
        abstract_state,
        param_shardings,
        optimizer,
        opt_shape,
        opt_shardings,
        step_fn,
        frozen,
        frozen_shardings,
        base,
        base_shardings,
    )


def step_programs(
    keep: Callable[[str, str, Any], Any] | None,
    group: str,
    step_fn: Any,
    schedule: Any,
    replicated: jax.sharding.NamedSharding,
) -> tuple[Any, Any, Any]:
    """The step, and the two small programs each step also runs: the learning rate it logs and
    the key split. One program each, not one per operation run eagerly (nine of them), so a
    restart loads three whole (``keep``: the executable store) instead of tracing nine."""
    lr = jax.jit(schedule)
    split = jax.jit(lambda key: tuple(jax.random.split(key)), out_shardings=(replicated,) * 2)
    if keep is None:
        return step_fn, lr, split
    return keep(group, "step", step_fn), keep(group, "lr", lr), keep(group, "split", split)
