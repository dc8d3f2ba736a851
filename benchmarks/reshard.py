"""Benchmark: trainer -> decode weight resharding against a host memcpy of the same bytes.

What it measures
    The time ``sharding.reshard.reshard`` takes to move ~100 MB of transformer-shaped fp32
    params from the trainer mesh (fsdp=2 x tp=2, devices 0-3) onto the decode mesh (tp=4,
    devices 4-7) of 8 fake CPU devices, with shardings resolved from logical axes by
    ``sharding.rules``; and, side by side in the same run, ``np.copy`` of a host buffer of the
    same byte count. The headline is ``ratio = reshard_ms / memcpy_ms`` (goal <= 1.5): on CPU
    fake devices a reshard is at best a memcpy, so the ratio says how much overhead the batched
    ``device_put`` adds. Also reported: the same move cast to bf16 on the source (half the bytes
    cross), and the number of leaves.

How to run
    python benchmarks/reshard.py --json      # one JSON line
    python benchmarks/reshard.py             # human-readable

Timings are medians over interleaved repetitions after warm-up (the machine is shared and
noisy); outputs are freed between repetitions so allocation costs are comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sharding.mesh import make_meshes  # noqa: E402
from sharding.reshard import reshard  # noqa: E402
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings  # noqa: E402

# A decoder with these sizes holds ~26M fp32 params (~105 MB).
VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, D_FF, LAYERS = 8192, 512, 8, 2, 64, 1536, 6


def param_specs() -> tuple[dict, dict]:
    """(logical axes, shapes) for a transformer-shaped parameter tree."""
    layer_logical = {
        "q": ("embed", "heads", "head_dim"),
        "k": ("embed", "kv_heads", "head_dim"),
        "v": ("embed", "kv_heads", "head_dim"),
        "o": ("heads", "head_dim", "embed"),
        "gate": ("embed", "mlp"),
        "up": ("embed", "mlp"),
        "down": ("mlp", "embed"),
        "attn_norm": ("norm",),
        "mlp_norm": ("norm",),
    }
    layer_shapes = {
        "q": (D, HEADS, HEAD_DIM),
        "k": (D, KV_HEADS, HEAD_DIM),
        "v": (D, KV_HEADS, HEAD_DIM),
        "o": (HEADS, HEAD_DIM, D),
        "gate": (D, D_FF),
        "up": (D, D_FF),
        "down": (D_FF, D),
        "attn_norm": (D,),
        "mlp_norm": (D,),
    }
    logical = {
        "embedding": ("vocab", "embed"),
        "layers": [dict(layer_logical) for _ in range(LAYERS)],
        "final_norm": ("norm",),
        "lm_head": ("embed", "vocab"),
    }
    shapes = {
        "embedding": (VOCAB, D),
        "layers": [dict(layer_shapes) for _ in range(LAYERS)],
        "final_norm": (D,),
        "lm_head": (D, VOCAB),
    }
    return logical, shapes


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run(reps: int = 7, warmup: int = 2) -> dict:
    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})
    logical, shapes = param_specs()
    src_sh = resolve_shardings(logical, trainer, TRAINER_RULES, shapes=shapes)
    dst_sh = resolve_shardings(logical, decode, DECODE_RULES, shapes=shapes)
    rng = np.random.default_rng(0)
    host = jax.tree.map(
        lambda s: rng.standard_normal(s, dtype=np.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    params = jax.block_until_ready(jax.device_put(host, src_sh))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    flat = np.concatenate([x.ravel() for x in jax.tree.leaves(host)])
    del host

    def move(dtype=None):
        out = jax.block_until_ready(reshard(params, dst_sh, dtype=dtype))
        del out

    def memcpy():
        out = np.copy(flat)
        del out

    for _ in range(warmup):
        move()
        move(jnp.bfloat16)
        memcpy()
    t_reshard, t_bf16, t_copy = [], [], []
    for _ in range(reps):
        t_reshard.append(_timed(move))
        t_copy.append(_timed(memcpy))
        t_bf16.append(_timed(lambda: move(jnp.bfloat16)))
    reshard_ms = statistics.median(t_reshard)
    memcpy_ms = statistics.median(t_copy)
    return {
        "reshard_ms": round(reshard_ms, 2),
        "memcpy_ms": round(memcpy_ms, 2),
        "ratio": round(reshard_ms / memcpy_ms, 3),
        "bytes": int(nbytes),
        "reshard_bf16_ms": round(statistics.median(t_bf16), 2),
        "leaves": len(jax.tree.leaves(params)),
        "reps": reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    result = run(reps=args.reps)
    if args.json:
        print(json.dumps(result))
    else:
        mb = result["bytes"] / 1e6
        print(f"params: {mb:.1f} MB in {result['leaves']} leaves, trainer 2x2 -> decode tp=4")
        print(f"reshard fp32:      {result['reshard_ms']:8.2f} ms")
        print(f"reshard -> bf16:   {result['reshard_bf16_ms']:8.2f} ms")
        print(f"np.copy same size: {result['memcpy_ms']:8.2f} ms")
        print(f"ratio reshard/memcpy: {result['ratio']:.3f} (goal <= 1.5)")


if __name__ == "__main__":
    main()
