"""The weight offers' wire: what trainer process 0 serves and what a replica reads, stated once.

What it owns: the one route (``OFFER``: ``GET /offers/{uuid}``), the header that opens every
answer (``OfferHeader``: per leaf its shape, dtype and distinct shards, each shard its index as
``[start, stop)`` per dimension), how an answer is framed, the shard indices both sides compute
from a sharding (``shard_indices``), the comparison a receiver makes before it reads a byte
(``check_header``), the limits both sides keep, and ``Offerer``, what a sender is to the pool.
The sender (``offer_server``) and the receiver (``offer_pull``) both import it, as the replicas'
server and client both import ``serving.contract``.

An answer, ``200`` with ``Content-Length``: an 8-byte big-endian header length H, H bytes of
the header's JSON, then the bytes of every shard in the header's order (each C-ordered, in the
leaf's dtype). A shard held by several devices (replicated) is sent once; the receiver puts it
on each of its devices with that index. Every other answer is the replicas' error body
(``serving.errors``) with a 4xx status, and the connection is closed after it.

Invariants:
- Every request carries the run's key (``Authorization: Bearer``), as the replicas' routes do.
- An offer is served once: the first authorised request for its uuid takes it, a later one
  finds nothing (404), as does one past the offer's expiry.
- The indices of a leaf are the distinct ``addressable_devices_indices_map`` values of its
  sharding, normalised and sorted (``shard_indices``), so both sides list them in one order.
- A receiver refuses a header whose leaf count, or any leaf's shape, dtype or shard indices,
  differ from its targets, naming the leaf, what came and what it expected, before it reads
  any shard: raw bytes of another dtype would decode as garbage.

Pure data: no sockets, no threads.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np
from pydantic import BaseModel, ConfigDict

from jaxrl_orch.serving.contract import Route

HEADER_LENGTH = struct.Struct(">Q")
MAX_HEADER_BYTES = 16 * 2**20  # an 8B model's header is ~100 KB
MAX_HEAD_BYTES = 64 * 2**10  # an answer's status line and headers
MAX_ERROR_BYTES = 64 * 2**10  # an error body a receiver reads
MAX_FIELD_BYTES = 1024  # a request's line and each header: an offer path, a key

Index = list[tuple[int, int]]  # a shard's [start, stop) per dimension


class LeafHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str  # the sender's name for the leaf, for messages
    shape: list[int]
    dtype: str
    shards: list[Index]

    def nbytes(self) -> int:
        per = jnp.dtype(self.dtype).itemsize
        return sum(per * int(np.prod([b - a for a, b in index])) for index in self.shards)


class OfferHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    uuid: int
    leaves: list[LeafHeader]

    def nbytes(self) -> int:
        return sum(leaf.nbytes() for leaf in self.leaves)


OFFER = Route("GET", "/offers/{uuid}", None, OfferHeader)


def offer_path(uuid: int) -> str:
    return OFFER.path.format(uuid=int(uuid))


def frame_length(header: bytes, shard_bytes: int) -> int:
    """The ``Content-Length`` of an answer whose header JSON is ``header``."""
    return HEADER_LENGTH.size + len(header) + shard_bytes


class Offerer(Protocol):
    """What the pool offers through: a fresh uuid per ``offer``, pulled once from ``address``."""

    address: str

    def offer(self, arrays: Any, *, expire_s: float | None = None) -> int: ...


def normalise(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices, as ``jax.sharding`` gives them) as ``(start, stop)`` pairs."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a shard index with step {step} cannot be sent; only step 1")
        out.append((start, stop))
    return tuple(out)


def shard_indices(sharding: Any, shape: tuple[int, ...]) -> dict[tuple, list[Any]]:
    """The distinct shard indices of ``shape`` under ``sharding``, sorted, each with the devices
    of this process that hold it."""
    held: dict[tuple, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        held.setdefault(normalise(index, tuple(shape)), []).append(device)
    return dict(sorted(held.items()))


def leaf_header(path: str, shape: tuple[int, ...], dtype: Any, sharding: Any) -> LeafHeader:
    shards = [list(index) for index in shard_indices(sharding, shape)]
    return LeafHeader(path=path, shape=list(shape), dtype=jnp.dtype(dtype).name, shards=shards)


def check_header(got: OfferHeader, expected: list[LeafHeader], uuid: int) -> None:
    """Raise ``ValueError`` unless every leaf of ``got`` is the expected one (see the module
    docstring); the message names the first leaf that differs, in the receiver's terms."""
    if got.uuid != uuid:
        raise ValueError(f"asked for offer uuid={uuid}, the sender answered with uuid={got.uuid}")
    if len(got.leaves) != len(expected):
        raise ValueError(
            f"offer uuid={uuid} holds {len(got.leaves)} arrays; this receiver expects "
            f"{len(expected)}"
        )
    for i, (leaf, want) in enumerate(zip(got.leaves, expected, strict=True)):
        differ = [
            f"{name} {getattr(leaf, name)} where {getattr(want, name)} is expected"
            for name in ("dtype", "shape", "shards")
            if getattr(leaf, name) != getattr(want, name)
        ]
        if differ:
            theirs = "" if leaf.path == want.path else f" (the sender's {leaf.path})"
            raise ValueError(
                f"offer uuid={uuid} does not fit this receiver: leaf {i} {want.path}{theirs} "
                f"came with {'; '.join(differ)}; nothing was read"
            )
