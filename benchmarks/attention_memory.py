"""Train-step memory and time: the memory-efficient path vs the reference path, same run, CPU.

    python benchmarks/attention_memory.py --json            # row_len 2048, 2 rows, vocab 32k

What is compared (one model, one packed batch of ``--rows x --row-len`` tokens, one device):
- ``reference``: einsum attention (full ``[B, H, T, T]`` scores, kept for the backward pass),
  log-probs over the full ``[rows, T, V]`` float32 logits, no remat: the unoptimised step.
- ``new``: chunked attention (``--block`` x ``--block`` tiles with an online softmax and a
  written-out backward, ``models/tiled_attention.py``: ``O(T)`` residuals) and chunked
  log-probs (``--logprob-chunk`` positions at a time, ``jax.checkpoint``-ed).
- ``new+remat``: the same with ``remat="full"`` per block.

For each: peak memory of the compiled train step from ``memory_analysis()`` (arguments +
outputs - donated aliases + temporaries), and the median wall time of ``--iters`` steps after a
warm-up, interleaved so the machine's noise hits all alike. Reported as ratios to
``reference``, with the loss / grad-norm of the first step of each (equal up to float32
rounding: the same maths). Prints one JSON line with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--row-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    return p.parse_args()


def main() -> None:
    args = _parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxrl_orch.algorithms.packing import pack_samples
    from jaxrl_orch.models.configs import ModelConfig
    from jaxrl_orch.trainer import optim as optim_lib
    from jaxrl_orch.trainer import step as step_lib
    from jaxrl_orch.trainer.trainer import RowLayout, Trainer
    from jaxrl_orch.types import Sample

    base = ModelConfig(
        vocab_size=args.vocab,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        d_ff=768,
        max_seq_len=args.row_len,
    )
    variants = {
        "reference": (base, 0),
        "new": (
            dataclasses.replace(base, attention="chunked", attention_block=args.block),
            args.logprob_chunk,
        ),
        "new+remat": (
            dataclasses.replace(
                base, attention="chunked", attention_block=args.block, remat="full"
            ),
            args.logprob_chunk,
        ),
    }
    rng = np.random.default_rng(0)
    n = args.row_len
    samples = []
    for _ in range(args.rows * 2):  # two samples a row: packed segments
        m = n // 2
        mask = np.zeros(m, bool)
        mask[m // 4 :] = True
        samples.append(
            Sample(
                token_ids=rng.integers(1, args.vocab, m).astype(np.int32),
                loss_mask=mask,
                logprobs=np.where(mask, -3.0, 0.0).astype(np.float32),
                advantages=np.where(mask, rng.normal(), 0.0).astype(np.float32),
                temperatures=np.ones(m, np.float32),
                versions=np.zeros(m, np.int32),
            )
        )
    packed = pack_samples(samples, n, num_rows=args.rows)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    optim = optim_lib.OptimConfig(learning_rate=1e-4)
    arrays = {k: getattr(packed, k) for k in step_lib.BATCH_FIELDS}
    trainers, memory, first = {}, {}, {}
    for name, (cfg, chunk) in variants.items():
        step = step_lib.StepConfig(chunk_rows=args.rows, logprob_chunk=chunk)
        tr = Trainer(cfg, mesh, rows=RowLayout(row_len=n), step=step, optim=optim, seed=0)
        ma = tr._step_fn.lower(tr.params, tr.opt_state, arrays, tr.rng, None, None).compile()
        ma = ma.memory_analysis()
        memory[name] = (
            ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes
        )
        m = tr.train_packed(packed)  # compile + first step: equal maths, equal numbers
        first[name] = {"loss": m["loss"], "grad_norm": m["grad_norm"]}
        trainers[name] = tr
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.iters):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            tr.train_packed(packed)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "rows": args.rows,
        "row_len": n,
        "vocab": args.vocab,
        "block": args.block,
        "logprob_chunk": args.logprob_chunk,
        "peak_bytes": memory,
        "memory_ratio_reference_over": {k: memory["reference"] / v for k, v in memory.items()},
        "step_s": med,
        "time_ratio_over_reference": {k: v / med["reference"] for k, v in med.items()},
        "first_step": first,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k in variants:
            print(
                f"{k:<10} peak {memory[k] / 2**20:8.1f} MiB "
                f"({out['memory_ratio_reference_over'][k]:.2f}x less)  step {med[k]:.2f} s "
                f"({out['time_ratio_over_reference'][k]:.2f}x)  loss {first[k]['loss']:.6f} "
                f"grad_norm {first[k]['grad_norm']:.6f}"
            )


if __name__ == "__main__":
    main()
