"""Benchmark: how long a stop's checkpoint takes to write, for the bound a SIGTERM promises.

What it measures: the project's ``Checkpointer`` (orbax, the run's own save path) writing a
checkpoint the size of the 8B-LoRA v5e-8 run's state, timed from ``save`` to the commit
(``wait``), best of ``--reps``, into ``--dir`` (default a temporary directory on this machine's
disk). The state is the LoRA run's: ``--params_m`` million adapter parameters (rank 16 on every
projection of Llama-3.1-8B: 84 M, the 168 MB bf16 that ``jaxrl-aot`` reports moving per
version) as fp32 master weights plus their two fp32 Adam moments, ~1.0 GB in all. The frozen
base is not in it (it is the checkpoint's ``CHECKPOINT``, read at start).

It prints the write rate and the bound it gives: ``drain_timeout_s`` + the step in flight + the
write must fit the 30 s a preemption notice gives (``config.orchestrator.SAVE_AFTER_DRAIN_S``
covers the last two).

How to run
    python benchmarks/checkpoint_write.py                       # ~1.0 GB, local disk
    python benchmarks/checkpoint_write.py --params_m 8 --json   # smaller, one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jaxrl_orch.config.orchestrator import SAVE_AFTER_DRAIN_S  # noqa: E402
from jaxrl_orch.trainer.checkpoint import Checkpointer  # noqa: E402

LEAVES = 64  # adapters come in many leaves (two per projection per layer): write them so


def _state(params_m: float) -> dict[str, np.ndarray]:
    n = int(params_m * 1e6) // LEAVES
    rng = np.random.default_rng(0)
    return {f"lora_{i}": rng.standard_normal(n, dtype=np.float32) for i in range(LEAVES)}


def _write(directory: str, step: int, params: dict, moments: dict) -> float:
    ckpt = Checkpointer(directory, max_to_keep=1)
    t0 = time.perf_counter()
    ckpt.save(
        step,
        params=params,
        opt_state={"mu": moments, "nu": moments},
        rng=np.zeros(2, np.uint32),
        meta={},
        orchestrator_state={"step": step},
    )
    ckpt.wait()
    secs = time.perf_counter() - t0
    ckpt.close()
    return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params_m", type=float, default=84.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    params = _state(args.params_m)
    moments = _state(args.params_m)
    nbytes = 3 * sum(a.nbytes for a in params.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        best = min(_write(d, step, params, moments) for step in range(1, args.reps + 1))
    out = {
        "bytes": nbytes,
        "best_s": round(best, 3),
        "mb_per_s": round(nbytes / best / 1e6, 1),
        "save_after_drain_s": SAVE_AFTER_DRAIN_S,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"checkpoint of {nbytes / 1e9:.2f} GB written in {best:.2f} s "
        f"({out['mb_per_s']:.0f} MB/s, best of {args.reps}); the stop's bound leaves "
        f"{SAVE_AFTER_DRAIN_S:g} s after the drain for the step in flight and this write"
    )


if __name__ == "__main__":
    main()
