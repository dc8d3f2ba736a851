"""Generated tokens/s: continuous-batching driver vs a static-batch baseline, one run, one model.

Workload (long tail, the RL access pattern): P prompts x G samples; prompt lengths uniform in
[16, 64] bytes; each sample's completion length is log-normal (median 40, sigma 1) clipped to
[1, max_new] and forced through per-request ``max_tokens`` (no stop ids), so both sides
generate exactly the same number of tokens. Sampling at temperature 1.

- engine: ``InferenceDriver`` over ``DecodeEngine`` -- all groups submitted at once, each
  prompt prefilled once and inserted into its G slots, finished slots refilled at once.
- static: the same engine object (same compiled programs), driven like ``model.generate``:
  batches of ``slots`` sequences, every sequence prefilled separately, decode until the
  longest in the batch is done, no refill.

Both sides are warmed up (every prefill bucket and the decode step compiled) before timing.
``achieved_gflops`` counts useful forward FLOPs of the engine run only: 2 x matmul params per
generated and per prefilled token plus causal attention (4 x layers x heads x head_dim x
context per token); ``matmul_peak_gflops`` is a big f32 matmul timed in the same process.
Prints one JSON line with ``--json``; ``--repeats N`` alternates the two sides N times and sums
(this machine is shared and noisy). Usage:
    python benchmarks/engine_throughput.py --json            # 64 x 4, small-byte, 32 slots
    python benchmarks/engine_throughput.py --json --quick    # 16 x 4, tiny-byte, 16 slots
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.models.transformer import get_config
from jaxrl_orch.types import SamplingParams


def workload(prompts: int, group: int, max_new: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        prompt = rng.integers(0, 256, size=int(rng.integers(16, 65))).tolist()
        lengths = np.clip(np.round(rng.lognormal(np.log(40.0), 1.0, size=group)), 1, max_new)
        out.append((prompt, [SamplingParams(temperature=1.0, max_tokens=int(n)) for n in lengths]))
    return out


def run_engine(engine: DecodeEngine, params, work) -> tuple[int, float, int]:
    driver = InferenceDriver(engine, params, 0, prefix_cache_size=0)
    driver.start()
    try:
        t0 = time.perf_counter()
        futures = [f for prompt, sps in work for f in driver.submit(prompt, sps)]
        tokens = sum(len(f.result().token_ids) for f in futures)
        return tokens, time.perf_counter() - t0, driver.num_prefills
    finally:
        driver.stop()


def _bucket(n: int, cap: int) -> int:
    b = 8
    while b < n:
        b *= 2
    return min(b, cap)


def run_static(engine: DecodeEngine, params, work) -> tuple[int, float]:
    seqs = [(prompt, sp) for prompt, sps in work for sp in sps]
    slots = engine.max_concurrent_decodes
    state = engine.init_decode_state()
    tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(seqs), slots):
        batch = seqs[start : start + slots]
        for slot, (prompt, sp) in enumerate(batch):
            padded = np.zeros(_bucket(len(prompt), engine.max_prefill_length), np.int32)
            padded[: len(prompt)] = prompt
            prefix, _ = engine.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
            state = engine.insert(prefix, state, slot, sampling=sp)
        remaining = {slot: sp.max_tokens for slot, (_, sp) in enumerate(batch)}
        while any(remaining.values()):  # the batch runs as long as its longest member
            state, result = engine.generate(params, state)
            result = result.convert_to_numpy()
            for slot in remaining:
                got = int(result.get_result_at_slot(slot).valid.sum())
                tokens += got
                remaining[slot] -= got
        # Slots beyond a short last batch never get inserted; nothing else to reset.
    return tokens, time.perf_counter() - t0


def matmul_peak_gflops(n: int = 2048, reps: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def forward_flops(cfg, work, prefilled_tokens: int) -> float:
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2 + 3 * d * cfg.d_ff
    matmul = cfg.n_layers * per_layer + d * cfg.vocab_size  # lm head
    attn_per_ctx = 4 * cfg.n_layers * cfg.n_heads * hd
    flops = 2.0 * matmul * prefilled_tokens
    for prompt, sps in work:
        for sp in sps:
            ctx = len(prompt) + np.arange(sp.max_tokens)
            flops += sp.max_tokens * 2.0 * matmul + attn_per_ctx * float(ctx.sum())
        flops += attn_per_ctx * len(prompt) ** 2 / 2
    return flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--quick", action="store_true", help="16 x 4 on tiny-byte, 16 slots")
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="alternate static/engine N times")
    args = ap.parse_args()
    if args.quick:
        model, prompts, group, slots, max_new = "tiny-byte", 16, 4, 16, 128
    else:
        model, prompts, group, slots, max_new = "small-byte", 64, 4, 32, 256
    cfg = get_config(model)
    engine = DecodeEngine(
        cfg,
        max_concurrent_decodes=slots,
        max_target_length=64 + max_new,
        max_prefill_length=64,
        steps_per_call=args.steps_per_call,
    )
    params = engine.load_params(seed=0)
    warm = [(p, [SamplingParams(max_tokens=2)]) for p in ([1] * 8, [1] * 20, [1] * 40)]
    run_engine(engine, params, warm)  # compiles every prefill bucket, insert and generate
    work = workload(prompts, group, max_new)
    expected = sum(sp.max_tokens for _, sps in work for sp in sps)

    static_tokens = engine_tokens = 0
    static_s = engine_s = 0.0
    for _ in range(args.repeats):  # alternate the two sides so machine noise hits both
        tokens, seconds = run_static(engine, params, work)
        static_tokens, static_s = static_tokens + tokens, static_s + seconds
        tokens, seconds, prefills = run_engine(engine, params, work)
        engine_tokens, engine_s = engine_tokens + tokens, engine_s + seconds
    expected *= args.repeats
    if engine_tokens != expected or static_tokens != expected:
        raise RuntimeError(
            f"both sides must generate {expected} tokens; engine {engine_tokens}, "
            f"static {static_tokens}"
        )
    peak = matmul_peak_gflops()
    prefilled = sum(len(p) for p, _ in work)  # once per group on the engine side
    result = {
        "engine_tok_s": round(engine_tokens / engine_s, 1),
        "static_tok_s": round(static_tokens / static_s, 1),
        "ratio": round((engine_tokens / engine_s) / (static_tokens / static_s), 2),
        "achieved_gflops": round(
            args.repeats * forward_flops(cfg, work, prefilled) / engine_s / 1e9, 2
        ),
        "matmul_peak_gflops": round(peak, 1),
        "model": model,
        "tokens_per_side": expected,
        "engine_prefills": prefills,
        "static_prefills": prompts * group,
        "slots": slots,
        "steps_per_call": args.steps_per_call,
        "repeats": args.repeats,
        "device": jax.devices()[0].device_kind,
    }
    if not args.json:
        print(f"engine {engine_s:.1f} s, static {static_s:.1f} s; {expected} tokens per side")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
