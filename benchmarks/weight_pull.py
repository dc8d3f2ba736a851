"""Benchmark: a cross-process weight pull, the HTTP weight server vs jax.experimental.transfer.

What it measures, in one run, on the same arrays for both transports:
- ``weights``: ~``--mb`` MB of transformer-shaped fp32 params in a tp=4 decode layout (what a
  replica pulls each version without LoRA);
- ``lora``: ~1 MB of rank-16 fp32 adapters over 2 layers, replicated over the 4 devices (what a
  LoRA run's replica pulls each version; a replicated leaf crosses HTTP once, the transfer
  library copies it per device).
This process stages each tree once in the receiver's layout (``local_layout``), as the trainer
does, and offers it once per pull on both senders (``offer_server.HttpWeightOffer``, with a key,
and ``transfer.JaxWeightOffer``). A second process (4 fake CPU devices) pulls every offer into
its shardings, alternating the transports, timed in the receiver from the call to the last
buffer ready; the first pull of each is a warm-up. The receiver checks every pull's values
(float64 sum of every leaf). Also for the weights: ``np.copy`` of the same byte count and the
in-process ``sharding.reshard.reshard`` from a trainer mesh (fsdp=2 x tp=2, devices 0-3) onto
the decode mesh (tp=4, devices 4-7), the single-process path.

Each time is the best of ``--reps``; ``http_over_jax`` is the ratio of the best times.

How to run
    python benchmarks/weight_pull.py --json          # one JSON line per tree, ~100 MB
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from jaxrl_orch.distributed import offer_pull, transfer  # noqa: E402
from jaxrl_orch.distributed.offer_server import HttpWeightOffer  # noqa: E402
from sharding.mesh import make_meshes  # noqa: E402
from sharding.reshard import reshard  # noqa: E402
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings  # noqa: E402

D, HEADS, KV_HEADS, HEAD_DIM, D_FF, RANK = 512, 8, 2, 64, 1536, 16
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
ADAPTED = {"q": (D, D), "k": (D, D // 4), "v": (D, D // 4), "o": (D, D), "gate": (D, D_FF)}
ADAPTED |= {"up": (D, D_FF), "down": (D_FF, D)}
KEY = "benchmark-key"


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


def lora_shapes(layers: int = 2) -> list:
    """Rank-16 adapters (A: in x r, B: r x out) of every projection of ``layers`` layers."""
    return [
        {
            f"{k}_{ab}": s
            for k, (i, o) in ADAPTED.items()
            for ab, s in (("a", (i, RANK)), ("b", (RANK, o)))
        }
        for _ in range(layers)
    ]


def shardings_of(case: str, mb: float, devices) -> tuple[dict | list, dict | list]:
    """(shapes, receiver shardings) of ``case`` on a tp=4 mesh of ``devices``."""
    mesh = Mesh(np.array(devices[:4]), ("tp",))
    if case == "lora":
        shapes = lora_shapes()
        everywhere = NamedSharding(mesh, PartitionSpec())
        return shapes, jax.tree.map(lambda _: everywhere, shapes, is_leaf=_is_shape)
    logical, shapes = param_specs(mb)
    return shapes, resolve_shardings(logical, mesh, DECODE_RULES, shapes=shapes)


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def _checksum(tree) -> float:
    return float(sum(np.asarray(x, dtype=np.float64).sum() for x in jax.tree.leaves(tree)))


def child(spec: dict) -> None:
    """The receiver: pull every offer of both transports, alternating, time each, print JSON."""
    shapes, shardings = shardings_of(spec["case"], spec["mb"], jax.local_devices())
    targets = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s, np.float32, sharding=sh),
        shapes,
        shardings,
        is_leaf=_is_shape,
    )
    pulls = {
        "http": lambda u: offer_pull.pull(spec["http"], u, targets, 120.0, api_key=KEY),
        "jax": lambda u: transfer.pull(spec["jax"], u, targets, 120.0),
    }
    times: dict[str, list[float]] = {"http": [], "jax": []}
    sums = set()
    for i in range(len(spec["uuids"]["http"])):
        for name, fetch in pulls.items():
            t0 = time.perf_counter()
            out = fetch(spec["uuids"][name][i])
            times[name].append((time.perf_counter() - t0) * 1e3)
            pairs = zip(jax.tree.leaves(out), jax.tree.leaves(targets), strict=True)
            ok = all(x.sharding == t.sharding for x, t in pairs)
            sums.add((_checksum(out), ok))
            del out
    print(json.dumps({"ms": times, "checks": sorted(sums)}))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _host_tree(shapes) -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda s: rng.standard_normal(s, dtype=np.float32), shapes, is_leaf=_is_shape
    )


def pull_case(case: str, mb: float, reps: int, senders: dict) -> dict:
    """Both transports' pulls of one tree (see the module docstring)."""
    shapes, dst = shardings_of(case, mb, jax.devices()[4:])
    host = _host_tree(shapes)
    staged = jax.block_until_ready(jax.device_put(host, transfer.local_layout(dst)))
    want = _checksum(host)
    uuids = {name: [s.offer(staged) for _ in range(reps + 1)] for name, s in senders.items()}
    spec = {"case": case, "mb": mb, "uuids": uuids}
    spec |= {name: s.address for name, s in senders.items()}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"receiver failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["checks"] != [[want, True]]:
        raise RuntimeError(f"pulled values or shardings differ: {got['checks']} (want sum {want})")
    best = {name: min(ms[1:] or ms) for name, ms in got["ms"].items()}
    return {
        "case": case,
        "bytes": int(sum(x.nbytes for x in jax.tree.leaves(host))),
        "leaves": len(jax.tree.leaves(host)),
        "http_ms": round(best["http"], 2),
        "jax_ms": round(best["jax"], 2),
        "http_over_jax": round(best["http"] / best["jax"], 3),
        "first_http_ms": round(got["ms"]["http"][0], 2),
        "first_jax_ms": round(got["ms"]["jax"][0], 2),
        "reps": reps,
    }


