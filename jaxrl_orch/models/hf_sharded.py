"""Hugging Face checkpoints read straight onto a mesh: each device reads only its own shard.

What it owns: ``HFCheckpoint(path)``, a lazy handle on an HF checkpoint directory (local or
``gs://``, through ``paths.as_path``). ``config(**overrides)`` parses its ``config.json`` and
``abstract()`` gives its model's abstract params;
``load(abstract, shardings, dtype=None)`` builds every param with
``jax.make_array_from_callback``: a device's callback maps its index into our layout to the box
of the HF tensor that covers it (``hf_import.param_names`` names the tensor, ``_to_ours`` turns
what is read into our layout), reads only those bytes, casts them on the host and returns the
shard. Local files are read with ``safe_open(...).get_slice``; ``gs://`` files with ranged reads
(the 8-byte header length and the JSON header once per file, then the byte range of the rows
needed: a box on the HF tensor's first axis is one contiguous range; other axes are cut from the
covering rows, which the devices that need them share: each byte of a tensor crosses the
network once).

Invariants: no whole tensor is ever put on a device, and while a param is built the host holds
at most its tensor's bytes as read and its shards (never the model); devices that hold the same
box (a replicated axis) share one read. Every check (config.json present, each indexed shard
file present, each tensor present, of the shape the abstract param needs and of a float storage
dtype) runs before the first array is built, and fails with one line naming the file or tensor
and what was expected. The bytes loaded are ``load_hf_checkpoint``'s, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Sharding
from safetensors import safe_open

from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.models.hf_import import (
    _to_hf,
    _to_ours,
    checkpoint_files,
    config_from_hf,
    param_names,
    read_json,
)
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.paths import as_path, is_url

# safetensors' names of the float dtypes a checkpoint may store (``hf_import.STORAGE_DTYPES``).
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# A safetensors header is a few MB even for the largest checkpoints: a bigger length means the
# file is not safetensors (or is corrupt), and it is refused before that much is read.
_MAX_HEADER = 100 * 2**20

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: its file, storage dtype, HF shape and data offset."""

    file: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int  # as the header's data_offsets span


class CheckpointFiles:
    """Byte ranges of a checkpoint directory's files: local, or ``gs://`` with one ranged GET
    per read (gcsfs's buffered file objects read ahead whole blocks; ``cat_file`` does not)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.root = as_path(path)
        self.url = is_url(self.path)
        if not self.url:
            if not os.path.isdir(self.path):
                raise FileNotFoundError(f"checkpoint directory not found: {self.path!r}")
            return
        import fsspec  # gcsfs, epath's own gs:// backend (``paths.as_path`` checked it is here)

        self._fs, self._base = fsspec.core.url_to_fs(self.path)
        try:  # ``ls``, not ``isdir``: isdir answers False for a store it cannot reach
            self._fs.ls(self._base)
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint directory not found: {self.path!r}") from None
        except Exception as exc:  # noqa: BLE001 - gcsfs raises many kinds; the cause is named
            raise OSError(f"cannot reach checkpoint {self.path!r}: {exc!r}") from exc

    def read_range(self, name: str, start: int, stop: int) -> bytes:
        if self.url:
            return self._fs.cat_file(f"{self._base.rstrip('/')}/{name}", start=start, end=stop)
        with open(os.path.join(self.path, name), "rb") as f:
            f.seek(start)
            return f.read(stop - start)


def read_header(files: CheckpointFiles, name: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone."""
    n = int.from_bytes(files.read_range(name, 0, 8), "little")
    if not 0 < n <= _MAX_HEADER:
        raise ValueError(f"{name!r} in {files.path!r} is not a safetensors file (header {n} B)")
    header = json.loads(files.read_range(name, 8, 8 + n))
    header.pop("__metadata__", None)
    return {
        key: TensorInfo(name, h["dtype"], tuple(h["shape"]), 8 + n + begin, end - begin)
        for key, h in header.items()
        for begin, end in [h["data_offsets"]]
    }


