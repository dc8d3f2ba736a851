"""Generated tokens/s: continuous-batching driver vs a static-batch baseline, one run, one model.

Workload (long tail, the RL access pattern): P prompts x G samples (default 64 x 4, the issue's
figure); prompt lengths uniform in [16, 64] bytes; each sample's completion length is
log-normal (median 40, sigma 1) clipped to [1, max_new = 256] and forced through per-request
``max_tokens`` (no stop ids), so both sides generate exactly the same number of tokens.
Sampling at temperature 1, no top-k/top-p (what RL rollouts use). small-byte model, 32 slots.

- engine: ``InferenceDriver`` over ``DecodeEngine`` -- all groups submitted at once, each
  prompt prefilled once and inserted into its G slots, finished slots refilled at once, and the
  decode width narrowed (32 -> 16 -> 8 -> 4 slots) once fewer requests remain (the drain).
- static: the same engine object and the same compiled full-width decode program, driven like
  ``model.generate``: batches of ``slots`` sequences, every sequence prefilled separately,
  decode until the longest in the batch is done, no refill.

Why the ratio depends on P: the long tail hurts static batching in every batch (a batch runs
as long as its longest member), while continuous batching pays for it once, in the drain at
the end of the finite workload when the last requests run alone. A real RL step streams many
groups, so the drain is a smaller share there than in 64 x 4; ``--prompts 128`` or ``256``
measures that regime (same length distribution and slots). Narrowing the width is what lets
64 x 4 pass 3: at full width the drain alone capped it near 2.8 (a step-count simulation).

Both sides are warmed up (every prefill bucket, insert, decode width and slot move compiled)
before timing. ``achieved_gflops`` counts useful forward FLOPs of the engine run only: 2 x
matmul params per generated and per prefilled token plus causal attention (4 x layers x heads
x head_dim x context per token); ``matmul_peak_gflops`` is a big f32 matmul timed in the same
process. ``decode_step_*`` time one full-width decode call (every slot busy, context at half the
cache) against the same useful-FLOP count: how close one decode step gets to the matmul peak.
Prints one JSON line with ``--json``; ``--repeats N`` alternates the two sides N times and sums
(this machine is shared and noisy: ``ratio_per_repeat`` shows the spread, and ``ratio_cpu``
compares process CPU seconds, which other jobs on the machine disturb less). Usage:
    python benchmarks/engine_throughput.py --json --repeats 2   # 64 x 4, small-byte, 32 slots
    python benchmarks/engine_throughput.py --json --prompts 256 # the streaming regime
    python benchmarks/engine_throughput.py --json --quick       # 16 x 4, tiny-byte, 16 slots
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_orch.compose import precision
from jaxrl_orch.config.load import make_config
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.transformer import get_config
from jaxrl_orch.types import SamplingParams

DECODE_CALLS = 20  # timed full-width decode calls (decode_step)


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


def matmul_peak_gflops(n: int = 2048, reps: int = 8, dtype=jnp.float32) -> float:
    """Best FLOP/s of an ``[n, n] @ [n, n]`` matmul in ``dtype``, accumulating in float32 as
    the model's matmuls do."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def forward_flops(cfg, work, prefilled_tokens: int) -> float:
    matmul = _matmul_params(cfg)
    attn_per_ctx = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    flops = 2.0 * matmul * prefilled_tokens
    for prompt, sps in work:
        for sp in sps:
            ctx = len(prompt) + np.arange(sp.max_tokens)
            flops += sp.max_tokens * 2.0 * matmul + attn_per_ctx * float(ctx.sum())
        flops += attn_per_ctx * len(prompt) ** 2 / 2
    return flops


def warm_up(engine: DecodeEngine, params) -> None:
    """Compile everything either side can touch (prefill buckets, inserts, every decode width,
    slot moves) so no compile lands inside a timed run."""
    state = engine.init_decode_state()
    bucket = 8
    while True:
        prefix, _ = engine.prefill(
            params=params, padded_tokens=np.ones(bucket, np.int32), true_length=bucket
        )
        state = engine.insert(prefix, state, 0, sampling=SamplingParams(max_tokens=2))
        if bucket >= engine.max_prefill_length:
            break
        bucket = min(2 * bucket, engine.max_prefill_length)
    for width in engine.decode_widths:
        state, result = engine.generate(params, state, width=width)
        result.convert_to_numpy()
    state = engine.move_slot(state, 1, 0)
    jax.block_until_ready(state)


