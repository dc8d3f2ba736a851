"""Benchmark: an HF checkpoint onto the trainer's mesh, read whole vs each device its shard.

What it measures: a synthetic Llama-layout checkpoint of about ``--params`` parameters (bf16,
grouped kv heads, untied head, several safetensors files indexed like a real one; random
weights written file by file, so the writer never holds the model) is loaded onto the trainer's
``param_shardings`` (``trainer.programs.build_programs``) on an 8-device CPU mesh (fsdp 2 x
tp 4), in bf16, two ways, each in a fresh subprocess so its RSS is its own:

- ``whole``: today's path, ``load_hf_checkpoint`` (every tensor read whole into host memory, the
  model built on device 0) then ``jax.device_put`` onto the shardings;
- ``sharded``: ``HFCheckpoint.load``, each device's callback reading only its own box;
- ``sharded_pread``: the same, local files read as ``gs://`` ones are (the rows' byte range,
  no mmap: the mapped file pages of ``sharded`` count in its RSS while the load runs).

Per path: ``baseline_rss`` (after jax is up and the shardings are built, before loading),
``peak_rss`` (``ru_maxrss``), ``load_peak_over_baseline``, ``largest_read_bytes`` (the largest
tensor bytes one read returned: a whole tensor for ``whole``), ``device0_full_model_bytes``
(what device 0 held before the reshard: the whole model for ``whole``, nothing for
``sharded``), ``max_device_bytes`` (the most shard bytes any device holds at the end) and
``wall_s``, and ``rss_file_after`` / ``rss_anon_after`` (after the load: mapped file pages, which
``safe_open``'s mmap brings in and the kernel may drop, vs the process's own memory); the
``_x_ckpt`` fields are ratios to the checkpoint's bytes. On CPU the 8 devices
share host memory, so every device byte is also host RSS; on a TPU host ``whole`` would put the
whole model on one chip (an 8B model in bf16 fills a 16 GB chip) where ``sharded`` puts an
eighth of it on each.

How to run
    python benchmarks/hf_load.py --json                  # ~1e9 parameters (2 GB of bf16)
    python benchmarks/hf_load.py --params 2e8            # human-readable, smaller
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxrl_orch.models.configs import ModelConfig  # noqa: E402
from jaxrl_orch.models.hf_import import config_to_hf, load_hf_checkpoint, param_names  # noqa: E402
from jaxrl_orch.models.hf_sharded import HFCheckpoint, hf_shape  # noqa: E402
from jaxrl_orch.models.transformer import Transformer  # noqa: E402
from jaxrl_orch.trainer import optim as optim_lib  # noqa: E402
from jaxrl_orch.trainer import step as step_lib  # noqa: E402
from jaxrl_orch.trainer.programs import build_programs  # noqa: E402

VOCAB, LAYERS, HEAD_DIM = 32000, 16, 64
SHARD_BYTES = 500 * 10**6  # at most; a smaller checkpoint is still split in about 4 files
BF16 = jnp.dtype("bfloat16")


def llama_config(params: float) -> ModelConfig:
    """16 Llama layers (4 q heads per kv head, d_ff = 3.5 d) of about ``params`` in all: each
    layer holds 13 d^2 (q, o: 2; k, v: 0.5; MLP: 10.5), the embedding and head 2 V d."""
    a, b = 13 * LAYERS, 2 * VOCAB
    d = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
    d = max(256, int(round(d / 256)) * 256)  # whole heads, kv heads dividing tp 4
    heads = d // HEAD_DIM
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=d,
        n_layers=LAYERS,
        n_heads=heads,
        n_kv_heads=heads // 4,
        head_dim=HEAD_DIM,
        d_ff=d * 7 // 2,
        tie_embeddings=False,
        dtype=BF16,
        param_dtype=BF16,
    )


def write_checkpoint(config: ModelConfig, path: str, approx_bytes: float) -> int:
    """Random bf16 tensors in files of at most ``SHARD_BYTES`` (about 4 for a small checkpoint)
    and an index; returns the bytes written."""
    limit = min(SHARD_BYTES, approx_bytes / 4)
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]
    flat = {tuple(k): v for k, v in _flat_pure(nnx.to_pure_dict(abstract))}
    rng = np.random.default_rng(0)
    files, shard, size, weight_map, total = [], {}, 0, {}, 0

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for key, (name, kind) in param_names(config).items():
        shape = hf_shape(kind, tuple(flat[key].shape))
        tensor = (rng.standard_normal(shape, np.float32) * 0.02).astype(BF16)
        if shard and size + tensor.nbytes > limit:
            flush()
            size = 0
        shard[name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f)
    return total


def _flat_pure(tree: dict, prefix: tuple = ()) -> list:
    out = []
    for k, v in tree.items():
        out += _flat_pure(v, (*prefix, k)) if isinstance(v, dict) else [((*prefix, k), v)]
    return out


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in bytes (RssFile: mapped file pages, e.g. safetensors'
    mmap, reclaimable; RssAnon: the process's own memory)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _device_bytes(tree: object) -> dict:
    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return per


def child(path: str, how: str) -> dict:
    """One load of ``path`` onto the trainer's shardings (see the module docstring)."""
    ckpt = HFCheckpoint(path)
    config = ckpt.config(dtype=BF16, param_dtype=BF16)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))
    programs = build_programs(config, mesh, step_lib.StepConfig(), optim_lib.OptimConfig())
    baseline = _rss()
    largest = max(int(np.prod(t.shape)) * 2 for t in ckpt.tensors().values())
    device0 = 0
    start = time.perf_counter()
    if how == "whole":
        state = nnx.split(load_hf_checkpoint(path, dtype=BF16)[1])[1]
        device0 = sum(x.nbytes for x in jax.tree.leaves(state))
        params = jax.block_until_ready(jax.device_put(state, programs.param_shardings))
        del state
    else:
        reads = []  # sizes only: holding the arrays would inflate the RSS measured
        # sharded_pread: local files read as gs:// ones are (pread of the rows), not mmapped
        read = (
            ckpt.read if how == "sharded" else lambda _name, info, box: ckpt._read_rows(info, box)
        )

        def counted(name, info, box):
            out = read(name, info, box)
            reads.append(out.nbytes)
            return out

        ckpt.read = counted
        params = jax.block_until_ready(
            ckpt.load(programs.abstract_params, programs.param_shardings)
        )
        largest = max(reads)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "baseline_rss": baseline,
        "peak_rss": peak,
        "load_peak_over_baseline": peak - baseline,
        "largest_read_bytes": largest,
        "device0_full_model_bytes": device0,
        "max_device_bytes": max(_device_bytes(params).values()),
        "rss_file_after": _status_kb("RssFile"),
        "rss_anon_after": _status_kb("RssAnon"),
        "wall_s": round(wall, 2),
    }


def run_child(path: str, how: str) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", how, path],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{how} load failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[3], sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=1e9, help="about this many parameters")
    parser.add_argument("--json", action="store_true", help="print one JSON line per path")
    args = parser.parse_args()
    config = llama_config(args.params)
    with tempfile.TemporaryDirectory(prefix="hf_load-") as path:
        ckpt_bytes = write_checkpoint(config, path, 2 * args.params)
        files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
        n = ckpt_bytes // 2
        for how in ("whole", "sharded", "sharded_pread"):
            row = {"path": how, "params": n, "checkpoint_bytes": ckpt_bytes, "files": files}
            row |= {"d_model": config.d_model, "devices": 8, "mesh": "fsdp2 x tp4"}
            row |= run_child(path, how)
            for key in ("load_peak_over_baseline", "largest_read_bytes", "max_device_bytes"):
                row[f"{key}_x_ckpt"] = round(row[key] / ckpt_bytes, 3)
            print(json.dumps(row) if args.json else row, flush=True)


if __name__ == "__main__":
    main()