def in_process(mb: float, reps: int) -> dict:
    """``np.copy`` and the in-process reshard of the weights case's bytes, for scale."""
    logical, shapes = param_specs(mb)
    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})
    src = resolve_shardings(logical, trainer, TRAINER_RULES, shapes=shapes)
    dst = resolve_shardings(logical, decode, DECODE_RULES, shapes=shapes)
    host = _host_tree(shapes)
    params = jax.block_until_ready(jax.device_put(host, src))
    flat = np.concatenate([x.ravel() for x in jax.tree.leaves(host)])
    move = lambda: jax.block_until_ready(reshard(params, dst))  # noqa: E731
    copy = lambda: np.copy(flat)  # noqa: E731
    move(), copy()
    return {
        "memcpy_ms": round(min(_timed(copy) for _ in range(reps)), 2),
        "reshard_ms": round(min(_timed(move) for _ in range(reps)), 2),
    }


def run(mb: float, reps: int) -> list[dict]:
    senders = {"http": HttpWeightOffer(api_key=KEY), "jax": transfer.JaxWeightOffer()}
    try:
        out = [pull_case("weights", mb, reps, senders), pull_case("lora", mb, reps, senders)]
    finally:
        senders["http"].close()
    out[0] |= in_process(mb, reps)
    out[0]["http_over_memcpy"] = round(out[0]["http_ms"] / out[0]["memcpy_ms"], 3)
    return out


def main() -> None:
    if _CHILD:
        child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="approximate MB of weights")
    parser.add_argument("--reps", type=int, default=4, help="timed repetitions (best is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON line per tree")
    args = parser.parse_args()
    if args.reps < 1 or args.mb <= 0:
        parser.error(f"--reps must be >= 1 and --mb > 0, got {args.reps}, {args.mb}")
    for r in run(args.mb, args.reps):
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{r['case']}: {r['bytes'] / 1e6:.1f} MB in {r['leaves']} leaves")
        print(f"  http (offer_server):           {r['http_ms']:8.2f} ms")
        print(f"  jax.experimental.transfer:     {r['jax_ms']:8.2f} ms")
        print(f"  http/jax {r['http_over_jax']:.2f}")
        if "memcpy_ms" in r:
            print(f"  np.copy {r['memcpy_ms']:.2f} ms, in-process reshard {r['reshard_ms']:.2f} ms")


if __name__ == "__main__":
    main()
