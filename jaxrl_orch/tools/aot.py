"""``jaxrl-aot``: does a config fit its TPU slice? Compiled here, no TPU needed.

What it owns: building, from a gin config, the programs a run compiles -- the RL train step on
the trainer mesh, the engine's prefill and decode step (``steps_per_call`` steps of every slot)
on the decode mesh (a multi-process layout: the trainer group's mesh on
``Processes.tpu_topology``, one replica's on ``Processes.replica_topology``), and the
trainer-to-engine reshard's source-side cast -- against abstract ``ShapeDtypeStruct`` arguments
laid on a TPU topology's devices (``jax.experimental.topologies.get_topology_desc``, which
needs ``libtpu``: the ``tpu`` extra), compiling them deviceless (MaxText's ``train_compile.py``
is the model), and reading what XLA says about each: per-chip memory (arguments, outputs,
temporaries, generated code; donated arguments counted once), FLOPs and bytes accessed.

Estimates (``aot_report``): a roofline time per program, ``max(flops / peak, bytes / HBM
bandwidth)`` from the chip's published figures (``CHIPS``). XLA's cost analysis counts a loop
body once, whatever its trip count (measured: a ``lax.scan`` of 8 matmuls reports the FLOPs of
one), so each program also gets an analytic model count (``aot_report.model_costs``) and the
estimate uses the larger of the two, per quantity.

Exit status: 0 when every program fits within ``--max_fraction`` (0.9) of the chip's HBM; 1
with a message naming each program that does not, and by how much; 2 for bad input (an unknown
topology names the allowed ones). Never allocates a device array: params, optimizer state and
caches exist only as shapes.
"""

from __future__ import annotations

import os

# Compiling for a topology needs no backend: keep JAX off any local accelerator (and off
# libtpu's device probing) unless told otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock unless told otherwise; a deviceless compile never touches a
# chip, so two of them (CI jobs, the test suite) may share the machine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.typing import DTypeLike  # noqa: E402

from jaxrl_orch.compose.engines import build_engine  # noqa: E402
from jaxrl_orch.compose.model import model_config, tokenizer_spec  # noqa: E402
from jaxrl_orch.compose.placement import Placement, build_placement  # noqa: E402
from jaxrl_orch.compose.precision import accel_model_config  # noqa: E402
from jaxrl_orch.compose.trainers import optim_config, rl_model, step_config  # noqa: E402
from jaxrl_orch.config.load import load_config  # noqa: E402
from jaxrl_orch.config.train import TrainConfig  # noqa: E402
from jaxrl_orch.models.configs import ModelConfig  # noqa: E402
from jaxrl_orch.models.lora import merge_adapters  # noqa: E402
from jaxrl_orch.models.tokenizer import load_tokenizer  # noqa: E402
from jaxrl_orch.models.transformer import Transformer  # noqa: E402
from jaxrl_orch.tools import aot_report  # noqa: E402
from jaxrl_orch.trainer import step as step_lib  # noqa: E402
from jaxrl_orch.trainer.programs import build_programs  # noqa: E402
from sharding.mesh import make_meshes  # noqa: E402
from sharding.reshard import cast_program  # noqa: E402
from sharding.rules import abstract_arrays  # noqa: E402

TOPOLOGY_RE = re.compile(r"^(v5e|v6e):(\d+)x(\d+)$")


@dataclasses.dataclass(frozen=True)
class Compiled:
    name: str
    compiled: Any
    chips: int  # devices the program runs on
    model: dict[str, float]  # analytic flops / bytes per chip
    resident: int = 0  # bytes per chip held beside the program (a LoRA engine's base copy)
    refused: tuple[float, float] | None = None  # XLA's OOM: (needed, usable) bytes per chip