def decode_step(engine: DecodeEngine, params, cfg, context: int) -> tuple[float, float]:
    """One full-width decode call with every slot at ``context``: (seconds per step, useful
    FLOPs per step), best of ``DECODE_CALLS`` calls (a 2-core machine's timings spread by
    20-40% call to call; the best is the step's own cost)."""
    state = engine.init_decode_state()
    prompt = np.ones(engine.max_prefill_length, np.int32)
    prefix, _ = engine.prefill(params=params, padded_tokens=prompt, true_length=prompt.size)
    prefix["pos"] = np.int32(context)  # the attention mask is what sets the attended context
    never = SamplingParams(temperature=1.0, max_tokens=10**6)
    for slot in range(engine.max_concurrent_decodes):
        state = engine.insert(prefix, state, slot, sampling=never)
    best = float("inf")
    for _ in range(DECODE_CALLS):
        t0 = time.perf_counter()
        state, result = engine.generate(params, state)
        result.convert_to_numpy()
        best = min(best, time.perf_counter() - t0)
    k = engine.steps_per_call
    ctx = context + DECODE_CALLS * k // 2  # mean context over the timed calls
    per_token = 2.0 * _matmul_params(cfg) + 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * ctx
    return best / k, per_token * engine.max_concurrent_decodes


def _matmul_params(cfg) -> int:
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2 + 3 * d * cfg.d_ff
    return cfg.n_layers * per_layer + d * cfg.vocab_size  # + lm head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--quick", action="store_true", help="16 x 4 on tiny-byte, 16 slots")
    ap.add_argument("--prompts", type=int, default=None, help="prompt groups (default 64)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--slots", type=int, default=None, help="decode slots (default 32)")
    ap.add_argument("--steps-per-call", type=int, default=4, help="decode steps per host call")
    ap.add_argument("--repeats", type=int, default=1, help="alternate static/engine N times")
    ap.add_argument("--attention", default="auto", help="Model.attention (auto: by backend)")
    ap.add_argument("--compute-dtype", default="auto", help="Model.compute_dtype")
    args = ap.parse_args()
    if args.quick:
        model, prompts, slots, max_new = "tiny-byte", 16, 16, 128
    else:
        model, prompts, slots, max_new = "small-byte", 64, 32, 256
    prompts = args.prompts or prompts
    slots = args.slots or slots
    group = args.samples
    for name, value in (("prompts", prompts), ("samples", group), ("slots", slots)):
        if value < 1:
            raise SystemExit(f"--{name} must be >= 1, got {value}")
    # What a run builds: the attention TrainConfig resolves for this backend (compose/precision.py).
    run_cfg = make_config(
        {"Model.attention": args.attention, "Model.compute_dtype": args.compute_dtype}
    )
    cfg = precision.accel_model_config(get_config(model), run_cfg)
    limits = EngineLimits(
        max_concurrent_decodes=slots,
        max_target_length=64 + max_new,
        max_prefill_length=64,
        steps_per_call=args.steps_per_call,
    )
    engine = DecodeEngine(cfg, limits=limits)
    params = engine.load_params(seed=0)
    warm_up(engine, params)
    work = workload(prompts, group, max_new)
    expected = sum(sp.max_tokens for _, sps in work for sp in sps)

    static_tokens = engine_tokens = 0
    static_s = engine_s = static_cpu = engine_cpu = 0.0
    per_repeat = []
    for _ in range(args.repeats):  # alternate the two sides so machine noise hits both
        cpu0 = time.process_time()
        tokens, seconds = run_static(engine, params, work)
        cpu1 = time.process_time()
        static_tokens, static_s, static_cpu = (
            static_tokens + tokens,
            static_s + seconds,
            static_cpu + cpu1 - cpu0,
        )
        tokens, e_seconds, prefills = run_engine(engine, params, work)
        engine_cpu += time.process_time() - cpu1
        engine_tokens, engine_s = engine_tokens + tokens, engine_s + e_seconds
        per_repeat.append(round(seconds / e_seconds, 2))  # same tokens on both sides
    expected *= args.repeats
    if engine_tokens != expected or static_tokens != expected:
        raise RuntimeError(
            f"both sides must generate {expected} tokens; engine {engine_tokens}, "
            f"static {static_tokens}"
        )
    step_s, step_flops = decode_step(engine, params, cfg, context=(64 + max_new) // 2)
    peak = matmul_peak_gflops(dtype=cfg.dtype)
    prefilled = sum(len(p) for p, _ in work)  # once per group on the engine side
    result = {
        "engine_tok_s": round(engine_tokens / engine_s, 1),
        "static_tok_s": round(static_tokens / static_s, 1),
        "ratio": round((engine_tokens / engine_s) / (static_tokens / static_s), 2),
        "achieved_gflops": round(
            args.repeats * forward_flops(cfg, work, prefilled) / engine_s / 1e9, 2
        ),
        "matmul_peak_gflops": round(peak, 1),
        "ratio_per_repeat": per_repeat,
        # Process CPU seconds (all threads): less sensitive to other jobs on a shared machine.
        "ratio_cpu": round(static_cpu / engine_cpu, 2),
        "decode_step_ms": round(step_s * 1e3, 2),
        "decode_step_gflops": round(step_flops / step_s / 1e9, 2),
        "decode_step_peak_fraction": round(step_flops / step_s / 1e9 / peak, 3),
        "model": model,
        "attention": f"{cfg.attention} (block {cfg.attention_block})",
        "compute_dtype": jnp.dtype(cfg.dtype).name,
        "prompts": prompts,
        "samples": group,
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
