"""Benchmark: a cross-process weight pull (jax.experimental.transfer) vs a memcpy and a reshard.

What it measures, in one run, on the same ~``--mb`` MB of transformer-shaped fp32 params:
- ``pull_ms``: a second process (4 fake CPU devices, decode mesh tp=4) pulls the tree from this
  process's ``remote.weights.WeightOffer`` straight into its decode shardings with
  ``remote.weights.pull`` (socket transfer over loopback, shard for shard). This process
  staged the arrays once in the receiver's layout (``local_layout``), as the trainer does, and
  offers them once per pull (one ``await_pull`` serves one pull). Timed in the receiver, from
  the pull call to the last buffer ready; the first pull (connection setup) is a warm-up.
- ``memcpy_ms``: ``np.copy`` of a host buffer of the same byte count (this process).
- ``reshard_ms``: the in-process ``sharding.reshard.reshard`` of the same tree from a trainer
  mesh (fsdp=2 x tp=2, devices 0-3) onto the decode mesh (tp=4, devices 4-7) of 8 fake CPU
  devices, the single-process path the weight watcher takes.
Each time is the best of ``--reps``; the ratios ``pull/memcpy`` and ``pull/reshard`` are of the
best times. The receiver also checks the pulled values (float64 sum of every leaf).

How to run
    python benchmarks/weight_pull.py --json          # one JSON line, ~100 MB
    python benchmarks/weight_pull.py --mb 20         # human-readable, smaller
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_CHILD = len(sys.argv) > 1 and sys.argv[1] == "--child"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if _CHILD else 8}"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxrl_orch.distributed.transfer import WeightOffer, local_layout, pull  # noqa: E402
from sharding.mesh import make_meshes  # noqa: E402
from sharding.reshard import reshard  # noqa: E402
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings  # noqa: E402

D, HEADS, KV_HEADS, HEAD_DIM, D_FF = 512, 8, 2, 64, 1536
LAYER = {
    "q": (("embed", "heads", "head_dim"), (D, HEADS, HEAD_DIM)),
    "k": (("embed", "kv_heads", "head_dim"), (D, KV_HEADS, HEAD_DIM)),
    "v": (("embed", "kv_heads", "head_dim"), (D, KV_HEADS, HEAD_DIM)),
    "o": (("heads", "head_dim", "embed"), (HEADS, HEAD_DIM, D)),
    "gate": (("embed", "mlp"), (D, D_FF)),
    "up": (("embed", "mlp"), (D, D_FF)),
    "down": (("mlp", "embed"), (D_FF, D)),
    "attn_norm": (("norm",), (D,)),
}


def param_specs(mb: float) -> tuple[dict, dict]:
    """(logical axes, shapes) of a decoder of about ``mb`` MB in fp32: a third in the
    embedding and head, the rest in layers of ~12 MB."""
    vocab = max(512, int(mb * 1e6 / 3 / (2 * D * 4)) // 512 * 512)
    layer_bytes = 4 * sum(int(np.prod(s)) for _, s in LAYER.values())
    layers = max(1, round((mb * 1e6 - 2 * vocab * D * 4) / layer_bytes))
    logical = {"embedding": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "layers": []}
    shapes = {"embedding": (vocab, D), "lm_head": (D, vocab), "layers": []}
    for _ in range(layers):
        logical["layers"].append({k: ax for k, (ax, _) in LAYER.items()})
        shapes["layers"].append({k: s for k, (_, s) in LAYER.items()})
    return logical, shapes


def _decode_shardings(mb: float, devices) -> dict:
    logical, shapes = param_specs(mb)
    mesh = Mesh(np.array(devices[:4]), ("tp",))
    return resolve_shardings(logical, mesh, DECODE_RULES, shapes=shapes)


def _checksum(tree) -> float:
    return float(sum(np.asarray(x, dtype=np.float64).sum() for x in jax.tree.leaves(tree)))


def child(mb: float, address: str, uuids: list[int]) -> None:
    """The receiver: pull every uuid into tp=4 decode shardings, time each, print JSON."""
    logical, shapes = param_specs(mb)
    shardings = _decode_shardings(mb, jax.local_devices())
    targets = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s, np.float32, sharding=sh),
        shapes,
        shardings,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    times, out = [], None
    for uuid in uuids:
        del out
        t0 = time.perf_counter()
        out = pull(address, uuid, targets, timeout_s=120.0)
        times.append((time.perf_counter() - t0) * 1e3)
    pairs = zip(jax.tree.leaves(out), jax.tree.leaves(targets), strict=True)
    ok = all(x.sharding == t.sharding for x, t in pairs)
    print(json.dumps({"pull_ms": times, "checksum": _checksum(out), "shardings_ok": ok}))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run(mb: float, reps: int) -> dict:
    logical, shapes = param_specs(mb)
    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})
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
    want = _checksum(host)
    del host

    # Cross-process pull: stage once in the receiver's layout (tp=4 over local devices 0-3).
    staged = jax.block_until_ready(reshard(params, local_layout(dst_sh)))
    offer = WeightOffer()
    uuids = [offer.offer(staged) for _ in range(reps + 1)]
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", str(mb), offer.address]
        + [str(u) for u in uuids],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"receiver failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    received = json.loads(proc.stdout.strip().splitlines()[-1])
    if received["checksum"] != want or not received["shardings_ok"]:
        raise RuntimeError(f"pulled values differ: sum {received['checksum']} != {want}")
    pull_ms = min(received["pull_ms"][1:] or received["pull_ms"])

    def move():
        out = jax.block_until_ready(reshard(params, dst_sh))
        del out

    def memcpy():
        out = np.copy(flat)
        del out

    move()
    memcpy()
    reshard_ms = min(_timed(move) for _ in range(reps))
    memcpy_ms = min(_timed(memcpy) for _ in range(reps))
    return {
        "pull_ms": round(pull_ms, 2),
        "memcpy_ms": round(memcpy_ms, 2),
        "reshard_ms": round(reshard_ms, 2),
        "pull_over_memcpy": round(pull_ms / memcpy_ms, 3),
        "pull_over_reshard": round(pull_ms / reshard_ms, 3),
        "first_pull_ms": round(received["pull_ms"][0], 2),
        "bytes": int(nbytes),
        "leaves": len(jax.tree.leaves(params)),
        "reps": reps,
    }


def main() -> None:
    if _CHILD:
        child(float(sys.argv[2]), sys.argv[3], [int(u) for u in sys.argv[4:]])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="approximate MB of params")
    parser.add_argument("--reps", type=int, default=4, help="timed repetitions (best is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    if args.reps < 1 or args.mb <= 0:
        parser.error(f"--reps must be >= 1 and --mb > 0, got {args.reps}, {args.mb}")
    result = run(args.mb, args.reps)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"params: {result['bytes'] / 1e6:.1f} MB in {result['leaves']} leaves")
        print(f"cross-process pull (tp=4 -> tp=4): {result['pull_ms']:8.2f} ms")
        print(f"np.copy same size:                 {result['memcpy_ms']:8.2f} ms")
        print(f"in-process reshard 2x2 -> tp=4:    {result['reshard_ms']:8.2f} ms")
        print(
            f"pull/memcpy {result['pull_over_memcpy']:.2f}, "
            f"pull/reshard {result['pull_over_reshard']:.2f}"
        )


if __name__ == "__main__":
    main()
