"""Weights between processes, device to device, over ``jax.experimental.transfer``: the opt-in.

Owns: ``JaxWeightOffer`` (the sender: a transfer server in this process, on the port the run's
replicas pull from, that offers pytrees of arrays under fresh uuids), ``local_layout`` (the
receiver's shardings rebuilt over this process's devices, for staging; both transports use it)
and ``pull`` (the receiver: fetch an offered pytree straight into target shardings, with a
deadline).

Why it is not the default (``Processes.weight_transport = 'jax'`` opts in; the default is
``offer_server`` / ``offer_pull``): a transfer server has no authentication (anyone who reaches
its port reads an offer by its uuid), it cannot bind a Unix socket (only HOST:PORT; and
``localhost:0`` binds 0.0.0.0, so a host name is refused here), and its C++ socket server aborts
the whole process on a malformed frame (8 bytes of frame size 2**32, little-endian, then 64
zero bytes: SIGABRT at ``socket-server.cc:299``, rc 134), the receiver's server as much as the
sender's (``tests/distributed/test_jax_transport.py``). Any TCP listener, loopback included,
is reachable by every local user: so only on a network no one else can reach.

What the transfer API requires (jax 0.10.2, verified on CPU between two processes):
- Layout: it copies shard for shard, raw bytes, between IDENTICAL layouts. The receiver passes
  ``ShapeDtypeStruct(shape, dtype, sharding=S)`` leaves with S of the same mesh shape, axis
  names and specs as the sender's arrays, on its own devices. A different spec with the same
  shard byte size comes back silently WRONG (e.g. rows pulled as columns); a different shard
  size fails ("Async transfer object was deleted before transfers completed"). So the sender
  stages its arrays with ``reshard(arrays, local_layout(receiver_shardings))`` (and casts to
  the receiver's dtype) before ``offer``; the receiver then lands them directly in its decode
  sharding, with no host round trip and no relayout.
- One ``await_pull`` serves exactly ONE pull: a second pull of the same uuid hangs (until the
  sender's process goes away). ``offer`` therefore returns a fresh uuid per call; offer the
  same arrays once per receiver (the arrays are shared, not copied). An offer nobody pulls
  keeps its arrays alive in the transfer server, unless it was made with ``expire_s``
  (``await_pull``'s absolute ``timeout``): past it the offer is dropped, and a pull of it
  hangs like one of a uuid never offered (so the receiver's deadline reports it).
- Ports: ``start_transfer_server(client, "HOST:PORT", ["HOST:0"])`` binds the control port
  given (0: a free one; port 0 does not hang here, unlike the DCN socket flag
  ``reshard_cross_process`` uses) and free data ports; ``server.address()`` is the
  ``HOST:PORT`` a receiver connects to.
- Deadlines: ``connect`` and ``connection.pull`` return at once (a sender that is down or
  refuses the connection included) with arrays whose buffers fill in later; the wait is in
  ``block_until_ready``, which has no deadline, and ``pull``'s own ``timeout`` argument (an
  absolute ``datetime``) did NOT end the wait for a uuid never offered (still hanging after
  60 s). So ``pull`` polls ``is_ready`` until ``timeout_s`` and then drops the arrays: no
  thread is left waiting, later pulls over the same connection work and the process exits
  cleanly (verified); but each abandoned pull leaves about 0.3 MB in the transfer library.
- Addresses: every server binds the host it is given, never every interface. ``connect`` is a
  method of a server, so a receiver runs one too, on the host its caller binds (a replica: the
  host of its own URL; ``host`` of ``pull``): the receiver dials the sender for both control and
  data, and nothing dials the receiver's server (verified between 127.0.0.2 and 127.0.0.3), so
  a receiver on loopback pulls from any host it can reach.

Threads: ``pull`` blocks its caller (a replica's ``source.TransferSource``, which the HTTP
server runs in a worker thread, never on the event loop) and starts none; any number of pulls
may run at once.
One receiver-side transfer server per bind host, and one connection per (bind host, sender
address), are made lazily and kept. This module never imports orchestration or trainer code.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import secrets
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import Mesh, NamedSharding, Sharding

_POLL_S = 0.005  # how often a pull looks at its buffers: a 100 MB pull takes ~140 ms here
_lock = threading.Lock()
_receivers: dict[str, Any] = {}  # bind host -> this process's receiver-side transfer server
_connections: dict[tuple[str, str], Any] = {}  # (bind host, sender address) -> connection


def _start_server(host: str, port: int = 0) -> Any:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"a jax.experimental.transfer server needs an IP address to bind, got {host!r}: "
            "given a name (even 'localhost') it binds every interface"
        ) from None
    client = jax.local_devices()[0].client
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
    return transfer.start_transfer_server(client, f"{host}:{port}", [f"{host}:0"])


class JaxWeightOffer:
    """The sending side (the trainer group's process 0): offers pytrees to be pulled once.

    ``port`` 0 binds a free one; a fixed port is where the run's replicas were told to pull
    from (``--weight_source``), so the address is known before this process starts."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= int(port) < 65536:
            raise ValueError(f"JaxWeightOffer port must be in [0, 65536), got {port!r}")
        self._server = _start_server(host, int(port))
        self.address: str = self._server.address()
        # Random start: a receiver holding a uuid from an earlier offerer never pulls a new one.
        self._uuids = itertools.count(secrets.randbits(48))

    def offer(self, arrays: Any, *, expire_s: float | None = None) -> int:
        """Schedule one pull of ``arrays`` (a pytree of ``jax.Array`` held by this process,
        already in the receiver's layout and dtype) under a fresh uuid, returned. With
        ``expire_s`` the offer is dropped (its arrays released) if not pulled by then."""
        leaves = jax.tree.leaves(arrays)
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array) or not x.is_fully_addressable:
                raise TypeError(
                    f"offer leaf {i} must be a jax.Array held by this process, got "
                    f"{type(x).__name__}"
                )
        uuid = next(self._uuids)
        if expire_s is None:
            self._server.await_pull(uuid, arrays)
        else:
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=expire_s)
            self._server.await_pull(uuid, arrays, timeout=deadline)
        return uuid