OOM_RE = re.compile(r"temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def compile_or_refusal(lowered: Any) -> Any:
    """``lowered.compile()``, or ``(needed, usable)`` bytes per chip when XLA refuses a program
    whose temporaries alone exceed the chip's HBM (it does not fit: a finding, not an error)."""
    try:
        return lowered.compile()
    except Exception as exc:  # noqa: BLE001 - only XLA's out-of-memory refusal is a finding
        m = OOM_RE.search(str(exc))
        if m is None:
            raise
        return float(m.group(1)) * 2**30, float(m.group(2)) * 2**30


def topology_devices(topology: str) -> tuple[str, list[Any]]:
    """``(chip, devices)`` of a ``"v5e:2x4"``-style topology (deviceless, needs libtpu)."""
    m = TOPOLOGY_RE.match(topology or "")
    if m is None:
        raise ValueError(
            f"unknown topology {topology!r}; allowed: '<chip>:<X>x<Y>' with chip one of "
            f"{sorted(aot_report.CHIPS)}, e.g. 'v5e:2x4' (a v5e-8 host) or 'v6e:2x4'"
        )
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do about it
        raise RuntimeError(
            f"cannot describe TPU topology {topology!r} without a TPU: {exc}. Install the tpu "
            "extra (pip install -e '.[tpu]': it brings libtpu)"
        ) from exc
    return m.group(1), list(desc.devices)


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_train_step(cfg: TrainConfig, model_cfg, mesh) -> tuple[Any, Any, int]:
    """The RL step on ``rows_per_batch`` rows (or one chunk), lowered and compiled."""
    step_cfg = step_config(cfg, "rl")
    rows = cfg.trainer.rows_per_batch or step_cfg.rows_multiple
    progs = build_programs(
        model_cfg,
        mesh,
        step_cfg,
        optim_config(cfg, "rl", cfg.rl.learning_rate),
        row_len=cfg.trainer.row_len,
    )
    params = abstract_arrays(progs.abstract_params, progs.param_shardings)
    opt = abstract_arrays(progs.abstract_opt_state, progs.opt_shardings)
    row_axis = "fsdp" if step_cfg.chunk_rows % mesh.shape["fsdp"] == 0 else None
    bsh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(row_axis, None))
    dtypes = {
        "loss_mask": jnp.bool_,
        "advantages": jnp.float32,
        "logprobs": jnp.float32,
        "temperatures": jnp.float32,
    }
    batch = {
        k: _sds((rows, cfg.trainer.row_len), dtypes.get(k, jnp.int32), bsh)
        for k in step_lib.BATCH_FIELDS
    }
    rng = _sds((2,), jnp.uint32, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    ref = params if step_cfg.kind == "rl" and step_cfg.loss.kl_beta > 0 else None
    frozen = None  # a LoRA step's frozen base
    if progs.abstract_frozen is not None:
        frozen = abstract_arrays(progs.abstract_frozen, progs.frozen_shardings)
    compiled = compile_or_refusal(progs.step_fn.lower(params, opt, batch, rng, ref, frozen))
    return compiled, params, rows


def per_chip_bytes(tree: Any) -> int:
    """The bytes one chip holds of abstract arrays laid out by their shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def _moved_bytes(leaves: list[Any], engine_dtype: DTypeLike, lora: bool) -> int:
    """Bytes per version off the trainer: adapters as they are, full weights cast first."""
    size = lambda x: x.size * (x.dtype.itemsize if lora else jnp.dtype(engine_dtype).itemsize)
    return sum(size(x) for x in leaves)


def compile_lora_merge(model_cfg: ModelConfig, eparams: Any, mesh: Mesh) -> jax.stages.Compiled:
    """The engine folding one version's adapters (float32, replicated) into its base."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    _, adapters, _ = nnx.split(abstract, nnx.LoRAParam, ...)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    adapters = jax.tree.map(lambda x: _sds(x.shape, x.dtype, rep), adapters)
    shardings = jax.tree.map(lambda x: x.sharding, eparams)
    scale = model_cfg.lora.scale
    merge = jax.jit(lambda b, a: merge_adapters(b, a, scale), out_shardings=shardings)
    return merge.lower(eparams, adapters).compile()


# The model settings the report shows: precision, kernels and shapes.
_REPORTED = (
    "dtype",
    "param_dtype",
    "attention",
    "remat",
    "n_layers",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
)


def aot_placement(cfg: TrainConfig, devices: list[Any], replica_devices: list[Any] | None) -> Any:
    """One process's placement on ``devices``; with engine replicas, the trainer group's mesh
    on ``devices`` (its whole slice) and a replica's decode mesh on ``replica_devices``."""
    if not cfg.processes.engine_replicas:
        return build_placement(cfg, len(devices), devices=devices)
    replica_devices = replica_devices or devices
    trainer_shape = dict(cfg.trainer.mesh) or {"fsdp": len(devices)}
    decode_shape = dict(cfg.engine.mesh) or {"tp": len(replica_devices)}
    n_tr = math.prod(trainer_shape.values())
    n_dec = math.prod(decode_shape.values())
    _, trainer = make_meshes({"tp": n_tr}, trainer_shape, devices=devices, colocated=True)
    decode, _ = make_meshes(decode_shape, {"fsdp": n_dec}, devices=replica_devices, colocated=True)
    return Placement(False, decode, trainer)


def compile_all(
    cfg: TrainConfig, devices: list[Any], replica_devices: list[Any] | None = None
) -> tuple[list[Compiled], dict[str, Any]]:
    # No weights are read: a published model's preset compiles without its checkpoint.
    tokenizer = load_tokenizer(tokenizer_spec(cfg.model))
    model_cfg = accel_model_config(model_config(cfg.model.name, tokenizer), cfg, "tpu")
    placement = aot_placement(cfg, devices, replica_devices)
    decode_mesh = placement.decode_mesh
    trainer_mesh = placement.trainer_mesh
    n_tr = trainer_mesh.devices.size
    n_dec = decode_mesh.devices.size
    out: list[Compiled] = []

    # The run's own builder, for TPU dtypes: only the engine's shapes and programs are used.
    engine = build_engine(cfg, model_cfg, decode_mesh, tokenizer, backend="tpu").engine
    rl_cfg = rl_model(cfg, model_cfg)
    train, tparams, rows = compile_train_step(cfg, rl_cfg, trainer_mesh)
    mc = aot_report.model_costs(model_cfg, cfg, rows, engine.limits)
    if isinstance(train, tuple):
        out.append(Compiled("train_step", None, n_tr, mc["train_step"], refused=train))
    else:
        out.append(Compiled("train_step", train, n_tr, mc["train_step"]))

    eparams = engine.abstract_params()
    # A LoRA engine serves merged weights and keeps the frozen base beside them.
    base = per_chip_bytes(eparams) if rl_cfg.lora is not None else 0
    rep = jax.sharding.NamedSharding(decode_mesh, jax.sharding.PartitionSpec())
    length = engine.max_prefill_length
    prefill = engine.prefill_program(length).lower(eparams, _sds((1, length), jnp.int32, rep))
    out.append(Compiled("prefill", prefill.compile(), n_dec, mc["prefill"], base))
    state = engine.abstract_decode_state()
    gen = engine.generate_program(engine.max_concurrent_decodes)
    gen = gen.lower(eparams, state, _sds((), jnp.int32, rep)).compile()
    out.append(Compiled("decode_step", gen, n_dec, mc["decode_step"], base))

    dt = engine.param_dtype
    leaves = jax.tree.leaves(tparams)
    floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt]
    if rl_cfg.lora is not None:  # adapters move as they are; the engine merges them
        merge = compile_lora_merge(rl_cfg, eparams, decode_mesh)
        # While it merges, the engine still serves the previous version's merged weights.
        out.append(Compiled("lora_merge", merge, n_dec, {"flops": 0.0, "bytes": 0.0}, base))
    elif floats:
        cast = cast_program.lower(floats, dt).compile()
        out.append(Compiled("reshard", cast, n_tr, mc["reshard"]))
    info = {
        "model": cfg.model.name,
        "data_env": cfg.data.env,
        "trainer_processes": cfg.processes.trainer_processes,
        "engine_replicas": cfg.processes.engine_replicas,
        "replica_topology": cfg.processes.replica_topology,
        "model_config": {
            k: str(v) for k, v in dataclasses.asdict(model_cfg).items() if k in _REPORTED
        },
        "num_params": model_cfg.num_params,
        "trainer_mesh": dict(trainer_mesh.shape),
        "decode_mesh": dict(decode_mesh.shape),
        "decode_mesh_size": n_dec,
        "colocated": placement.colocated,
        "train_rows": rows,
        "row_len": cfg.trainer.row_len,
        "decode_slots": cfg.engine.slots,
        "steps_per_call": cfg.engine.steps_per_call,
        "engine_param_dtype": str(dt),
        "transfer_bytes": _moved_bytes(leaves, dt, rl_cfg.lora is not None),
        "lora": None if rl_cfg.lora is None else dataclasses.asdict(rl_cfg.lora),
    }
    return out, info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.tools.aot",
        description="Compile a config's programs for a TPU topology without a TPU; report "
        "per-chip memory, FLOPs, bytes and roofline time; exit 1 if a program does not fit.",
    )
    p.add_argument("--gin_file", action="append", default=[], required=True)
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument(
        "--topology",
        default=None,
        help="e.g. v5e:2x4 (default: Processes.tpu_topology of the config)",
    )
    p.add_argument(
        "--max_fraction",
        type=float,
        default=0.9,
        help="a program fits when its per-chip bytes are <= this fraction of HBM",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not 0 < args.max_fraction <= 1:
            raise ValueError(f"--max_fraction must be in (0, 1], got {args.max_fraction}")
        cfg = load_config(args.gin_file, args.gin_param)
        topology = args.topology or cfg.processes.tpu_topology
        if topology is None:
            raise ValueError(
                "no topology: pass --topology (e.g. v5e:2x4) or set Processes.tpu_topology"
            )
        chip, devices = topology_devices(topology)
        replica_devices = None
        if cfg.processes.engine_replicas and cfg.processes.replica_topology:
            replica_chip, replica_devices = topology_devices(cfg.processes.replica_topology)
            if replica_chip != chip:
                raise ValueError(
                    f"Processes.replica_topology {cfg.processes.replica_topology!r} is not a "
                    f"{chip} slice like Processes.tpu_topology {topology!r}: the report compares "
                    "every program against one chip's HBM"
                )
        # No persistent compilation cache here: a deviceless (compile-only) client cannot load
        # a cached executable ("PjRtCompiler must be constructed with a Client to call
        # DeserializeLoadedExecutable"), so every entry would be written for nothing and every
        # later compile warn and compile again (measured: docs/faults.md, "A restart's cost").
        jax.config.update("jax_enable_compilation_cache", False)
        t0 = time.perf_counter()
        programs, info = compile_all(cfg, devices, replica_devices)
        compile_s = time.perf_counter() - t0
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = aot_report.build_report(topology, chip, programs, info, args.max_fraction)
    report["compile_s"] = round(compile_s, 2)
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print(aot_report.format_text(report))
    if not report["fits"]:
        for line in report["shortfalls"]:
            print(f"does not fit: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