def hf_box(kind: str, box: Box, hd: int) -> tuple[Box, tuple[slice, ...]]:
    """The box of the HF tensor whose ``_to_ours`` covers ``box`` of ours, and the cut of that
    to ``box`` (heads are rows of ``hd`` in HF: a box cutting ``head_dim`` reads whole heads)."""
    whole: tuple[slice, ...] = (slice(None),) * len(box)
    if kind == "copy":
        return box, whole
    if kind == "transpose":
        return box[::-1], whole
    if kind == "in_heads":  # ours [E, H, D] <- HF [H*D, E]
        (e, (h0, h1), (d0, d1)) = box
        return ((h0 * hd, h1 * hd), e), (slice(None), slice(None), slice(d0, d1))
    if kind == "heads_out":  # ours [H, D, E] <- HF [E, H*D]
        ((h0, h1), (d0, d1), e) = box
        return (e, (h0 * hd, h1 * hd)), (slice(None), slice(d0, d1), slice(None))
    if kind == "heads":  # ours [H, D] <- HF [H*D]
        ((h0, h1), (d0, d1)) = box
        return ((h0 * hd, h1 * hd),), (slice(None), slice(d0, d1))
    raise AssertionError(kind)


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for a param of ``shape`` (``_to_hf`` traced, nothing allocated)."""
    return jax.eval_shape(lambda w: _to_hf(w, kind), jax.ShapeDtypeStruct(shape, jnp.int8)).shape


def _key(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A leaf's ``nnx.to_pure_dict`` keys (a Variable's ``.value`` step dropped)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One param to build: its HF tensor, layout kind, shape, dtype and sharding."""

    name: str
    kind: str
    tensor: TensorInfo
    shape: tuple[int, ...]
    dtype: Any
    sharding: Sharding


