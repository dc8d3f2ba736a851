"""How a LoRA policy is served: merged weights, or adapters applied in the decode step.

    python benchmarks/lora_serving.py --json                 # small-byte, rank 16, 32 slots
    python benchmarks/lora_serving.py --json --model tiny-byte --rank 4

Measured on one model, same run, interleaved:
- ``decode_merged_ms``: one full-width decode step (``forward_cached``, one token per slot
  against a ``--cache-len`` KV cache) of the base model on merged weights (``W + s A B``);
- ``decode_unmerged_ms``: the same step of the LoRA model, the adapters applied beside every
  projection (two thin matmuls each: ``x A`` then ``(x A) B``);
- ``merge_ms``: folding one version's adapters into the base (``models.lora.merge_adapters``),
  which a merged engine pays once per version, not per step;
- weight memory of each: merged serving holds the base and the merged copy, unmerged the base
  and the adapters.
Reported as ``unmerged / merged`` (decode) and ``merge / decode_merged`` ratios, with the
median of ``--iters`` calls each (the machine is shared: compare ratios of one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_orch.compose.staging import tree_nbytes
from jaxrl_orch.models.lora import merge_adapters
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.transformer import Transformer, get_config, init_cache


def _decode_fn(graphdef):
    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, *state).forward_cached(tokens, positions, cache)[0]

    return jax.jit(step)


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model: str, rank: int, slots: int, cache_len: int, iters: int) -> dict[str, float]:
    base_cfg = get_config(model)
    cfg = dataclasses.replace(base_cfg, lora=LoraConfig(rank=rank, alpha=2.0 * rank))
    graphdef, adapters, base = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.LoRAParam, ...)
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    adapters = jax.tree.unflatten(
        tree, [0.02 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )
    plain_def = nnx.split(nnx.eval_shape(lambda: Transformer(base_cfg, rngs=nnx.Rngs(0))))[0]
    merge = jax.jit(lambda b, a: merge_adapters(b, a, cfg.lora.scale))
    merged = merge(base, adapters)
    tokens = jnp.ones((slots, 1), jnp.int32)
    positions = jnp.full((slots, 1), cache_len // 2, jnp.int32)
    cache = init_cache(base_cfg, slots, cache_len)
    run_merged = lambda f=_decode_fn(plain_def): f((merged,), tokens, positions, cache)
    run_unmerged = lambda f=_decode_fn(graphdef): f((adapters, base), tokens, positions, cache)
    run_merge = lambda: merge(base, adapters)
    for fn in (run_merged, run_unmerged, run_merge):  # compile and warm
        jax.block_until_ready(fn())
    rounds = {"merged": [], "unmerged": [], "merge": []}
    for _ in range(3):  # interleaved, so the machine's noise hits all alike
        rounds["merged"].append(_median_ms(run_merged, iters))
        rounds["unmerged"].append(_median_ms(run_unmerged, iters))
        rounds["merge"].append(_median_ms(run_merge, max(iters // 4, 3)))
    m = {k: statistics.median(v) for k, v in rounds.items()}
    return {
        "model": model,
        "rank": rank,
        "slots": slots,
        "cache_len": cache_len,
        "decode_merged_ms": m["merged"],
        "decode_unmerged_ms": m["unmerged"],
        "decode_unmerged_over_merged": m["unmerged"] / m["merged"],
        "merge_ms": m["merge"],
        "merge_over_decode_step": m["merge"] / m["merged"],
        "weights_mib_merged_serving": (tree_nbytes(base) + tree_nbytes(merged)) / 2**20,
        "weights_mib_unmerged_serving": (tree_nbytes(base) + tree_nbytes(adapters)) / 2**20,
        "adapter_mib": tree_nbytes(adapters) / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-byte")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--cache-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    row = measure(args.model, args.rank, args.slots, args.cache_len, args.iters)
    if args.json:
        print(json.dumps(row))
        return
    for k, v in row.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()
