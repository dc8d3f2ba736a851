"""Trainer step throughput: tokens/s, MFU against a matmul peak measured in the same run, and
the overhead of our step against a minimal hand-written ``jax.jit`` step of the same model/loss.

    python benchmarks/train_step.py --json                 # small-byte, 8 rows x 512
    python benchmarks/train_step.py --model tiny-byte --rows 4 --row-len 256 --json

What is compared (side by side, interleaved, median of ``--iters``; this machine is noisy):
- ``ours``: ``Trainer.train_packed`` on a packed batch (host arrays in, host metrics out): the
  sharded jitted step of ``trainer/step.py`` (donation, explicit shardings, diagnostics).
- ``minimal``: one ``jax.jit`` of ``value_and_grad`` of the same clipped-surrogate loss (ratio
  against behavior log-probs, token normalisation, same temperature scaling) followed by the
  same optax update, same host arrays in, loss out. No diagnostics, no mesh.
- ``peak``: best FLOP/s of an ``[n, n] @ [n, n]`` jitted matmul in the compute dtype,
  accumulating in float32 (as the model's matmuls do): timed once after each step pair and 8
  times back to back after the loop, the best of all.

FLOPs per processed token (padding slots included: the hardware computes them), three counts
of the attention term (``A = n_layers * n_heads * head_dim``, ``N_matmul`` the attention and
MLP kernels plus the LM head; the embedding gather is not a matmul):
- ``mfu``: ``6 * N_matmul + 6 * A * row_len``, MaxText's convention (its
  ``calculate_tflops_training_per_device``: causal attention is half the ``T x T`` scores), the
  row taken as one sequence as packed trainers count it.
- ``mfu_palm``: ``6 * N_matmul + 12 * A * row_len``, PaLM's (appendix B), un-halved; older
  sittings in docs/benchmarks.md quote this count.
- ``mfu_visible``: ``6 * N_matmul + 12 * A * pairs / tokens`` with ``pairs`` the (query, key)
  pairs the causal segment mask lets attend: only the work the model needs. The tiled kernel
  skips the tiles of other segments, so at long packed rows the first two count pairs it never
  computes; this one does not.

Prints one JSON line ``{"tokens_per_s", "mfu", "mfu_palm", "mfu_visible", "overhead_ratio",
...}`` with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-byte")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--chunk-rows", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--matmul-n", type=int, default=2048)  # 1024 reads low on 2 cores
    p.add_argument("--attention", default="auto", help="Model.attention (auto: by backend)")
    p.add_argument("--attention-block", type=int, default=None, help="default: the model's")
    p.add_argument("--compute-dtype", default="auto", help="Model.compute_dtype")
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    p.add_argument("--profile", default=None, help="trace 3 of our steps here; table to stderr")
    return p.parse_args()


def main() -> None:
    args = _parse()
    # One CPU device: the comparison is our step vs a plain jit on the same device.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    from jaxrl_orch.algorithms import losses
    from jaxrl_orch.algorithms.packing import pack_samples
    from jaxrl_orch.compose import precision
    from jaxrl_orch.config.load import make_config
    from jaxrl_orch.models.transformer import get_config
    from jaxrl_orch.trainer import optim as optim_lib
    from jaxrl_orch.trainer import step as step_lib
    from jaxrl_orch.trainer.trainer import RowLayout, Trainer
    from jaxrl_orch.types import Sample

    cfg = get_config(args.model)
    # The model a run builds on this backend (compose/precision.py), unless told otherwise.
    run_cfg = make_config(
        {"Model.attention": args.attention, "Model.compute_dtype": args.compute_dtype}
    )
    cfg = precision.accel_model_config(cfg, run_cfg)
    if args.attention_block:
        cfg = dataclasses.replace(cfg, attention_block=args.attention_block)
    dtype = cfg.dtype
    rng = np.random.default_rng(0)
    samples = []
    per_row = 4
    for _ in range(args.rows * per_row):
        n = args.row_len // per_row
        mask = np.arange(n) >= n // 4
        samples.append(
            Sample(
                token_ids=rng.integers(1, cfg.vocab_size, n).astype(np.int32),
                loss_mask=mask,
                logprobs=np.where(mask, rng.uniform(-6, -4, n), 0).astype(np.float32),
                advantages=np.where(mask, rng.normal(), 0).astype(np.float32),
                temperatures=np.ones(n, np.float32),
                versions=np.zeros(n, np.int32),
            )
        )
    packed = pack_samples(samples, args.row_len, num_rows=args.rows)
    arrays = {k: getattr(packed, k) for k in step_lib.BATCH_FIELDS}

    optim = optim_lib.OptimConfig(learning_rate=1e-5)
    loss_cfg = losses.PolicyLossConfig(tis_cap=None)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    trainer = Trainer(
        cfg,
        mesh,
        rows=RowLayout(row_len=args.row_len),
        step=step_lib.StepConfig(chunk_rows=args.chunk_rows, loss=loss_cfg),
        optim=optim,
    )

    # ---- the minimal hand-written step
    graphdef = trainer.graphdef
    tx = optim_lib.make_optimizer(optim)
    params = jax.device_get(trainer.params)
    params = jax.device_put(params, jax.devices()[0])
    opt_state = tx.init(params)

    def min_loss(p, b):
        logits = nnx.merge(graphdef, p)(b["tokens"], b["positions"], b["segment_ids"])[:, :-1]
        tgt = b["tokens"][:, 1:]
        lp = losses.token_logprobs(logits, tgt, b["temperatures"][:, 1:])
        mask = b["loss_mask"][:, 1:] & (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1])
        w = mask / jnp.maximum(mask.sum(), 1)
        ratio = jnp.exp(jnp.where(mask, lp - b["logprobs"][:, 1:], 0.0))
        adv = b["advantages"][:, 1:]
        clipped = jnp.clip(ratio, 1 - loss_cfg.eps_low, 1 + loss_cfg.eps_high)
        return jnp.sum(-jnp.minimum(ratio * adv, clipped * adv) * w)

    def min_step(p, o, b):
        loss, g = jax.value_and_grad(min_loss)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    min_step = jax.jit(min_step, donate_argnums=(0, 1))

    def run_minimal():
        nonlocal params, opt_state
        params, opt_state, loss = min_step(params, opt_state, arrays)
        float(loss)
        jax.block_until_ready(params)

    def run_ours():
        trainer.train_packed(packed)

    # ---- matmul peak
    n = args.matmul_n
    # The peak of the compute dtype's matmul, accumulating in float32 as the model's do.
    a = jnp.asarray(rng.normal(size=(n, n)), dtype)
    mm = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    mm(a).block_until_ready()

    def run_matmul():
        mm(a).block_until_ready()

    for f in (run_ours, run_minimal, run_ours, run_minimal):  # compile + warm
        f()
    t_ours, t_min, t_mm = [], [], []
    for _ in range(args.iters):
        for f, acc in ((run_ours, t_ours), (run_minimal, t_min), (run_matmul, t_mm)):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    # Plus a back-to-back block: a matmul timed right after a train step runs 5-30% slow here
    # (measured 161-192 interleaved vs 202-230 GFLOP/s in a block, one run), and a low peak
    # would flatter the MFU.
    for _ in range(8):
        t0 = time.perf_counter()
        run_matmul()
        t_mm.append(time.perf_counter() - t0)
    peak = 2 * n**3 / min(t_mm)
    ours, minimal = statistics.median(t_ours), statistics.median(t_min)

    d, h, kv, hd, ff = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    n_matmul = cfg.n_layers * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * ff) + d * cfg.vocab_size
    slots = args.rows * args.row_len
    attn = cfg.n_layers * h * hd
    seg = packed.segment_ids
    pairs = sum(
        int(c) * (int(c) + 1) // 2 for row in seg for c in np.unique(row, return_counts=True)[1]
    )
    counts = {
        "mfu": 6 * n_matmul * slots + 6 * attn * args.row_len * slots,
        "mfu_palm": 6 * n_matmul * slots + 12 * attn * args.row_len * slots,
        "mfu_visible": 6 * n_matmul * slots + 12 * attn * pairs,
    }
    achieved = counts["mfu"] / ours
    result = {
        "tokens_per_s": round(packed.num_tokens / ours, 1),
        **{k: round(v / ours / peak, 4) for k, v in counts.items()},
        "overhead_ratio": round(ours / minimal, 3),
        "step_s": round(ours, 5),
        "minimal_step_s": round(minimal, 5),
        "achieved_flops": round(achieved, 1),
        "matmul_peak_flops": round(peak, 1),
        "model": args.model,
        "rows": args.rows,
        "row_len": args.row_len,
        "attention": f"{cfg.attention} (block {cfg.attention_block})",
        "compute_dtype": jnp.dtype(dtype).name,
        "real_tokens": packed.num_tokens,
        "devices": jax.device_count(),
    }
    if args.profile:
        import profiling

        jax.profiler.start_trace(args.profile)
        t0 = time.perf_counter()
        for _ in range(3):
            run_ours()
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        print(profiling.table(profiling.summarize(args.profile), wall), file=sys.stderr)
    line = json.dumps(result)
    if args.json:
        print(line)
    else:
        print(json.dumps(result, indent=2), file=sys.stdout)


if __name__ == "__main__":
    main()