class HFCheckpoint:
    """See the module docstring."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.files = CheckpointFiles(path)
        self.path = self.files.path
        self._local: dict[str, Any] = {}  # local file name -> its open safe_open handle
        # gs://: the rows of the param being built, by range: devices whose boxes differ only
        # past the first HF axis (cut from the same rows) share one GET. Cleared per param, so
        # it never holds more than that one tensor.
        self._rows: dict[tuple[int, int], np.ndarray] = {}

    def config(self, **overrides: Any) -> ModelConfig:
        return config_from_hf(read_json(self.files.root / "config.json"), **overrides)

    def abstract(self) -> Any:
        """The abstract params of the checkpoint's own model (``config()``'s ``Transformer``)."""
        model = nnx.eval_shape(lambda: Transformer(self.config(), rngs=nnx.Rngs(0)))
        return nnx.split(model)[1]

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor of the checkpoint, from the headers of its files."""
        out: dict[str, TensorInfo] = {}
        for name in checkpoint_files(self.path):
            out.update(read_header(self.files, name))
        return out

    def load(self, abstract: Any, shardings: Any, dtype: Any = None) -> Any:
        """``abstract`` (e.g. ``nnx.split(nnx.eval_shape(...))[1]``) with each leaf built on
        its sharding in ``shardings`` (same structure, or one ``Sharding`` for all), in
        ``dtype`` (default: the abstract leaf's)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        if isinstance(shardings, Sharding):
            shards = [shardings] * len(leaves)
        else:  # matched by key: an nnx.State of shardings holds them bare, not in Params
            by_key = jax.tree_util.tree_flatten_with_path(
                shardings, is_leaf=lambda x: isinstance(x, Sharding)
            )[0]
            shard_of = {_key(path): s for path, s in by_key}
            shards = [shard_of[_key(path)] for path, _ in leaves]
        config = self.config()
        plan = self.plan(config, leaves, shards, dtype)
        try:
            arrays = [self._build(leaf, config.head_dim) for leaf in plan]
        finally:  # unmap the files: their pages stop counting as this process's memory
            self._local.clear()
        return jax.tree_util.tree_unflatten(treedef, arrays)

    def plan(
        self, config: ModelConfig, leaves: list[tuple[Any, Any]], shards: list[Sharding], dtype: Any
    ) -> list[Leaf]:
        """Every check of the module docstring, before anything is read past the headers."""
        names = param_names(config)
        tensors = self.tensors()
        plan = []
        for (path, want), sharding in zip(leaves, shards, strict=True):
            key = _key(path)
            where = "/".join(map(str, key))
            if key not in names:
                raise ValueError(f"param {where}: no tensor of {self.path!r} maps to it")
            name, kind = names[key]
            info = tensors.get(name)
            if info is None:
                raise KeyError(f"checkpoint {self.path!r} is missing tensor {name!r}")
            expected = hf_shape(kind, tuple(want.shape))
            if info.shape != expected:
                raise ValueError(
                    f"tensor {name!r} in {info.file!r} has shape {info.shape}, param {where} "
                    f"needs {expected}"
                )
            if info.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(
                    f"tensor {name!r} in {info.file!r} is stored as {info.dtype}; expected one "
                    f"of {sorted(SAFETENSORS_DTYPES)}"
                )
            size = int(np.prod(info.shape)) * jnp.dtype(SAFETENSORS_DTYPES[info.dtype]).itemsize
            if info.nbytes != size:
                raise ValueError(
                    f"tensor {name!r} in {info.file!r} spans {info.nbytes} bytes; its shape and "
                    f"dtype need {size} (a corrupt header)"
                )
            leaf_dtype = jnp.dtype(want.dtype if dtype is None else dtype)
            plan.append(Leaf(name, kind, info, tuple(want.shape), leaf_dtype, sharding))
        return plan

    def read(self, name: str, info: TensorInfo, box: Box) -> np.ndarray:
        """``box`` of HF tensor ``name``, in its storage dtype."""
        if self.files.url:
            return self._read_rows(info, box)
        if info.file not in self._local:
            path = os.path.join(self.path, info.file)
            self._local[info.file] = safe_open(path, framework="np")
        return self._local[info.file].get_slice(name)[tuple(slice(a, b) for a, b in box)]

    def _read_rows(self, info: TensorInfo, box: Box) -> np.ndarray:
        """The rows ``box`` spans on the first axis: one contiguous byte range; the other axes
        are cut from them."""
        (r0, r1), rest = box[0], box[1:]
        if (r0, r1) not in self._rows:
            dtype = np.dtype(jnp.dtype(SAFETENSORS_DTYPES[info.dtype]))
            row = int(np.prod(info.shape[1:], dtype=np.int64)) * dtype.itemsize
            start = info.offset + r0 * row
            data = self.files.read_range(info.file, start, start + (r1 - r0) * row)
            if len(data) != (r1 - r0) * row:  # past the end of a truncated file
                raise ValueError(
                    f"{info.file!r} in {self.path!r} is truncated (read {len(data)} B)"
                )
            self._rows[r0, r1] = np.frombuffer(data, dtype).reshape(r1 - r0, *info.shape[1:])
        return self._rows[r0, r1][(slice(None), *(slice(a, b) for a, b in rest))]

    def _build(self, leaf: Leaf, hd: int) -> jax.Array:
        try:
            return jax.make_array_from_callback(leaf.shape, leaf.sharding, self._shard_fn(leaf, hd))
        finally:
            self._rows.clear()

    def _shard_fn(self, leaf: Leaf, hd: int) -> Callable[[Any], np.ndarray]:
        done: dict[Box, np.ndarray] = {}  # devices holding the same box share one read

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
            box = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape, strict=True))
            if box not in done:
                read_box, cut = hf_box(leaf.kind, box, hd)
                ours = _to_ours(self.read(leaf.name, leaf.tensor, read_box), leaf.kind, hd)[cut]
                done[box] = np.ascontiguousarray(ours.astype(leaf.dtype, copy=False))
            return done[box]

        return shard
