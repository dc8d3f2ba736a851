"""Hugging Face checkpoints read straight onto a mesh: each device reads only its own shard.

What it owns: ``HFCheckpoint(path)``, a lazy handle on an HF checkpoint directory (local or
``gs://``, through ``paths.as_path``). ``config(**overrides)`` parses its ``config.json`` and
``abstract()`` gives its model's abstract params;
``load(abstract, shardings, dtype=None)`` builds every param from single-device arrays: each
distinct box of our layout that an addressable device holds maps to the box of the HF tensor
that covers it (``hf_import.param_names`` names the tensor, ``_to_ours`` turns what is read
into our layout); only those bytes are read, cast on the host into the box's own buffer and
copied onto every device that holds that box.

How bytes are read: by byte range, local files and ``gs://`` alike (``pread`` on a local file,
one ranged GET on ``gs://``; the 8-byte header length and the JSON header once per file). A box
on the HF tensor's first axis is one contiguous range of rows; other axes are cut from the
covering rows. Local files are not mmapped: every page a ``safe_open`` slice touches counts in
the process's RSS until the file is unmapped, so a load through mmap peaks at about the whole
checkpoint over what the devices hold; ``pread`` copies from the page cache into a buffer of
ours that is freed as soon as it has been cut.

How the host stays small: the boxes that share their HF rows (they differ only on the axes cut
from those rows) are built together, the rows read in chunks of at most ``_CHUNK`` bytes (or
one row), each chunk read once and cut straight into every box of the group (the cut, the
layout change and the cast are one copy), so each byte of a tensor is read once and the host
holds at most one group's boxes (the rows of a tensor one device row of the mesh holds) plus
one chunk. The group's boxes go onto their devices and are waited for before the next group is
read: an accelerator copies a box, and its buffer is freed then; CPU devices adopt the buffer
itself (zero copy), so there it is the shard. Each box is an anonymous map of its own,
returned to the system when its last view goes (glibc would keep freed heap chunks below its
mmap threshold, up to 32 MB, and the peak would grow with the heap's holes); local chunks land
in one such buffer, reused through the load and dropped at its end.

Invariants: no whole tensor is ever put on a device (each device gets only its own shard), and
while a param is built the host holds at most one group of its boxes and one chunk (never the
model); devices that hold the same box (a replicated axis) share one read. Every check
(config.json present, each indexed shard file present, each tensor present, of the shape the
abstract param needs and of a float storage dtype) runs before the first array is built, and
fails with one line naming the file or tensor and what was expected. The bytes loaded are
``load_hf_checkpoint``'s, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Sharding

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
# The most bytes one read returns (or one row, a head's rows where rows are heads, if bigger):
# small against the tensors that matter, so what the host holds beyond the boxes being built
# stays small; large enough that a gs:// GET is efficient.
_CHUNK = 16 * 2**20
# The axis of our layout that is the HF tensor's first axis (its rows), per layout kind: the
# boxes that span the same range on it are cut from the same rows.
_ROW_AXIS = {"copy": 0, "heads": 0, "in_heads": 1, "heads_out": 2, "transpose": -1}

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: its file, storage dtype, HF shape and data offset."""

    file: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int  # as the header's data_offsets span


def host_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised host array on an anonymous map of its own (see the module docstring),
    unmapped when its last view goes."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # the default, MAP_SHARED, is shmem
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=flags)
    return np.frombuffer(buffer, dtype, count).reshape(shape)