def local_layout(shardings: Any) -> Any:
    """``shardings`` (a pytree of ``NamedSharding``) with each mesh rebuilt over the first
    ``mesh.size`` of this process's ``jax.local_devices()``: same mesh shape, axis names, axis
    types, specs and memory kinds. The layout a sender stages arrays in for a receiver whose
    decode shardings these are."""
    devices = jax.local_devices()
    meshes: dict[Mesh, Mesh] = {}

    def rebuild(s: Any) -> NamedSharding:
        if not isinstance(s, NamedSharding):
            raise TypeError(f"local_layout needs NamedSharding leaves, got {type(s).__name__}")
        mesh = s.mesh
        if mesh not in meshes:
            if len(devices) < mesh.size:
                raise ValueError(
                    f"local_layout: mesh {dict(mesh.shape)} needs {mesh.size} devices but this "
                    f"process has {len(devices)} local devices"
                )
            grid = np.empty(mesh.size, dtype=object)
            grid[:] = devices[: mesh.size]
            meshes[mesh] = Mesh(
                grid.reshape(mesh.devices.shape), mesh.axis_names, axis_types=mesh.axis_types
            )
        return NamedSharding(meshes[mesh], s.spec, memory_kind=s.memory_kind)

    return jax.tree.map(rebuild, shardings, is_leaf=lambda x: isinstance(x, Sharding))


def _connection(address: str, host: str) -> Any:
    with _lock:
        if (host, address) not in _connections:
            if host not in _receivers:
                _receivers[host] = _start_server(host)
            _connections[host, address] = _receivers[host].connect(address)
        return _connections[host, address]


def _check_targets(targets: Any) -> None:
    for i, t in enumerate(jax.tree.leaves(targets)):
        if not isinstance(t, jax.ShapeDtypeStruct) or not isinstance(t.sharding, Sharding):
            raise TypeError(
                f"pull target leaf {i} must be a jax.ShapeDtypeStruct with a sharding, got {t!r}"
            )


def pull(
    address: str, uuid: int, targets: Any, timeout_s: float, *, host: str = "127.0.0.1"
) -> Any:
    """Fetch the pytree offered under ``uuid`` at ``address`` into ``targets`` (a pytree of
    ``ShapeDtypeStruct`` with shardings, in the sender's layout on this process's devices),
    through this process's receiver server on ``host`` (the caller's own bind address).

    Returns the arrays once every buffer has arrived; raises ``TimeoutError`` naming the
    address and uuid when that takes longer than ``timeout_s``.
    """
    _check_targets(targets)
    deadline = time.monotonic() + timeout_s
    out = _connection(address, host).pull(int(uuid), targets)
    while not all(x.is_ready() for x in jax.tree.leaves(out)):
        if time.monotonic() >= deadline:
            del out  # abandoned: its buffers go with it, and no thread waits on them
            raise TimeoutError(
                f"weight pull of uuid {uuid} from {address} did not finish within {timeout_s} s "
                "(never offered, already pulled, or the sender is down or stuck)"
            )
        time.sleep(_POLL_S)
    return jax.block_until_ready(out)  # a transfer that failed raises its error here
