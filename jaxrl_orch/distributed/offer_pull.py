"""The receiver of a version: a replica dials the trainer's weight server and pulls one offer.

What it owns: ``pull(address, uuid, targets, timeout_s, api_key=...)``: one ``GET`` of an offer
(``offer_wire``) with the run's key, its header checked against ``targets`` before any shard is
read, every shard read into host memory and put on each of this process's devices that holds its
index (``jax.device_put``), each leaf assembled in its target sharding
(``jax.make_array_from_single_device_arrays``).

Deadline: the whole pull, connecting included, finishes within ``timeout_s`` or raises
``TimeoutError`` naming the address, the uuid and the timeout. Every read of the socket is given
only the time left, so neither a silent sender nor a trickling one outlives it; on any failure
the connection is closed and the arrays read so far are dropped with the call's frame: no thread
is started, nothing is kept.

Errors, each naming the sender and the uuid: ``ValueError`` when the header does not fit the
targets (``offer_wire.check_header``: the leaf, what came, what was expected) or the answer is
malformed; ``PullRefused`` when the sender answers with an error (no such offer: never made,
already pulled or expired; a wrong key); ``ConnectionError`` when the connection fails.

Runs in its caller's thread (a replica's pull runs in a worker thread of its HTTP server) and
opens one connection per pull. Listens nowhere.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jaxrl_orch.distributed import offer_wire as wire
from jaxrl_orch.distributed.addresses import host_port

_ALIGN = 64


class PullRefused(RuntimeError):
    """The weight server answered a pull with an error status."""


def pull(
    address: str, uuid: int, targets: Any, timeout_s: float, *, api_key: str | None = None
) -> Any:
    """Offer ``uuid`` of the weight server at ``address`` (HOST:PORT) as a pytree like
    ``targets`` (``ShapeDtypeStruct`` leaves with shardings on this process's devices)."""
    expected, treedef = expect(targets)
    leaves = jax.tree.leaves(targets)
    deadline = time.monotonic() + float(timeout_s)
    try:
        with _Wire(address, deadline) as conn:
            conn.send(_request(address, uuid, api_key))
            status, length = conn.read_head()
            if status != 200:
                raise PullRefused(f"{_where(address, uuid)}: HTTP {status}: {conn.error(length)}")
            header = _header(conn, length, uuid)
            wire.check_header(header, expected, uuid)
            arrays = [_leaf(conn, leaf, t) for leaf, t in zip(header.leaves, leaves, strict=True)]
    except TimeoutError:
        raise TimeoutError(
            f"{_where(address, uuid)} did not finish within {timeout_s} s (a sender that is "
            "stuck, or slower than the deadline)"
        ) from None
    except (OSError, EOFError) as exc:
        raise ConnectionError(f"{_where(address, uuid)} failed: {exc}") from None
    return jax.tree.unflatten(treedef, arrays)


def expect(targets: Any) -> tuple[list[wire.LeafHeader], Any]:
    """The header ``targets`` must receive, leaf for leaf, and their tree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(targets)
    out = []
    for i, (path, t) in enumerate(flat):
        if not isinstance(t, jax.ShapeDtypeStruct) or not isinstance(t.sharding, Sharding):
            raise TypeError(
                f"pull target leaf {i} must be a jax.ShapeDtypeStruct with a sharding, got {t!r}"
            )
        out.append(wire.leaf_header(jax.tree_util.keystr(path), t.shape, t.dtype, t.sharding))
    return out, treedef


def _where(address: str, uuid: int) -> str:
    return f"weight pull of uuid {uuid} from {address}"


def _request(address: str, uuid: int, api_key: str | None) -> bytes:
    lines = [f"GET {wire.offer_path(uuid)} HTTP/1.1", f"Host: {address}", "Connection: close"]
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _header(conn: _Wire, length: int | None, uuid: int) -> wire.OfferHeader:
    """The answer's header, its size and the answer's length checked first."""
    if length is None:
        raise ValueError(f"offer uuid={uuid}: the answer has no Content-Length")
    prefix = bytearray(wire.HEADER_LENGTH.size)
    conn.read_into(memoryview(prefix))
    (size,) = wire.HEADER_LENGTH.unpack(prefix)
    if size > wire.MAX_HEADER_BYTES or size > length:
        raise ValueError(
            f"offer uuid={uuid}: a header of {size} bytes (at most {wire.MAX_HEADER_BYTES})"
        )
    text = bytearray(size)
    conn.read_into(memoryview(text))
    header = wire.OfferHeader.model_validate_json(bytes(text))
    if length != wire.HEADER_LENGTH.size + size + header.nbytes():
        raise ValueError(
            f"offer uuid={uuid}: Content-Length {length} does not match its header, which "
            f"holds {header.nbytes()} bytes of shards"
        )
    return header


def _leaf(conn: _Wire, leaf: wire.LeafHeader, target: jax.ShapeDtypeStruct) -> jax.Array:
    """One leaf: each distinct shard read once, then put on every device holding its index."""
    hosts, devices = [], []
    for index, holders in wire.shard_indices(target.sharding, target.shape).items():
        host = _aligned([b - a for a, b in index], target.dtype)  # the header's order
        conn.read_into(memoryview(host.reshape(-1).view(np.uint8)))
        hosts.extend([host] * len(holders))
        devices.extend(holders)
    on_device = jax.device_put(hosts, devices)  # one batched put per leaf
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, on_device)


def _aligned(shape: list[int], dtype: Any) -> np.ndarray:
    """An empty host array whose data starts on a 64-byte boundary: a CPU device then takes it
    as it is, with no copy (measured: 100 MB put in 16 ms instead of 112 ms)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + n].view(dtype).reshape(shape)


class _Wire:
    """One connection, every read and the connect bounded by the pull's ``deadline``."""

    def __init__(self, address: str, deadline: float) -> None:
        self.deadline = deadline
        host, port = host_port(address)
        self.sock = socket.create_connection((host, port), timeout=self._left())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending = b""  # read past the head: the body's first bytes

    def __enter__(self) -> _Wire:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def send(self, data: bytes) -> None:
        self.sock.settimeout(self._left())
        self.sock.sendall(data)

    def _recv(self, view: memoryview) -> int:
        self.sock.settimeout(self._left())
        n = self.sock.recv_into(view)
        if n == 0:
            raise EOFError("the weight server closed the connection before the answer ended")
        return n

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly."""
        n = min(len(self._pending), len(view))
        view[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        while n < len(view):
            n += self._recv(view[n:])

    def read_head(self) -> tuple[int, int | None]:
        """The answer's status and ``Content-Length`` (None when it gave none)."""
        data = bytearray()
        chunk = bytearray(4096)
        while b"\r\n\r\n" not in data:
            if len(data) > wire.MAX_HEAD_BYTES:
                raise ValueError(f"the answer's head is over {wire.MAX_HEAD_BYTES} bytes")
            data += chunk[: self._recv(memoryview(chunk))]
        head, _, self._pending = bytes(data).partition(b"\r\n\r\n")
        status_line, *fields = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP answer: {status_line[:80]!r}")
        length = None
        for line in fields:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length" and value.strip().isdigit():
                length = int(value.strip())
        return int(parts[1]), length

    def error(self, length: int | None) -> str:
        """An error answer's message (the contract's error body), read within the limits."""
        size = min(length if length is not None else 0, wire.MAX_ERROR_BYTES)
        body = bytearray(size)
        self.read_into(memoryview(body))
        try:
            return str(json.loads(bytes(body))["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return bytes(body[:500]).decode("utf-8", "replace") or "(empty body)"