class CheckpointFiles:
    """Byte ranges of a checkpoint directory's files: local (``pread``), or ``gs://`` with one
    ranged GET per read (gcsfs's buffered file objects read ahead whole blocks; ``cat_file``
    does not)."""

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

    def read_range(
        self, name: str, start: int, stop: int, out: np.ndarray | None = None
    ) -> bytes | np.ndarray:
        """Bytes ``start:stop`` of file ``name``, fewer past its end; a local read lands at the
        start of ``out`` (uint8, long enough) when given, a ``gs://`` one in the GET's bytes."""
        if self.url:
            return self._fs.cat_file(f"{self._base.rstrip('/')}/{name}", start=start, end=stop)
        if out is None:
            out = host_empty((stop - start,), np.uint8)
        out = out[: stop - start]
        view, got = memoryview(out), 0
        fd = os.open(os.path.join(self.path, name), os.O_RDONLY)
        try:
            while got < len(out):  # a read may return less than asked (at most 2 GB on Linux)
                n = os.preadv(fd, [view[got:]], start + got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        return out[:got]


def read_header(files: CheckpointFiles, name: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone."""
    n = int.from_bytes(bytes(files.read_range(name, 0, 8)), "little")
    if not 0 < n <= _MAX_HEADER:
        raise ValueError(f"{name!r} in {files.path!r} is not a safetensors file (header {n} B)")
    header = json.loads(bytes(files.read_range(name, 8, 8 + n)))
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
        # The rows last read: the boxes of one group are cut from the same chunk, read once. Only
        # that chunk is kept, and only while its param is built.
        self._rows: tuple[tuple[Any, ...], np.ndarray] | None = None
        # Where local chunks land, reused through a load: a fresh map per chunk costs its page
        # faults and zeroing again (about as long as the read itself).
        self._scratch: np.ndarray | None = None

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
        finally:
            self._scratch = None
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
        """``box`` of HF tensor ``name``, in its storage dtype: the rows it spans on the first
        axis are one contiguous byte range, kept until other rows are read; the other axes are
        cut from them."""
        (r0, r1), rest = box[0], box[1:]
        key = (info.file, info.offset, r0, r1)
        if self._rows is None or self._rows[0] != key:
            self._rows = None  # the last chunk is freed before the next is read
            dtype = np.dtype(jnp.dtype(SAFETENSORS_DTYPES[info.dtype]))
            row = int(np.prod(info.shape[1:], dtype=np.int64)) * dtype.itemsize
            start, size = info.offset + r0 * row, (r1 - r0) * row
            if not self.files.url and (self._scratch is None or len(self._scratch) < size):
                self._scratch = None  # the smaller one goes before the bigger is mapped
                self._scratch = host_empty((size,), np.uint8)
            data = self.files.read_range(info.file, start, start + size, out=self._scratch)
            if len(data) != size:  # past the end of a truncated file
                raise ValueError(
                    f"{info.file!r} in {self.path!r} is truncated (read {len(data)} B)"
                )
            self._rows = key, np.frombuffer(data, dtype).reshape(r1 - r0, *info.shape[1:])
        return self._rows[1][(slice(None), *(slice(a, b) for a, b in rest))]

    def _build(self, leaf: Leaf, hd: int) -> jax.Array:
        """``leaf`` on its sharding, one group of boxes (those sharing their HF rows) at a time:
        each box built once on the host and copied onto every device that holds it."""
        devices_of: dict[Box, list[Any]] = {}
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
            index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
            box = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape, strict=True))
            devices_of.setdefault(box, []).append(device)
        axis = _ROW_AXIS[leaf.kind] % len(leaf.shape)
        groups: dict[tuple[int, int], list[Box]] = {}
        for box in devices_of:
            groups.setdefault(box[axis], []).append(box)
        shards: list[jax.Array] = []
        try:
            for boxes in groups.values():
                hosts = self._fill(leaf, hd, axis, boxes)
                for box, host in zip(boxes, hosts, strict=True):
                    devices = devices_of[box]
                    shards += jax.device_put([host] * len(devices), devices)
                # An accelerator copies the box, and the host buffer goes once the copy is done;
                # CPU devices adopt it as it is (zero copy), so there it is the shard itself.
                jax.block_until_ready(shards)
                del hosts, host
        finally:
            self._rows = None
        return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)

    def _fill(self, leaf: Leaf, hd: int, axis: int, boxes: list[Box]) -> list[np.ndarray]:
        """``boxes`` of ``leaf`` (one range on ``axis``, the HF rows) in ``leaf.dtype``, read in
        chunks of whole rows of at most ``_CHUNK`` bytes, each chunk read once and cut into
        every box."""
        info = leaf.tensor
        itemsize = jnp.dtype(SAFETENSORS_DTYPES[info.dtype]).itemsize
        per_step = (hd if leaf.kind in ("in_heads", "heads") else 1) * int(np.prod(info.shape[1:]))
        step = max(1, _CHUNK // (per_step * itemsize))
        (a0, a1) = boxes[0][axis]
        hosts = [host_empty(tuple(b - a for a, b in box), leaf.dtype) for box in boxes]
        for c0 in range(a0, a1, step):
            c1 = min(a1, c0 + step)
            for box, host in zip(boxes, hosts, strict=True):
                read_box, cut = hf_box(leaf.kind, (*box[:axis], (c0, c1), *box[axis + 1 :]), hd)
                ours = _to_ours(self.read(leaf.name, info, read_box), leaf.kind, hd)[cut]
                # The cut, the layout change and the cast: one copy, into the box's own buffer.
                host[(slice(None),) * axis + (slice(c0 - a0, c1 - a0),)] = ours
        return hosts
