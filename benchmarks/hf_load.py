"""Benchmark: an HF checkpoint onto the trainer's mesh, read whole vs each device its shard.

What it measures: a synthetic Llama-layout checkpoint of about ``--params`` parameters (bf16,
grouped kv heads, untied head, several safetensors files indexed like a real one; random
weights written file by file, so the writer never holds the model) is loaded onto the trainer's
``param_shardings`` (``trainer.programs.build_programs``) on an 8-device CPU mesh (fsdp 2 x
tp 4), in bf16, each way in a fresh subprocess so its RSS is its own:

- ``whole``: the loader before ``HFCheckpoint``, ``load_hf_checkpoint`` (every tensor read whole
  into host memory, the model built on device 0) then ``jax.device_put`` onto the shardings;
- ``sharded``: ``HFCheckpoint.load`` as it is, local files read by byte range (``pread``);
- ``sharded_mmap``: the same with each read a ``safe_open`` slice (the files mmapped), as the
  loader read local files before: what the mapped pages cost.

The goal: while it loads, no device holds more than its own shard plus one tensor, and the
loader's host memory stays below 1.5x the largest tensor it reads. On CPU the 8 devices are
host memory, so the loaded model is itself in the RSS (on a TPU host it is in HBM): what the
loader costs the host is ``transient_host_bytes`` = peak RSS - the baseline - the bytes of the
loaded arrays' buffers (each buffer once: CPU devices that hold the same box may share one).

Per way: ``baseline_rss`` (after jax is up and the shardings are built, before loading),
``peak_rss`` (``ru_maxrss``), ``load_peak_over_baseline``, ``device_host_bytes`` (the loaded
arrays' distinct buffers), ``transient_host_bytes``, ``largest_tensor_bytes`` (the largest HF
tensor the load reads), ``transient_x_largest_tensor`` and ``rss_goal_met`` (<= 1.5);
``largest_read_bytes`` (the most bytes one read returned: a whole tensor for ``whole``, a chunk
of rows for ``sharded``, a box for ``sharded_mmap``); ``max_device_bytes`` (the most shard
bytes a device holds at the end), ``max_device_peak_bytes`` (the most a device held at once
during the load: everything put on it for the sharded ways, where nothing is freed; for
``whole``, device 0's whole model beside its shard) and ``device_goal_met`` (every device's
peak <= its shard + the largest tensor); ``device0_full_model_bytes`` (what device 0 held
before the reshard); ``rss_file_after`` / ``rss_anon_after`` (after the load: mapped file pages
vs the process's own memory) and ``wall_s``; the ``_x_ckpt`` fields are ratios to the
checkpoint's bytes.

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
from safetensors import safe_open  # noqa: E402
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


def _device_bytes(tree: object) -> tuple[dict, int]:
    """Shard bytes per device, and the bytes of the distinct buffers behind them."""
    per: dict = {}
    buffers: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
            buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return per, sum(buffers.values())


def _count_device_puts(put: dict) -> None:
    """Bytes ``jax.device_put`` sends to each device from now on, in ``put``."""
    device_put = jax.device_put

    def counted(x, device=None, **kwargs):
        pairs = zip(x, device, strict=True) if isinstance(device, list) else [(x, device)]
        for value, dev in pairs:
            if isinstance(dev, jax.Device):
                put[dev] = put.get(dev, 0) + np.asarray(value).nbytes
        return device_put(x, device, **kwargs)

    jax.device_put = counted


def child(path: str, how: str) -> dict:
    """One load of ``path`` onto the trainer's shardings (see the module docstring)."""
    ckpt = HFCheckpoint(path)
    config = ckpt.config(dtype=BF16, param_dtype=BF16)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))
    programs = build_programs(config, mesh, step_lib.StepConfig(), optim_lib.OptimConfig())
    largest_tensor = max(t.nbytes for t in ckpt.tensors().values())
    baseline = _rss()
    device0, reads, put = 0, [0], {}  # sizes only: holding the arrays would inflate the RSS
    start = time.perf_counter()
    if how == "whole":
        state = nnx.split(load_hf_checkpoint(path, dtype=BF16)[1])[1]
        device0 = sum(x.nbytes for x in jax.tree.leaves(state))
        params = jax.block_until_ready(jax.device_put(state, programs.param_shardings))
        del state
        reads = [largest_tensor]
    else:
        handles: dict = {}
        if how == "sharded":
            read_range = ckpt.files.read_range

            def counted_range(name, start, stop, **kwargs):
                out = read_range(name, start, stop, **kwargs)
                reads.append(len(out))
                return out

            ckpt.files.read_range = counted_range
        else:

            def mmap_read(name, info, box):
                if info.file not in handles:
                    handles[info.file] = safe_open(os.path.join(path, info.file), "np")
                out = handles[info.file].get_slice(name)[tuple(slice(a, b) for a, b in box)]
                reads.append(out.nbytes)
                return out

            ckpt.read = mmap_read
        _count_device_puts(put)
        params = jax.block_until_ready(
            ckpt.load(programs.abstract_params, programs.param_shardings)
        )
        handles.clear()  # unmapped, as the loader did once a load was done
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    held, host_bytes = _device_bytes(params)
    if how == "whole":  # device 0 held the model while the reshard made every shard
        first = jax.devices()[0]
        put = {d: n + (device0 if d == first else 0) for d, n in held.items()}
    transient = peak - baseline - host_bytes
    return {
        "baseline_rss": baseline,
        "peak_rss": peak,
        "load_peak_over_baseline": peak - baseline,
        "device_host_bytes": host_bytes,
        "transient_host_bytes": transient,
        "largest_tensor_bytes": largest_tensor,
        "transient_x_largest_tensor": round(transient / largest_tensor, 3),
        "rss_goal_met": transient <= 1.5 * largest_tensor,
        "largest_read_bytes": max(reads),
        "max_device_bytes": max(held.values()),
        "max_device_peak_bytes": max(put.values()),
        "device_goal_met": all(put[d] <= n + largest_tensor for d, n in held.items()),
        "device0_full_model_bytes": device0,
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
        for how in ("whole", "sharded", "sharded_mmap"):
            row = {"path": how, "params": n, "checkpoint_bytes": ckpt_bytes, "files": files}
            row |= {"d_model": config.d_model, "devices": 8, "mesh": "fsdp2 x tp4"}
            row |= run_child(path, how)
            for key in ("load_peak_over_baseline", "transient_host_bytes", "max_device_bytes"):
                row[f"{key}_x_ckpt"] = round(row[key] / ckpt_bytes, 3)
            print(json.dumps(row) if args.json else row, flush=True)


if __name__ == "__main__":
    main()
