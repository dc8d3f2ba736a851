"""The sender of every version: trainer process 0's weight offers, served over HTTP with a key.

What it owns: ``HttpWeightOffer``, an aiohttp server in a thread of its own on the run's
``--weight_source`` address, holding the offers not yet pulled (``offer_wire``: one route, one
header, then raw shard bytes); ``open_offer``, the sender ``Processes.weight_transport`` names
(this one by default, ``transfer.JaxWeightOffer`` when a run opts in).

Invariants:
- Binds only what it is given, loopback unless the run has an API key (``HttpServer.check_bind``),
  and with a key every request must carry it (``guard.key_refusal``: constant time); a request
  without it takes nothing.
- An offer is served once and expires: memory held is the offers outstanding, each dropped when
  pulled or at ``expire_s`` (checked on every request and swept each ``SWEEP_S``). Offers share
  the caller's arrays; nothing is copied until a shard is written out.
- A request that is not a keyed ``GET`` of an offer gets a 4xx and its connection closed:
  random bytes, a wrong key, an over-long line or header, a body, a bad uuid. A connection that
  sends nothing, or too little, is closed after ``idle_s``; an answer whose reader stalls is cut
  off at the offer's expiry, or after ``idle_s`` without progress. None of it touches another
  pull or the process: each connection is a task of the server's own event loop.

Replicas joining and leaving (``admission``): given a ``JoinDesk`` it also takes the keyed
``POST /replicas/join`` and ``/replicas/drain`` (the replica's URL in the query, no body) and
hands each to the pool through the desk; a join without the run's key is refused (401), counted
and said, before anything is dialled, and so is every join to a run without a key.

Driven by the pool (``offer`` from the orchestrator's event loop); ``close`` stops the thread.
Never serves anything but offers and those two requests, and never reads what a request sends
beyond its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from typing import Any

import jax
import numpy as np
from aiohttp import web

from jaxrl_orch.config.runtime import WEIGHT_TRANSPORTS
from jaxrl_orch.distributed import offer_wire as wire
from jaxrl_orch.distributed.addresses import bind_of, host_port
from jaxrl_orch.distributed.admission import DRAIN, JOIN, KINDS, JoinDesk
from jaxrl_orch.distributed.transfer import JaxWeightOffer
from jaxrl_orch.serving.errors import error_body
from jaxrl_orch.serving.guard import bearer, key_refusal
from jaxrl_orch.serving.runner import HttpServer, bind_socket

IDLE_S = 10.0  # a connection silent this long, before or during its answer, is closed
SWEEP_S = 1.0  # how often expired offers are dropped
CHUNK = 2**18  # per write: what the socket takes at once is not copied into asyncio's buffer
# aiohttp logs a traceback for every request it cannot parse: a stranger's bytes must not fill
# the trainer's console, so its errors go nowhere (each one is answered with a 4xx instead).
_QUIET = logging.getLogger(f"{__name__}.aiohttp")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False
JAX_LINE = (
    "Processes.weight_transport = 'jax': the weight port {address} (jax.experimental.transfer) "
    "has no authentication and aborts this process on malformed bytes: only on a network no "
    "one else can reach"
)


@dataclasses.dataclass
class _Offer:
    head: bytes  # the frame's length prefix and header
    shards: list[jax.Array]  # one single-device array per distinct shard, in the header's order
    nbytes: int
    deadline: float | None  # time.monotonic() past which it is dropped


class HttpWeightOffer:
    """See the module docstring. ``port`` 0 binds a free one."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        idle_s: float = IDLE_S,
        desk: JoinDesk | None = None,
    ) -> None:
        HttpServer.check_bind(host, api_key)
        self._key = bearer(api_key)
        self._desk = desk
        self.idle_s = float(idle_s)
        self._lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}
        # Random start: a receiver holding a uuid from an earlier offerer never pulls a new one.
        self._uuids = itertools.count(secrets.randbits(48))
        sock = bind_socket(host, int(port))
        self.host, self.port = host, sock.getsockname()[1]
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._up = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(sock,), name=f"weight-offers-{self.port}", daemon=True
        )
        self._thread.start()
        self._up.wait()
        if self._error is not None:
            raise RuntimeError(f"weight server on {self.address} did not start") from self._error

    @property
    def outstanding(self) -> int:
        """Offers held: made, not yet pulled, not yet dropped by the sweep."""
        with self._lock:
            return len(self._offers)

    def offer(self, arrays: Any, *, expire_s: float | None = None) -> int:
        """Hold ``arrays`` (a pytree of ``jax.Array`` held by this process, in the receiver's
        layout and dtype) for one pull under a fresh uuid, returned; with ``expire_s`` it is
        dropped if not pulled by then."""
        uuid = next(self._uuids)
        leaves, shards = [], []
        for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(arrays)[0]):
            if not isinstance(x, jax.Array) or not x.is_fully_addressable:
                raise TypeError(
                    f"offer leaf {i} must be a jax.Array held by this process, got "
                    f"{type(x).__name__}"
                )
            name = jax.tree_util.keystr(path)
            leaves.append(wire.leaf_header(name, x.shape, x.dtype, x.sharding))
            shards.extend(_distinct_shards(x))
        header = wire.OfferHeader(uuid=uuid, leaves=leaves)
        text = header.model_dump_json().encode()
        deadline = None if expire_s is None else time.monotonic() + float(expire_s)
        head = wire.HEADER_LENGTH.pack(len(text)) + text
        with self._lock:
            self._offers[uuid] = _Offer(head, shards, header.nbytes(), deadline)
        return uuid

    def close(self) -> None:
        """Stop serving (answers in flight are cut off) and drop every offer."""
        if self._thread.is_alive() and self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(30.0)
        with self._lock:
            self._offers.clear()

    def _take(self, uuid: int) -> _Offer | None:
        with self._lock:
            offer = self._offers.pop(uuid, None)
        if offer is None or (offer.deadline is not None and time.monotonic() > offer.deadline):
            return None
        return offer

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            for uuid, offer in list(self._offers.items()):
                if offer.deadline is not None and now > offer.deadline:
                    del self._offers[uuid]

    # ------------------------------------------------------------------ the server's thread

    def _main(self, sock: Any) -> None:
        try:
            asyncio.run(self._serve(sock))
        except BaseException as exc:  # noqa: BLE001 - the constructor reports it
            self._error = exc
        finally:
            self._up.set()

    async def _serve(self, sock: Any) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=wire.MAX_FIELD_BYTES)
        app.router.add_route(wire.OFFER.method, wire.OFFER.path, self._answer)
        if self._desk is not None:
            for route in (JOIN, DRAIN):
                app.router.add_route(route.method, route.path, self._admission)
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            logger=_QUIET,
            keepalive_timeout=self.idle_s,
            max_line_size=wire.MAX_FIELD_BYTES,
            max_field_size=wire.MAX_FIELD_BYTES,
            max_headers=32,
            lingering_time=0,
            shutdown_timeout=0.5,
        )
        await runner.setup()
        with contextlib.closing(sock):
            await web.SockSite(runner, sock).start()
            self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
            self._up.set()
            sweeping = asyncio.ensure_future(self._sweeping())
            try:
                await self._stopping.wait()
            finally:
                sweeping.cancel()
                await runner.cleanup()

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self._sweep()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        refusal = key_refusal(request.headers.get("Authorization"), self._key)
        if refusal is not None:
            if self._desk is not None and request.path == JOIN.path:
                self._desk.refuse(request.query.get("url", "(no url)"), f"401: {refusal}")
            return _error(401, refusal)
        if request.body_exists:
            return _error(400, "a weight pull sends no body")
        return await handler(request)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = request.match_info["uuid"]
        if not raw.isdigit() or len(raw) > 20:
            return _error(400, f"an offer's uuid is a decimal int, got {raw[:40]!r}")
        offer = self._take(int(raw))
        if offer is None:
            return _error(
                404, f"no offer uuid={raw} here (never offered, already pulled, or expired)"
            )
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = len(offer.head) + offer.nbytes
        response.force_close()
        try:
            async with asyncio.timeout_at(offer.deadline):
                await response.prepare(request)
                await self._stream(response, offer)
            await response.write_eof()
        except (TimeoutError, ConnectionError):
            if request.transport is not None:  # a reader that stalled, or left: cut off
                request.transport.abort()
        return response

    async def _admission(self, request: web.Request) -> web.StreamResponse:
        """A keyed join or drain (``admission``): checked here, decided by the pool."""
        kind, url = KINDS[request.path], request.query.get("url", "")
        desk = self._desk
        try:
            bind_of(url, "url")
        except ValueError as exc:
            if kind == "join":
                desk.refuse(url or "(no url)", f"400: {exc}")
            return _error(400, str(exc))
        url = url.rstrip("/")
        if kind == "join" and not desk.has_key:
            why = "this run has no API key, and a replica joins only a run with one"
            desk.refuse(url, f"403: {why}")
            return _error(403, f"{why} (--api_key_file)")
        decided = desk.submit(kind, url)
        if decided is None:
            return _error(503, "the run is not taking replicas now (starting or stopping)")
        status, decision = await asyncio.wrap_future(decided)
        if status >= 400:
            return _error(status, decision.message)
        return web.json_response(decision.model_dump(), status=status)

    async def _stream(self, response: web.StreamResponse, offer: _Offer) -> None:
        """The frame's head, then every shard's bytes; each write must progress in ``idle_s``."""
        await asyncio.wait_for(response.write(offer.head), self.idle_s)
        for shard in offer.shards:
            data = await _host_bytes(shard)
            for start in range(0, len(data), CHUNK):
                await asyncio.wait_for(response.write(data[start : start + CHUNK]), self.idle_s)


def _distinct_shards(x: jax.Array) -> list[jax.Array]:
    """One single-device array per distinct index of ``x``, in ``offer_wire.shard_indices``'
    order: a replicated shard is sent once."""
    first: dict[tuple, jax.Array] = {}
    for shard in x.addressable_shards:
        first.setdefault(wire.normalise(shard.index, x.shape), shard.data)
    return [first[index] for index in sorted(first)]


async def _host_bytes(shard: jax.Array) -> memoryview:
    """``shard``'s bytes, C-ordered; an accelerator's copy to the host runs off the loop."""
    if next(iter(shard.devices())).platform == "cpu":
        host = np.asarray(shard)
    else:
        host = await asyncio.to_thread(np.asarray, shard)
    return memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8))


def _error(status: int, message: str) -> web.Response:
    response = web.json_response(error_body(status, message, None), status=status)
    response.force_close()
    return response


def open_offer(
    transport: str, weight_source: str, api_key: str | None, desk: JoinDesk | None = None
) -> Any:
    """The sender ``Processes.weight_transport`` names, on ``weight_source`` (HOST:PORT):
    ``http`` (``HttpWeightOffer``, with the run's key, taking joins and drains for ``desk``) or
    ``jax`` (``JaxWeightOffer``, which prints ``JAX_LINE`` once: see its module; it takes no
    joins)."""
    host, port = host_port(weight_source)
    if transport == "http":
        return HttpWeightOffer(host, port, api_key=api_key, desk=desk)
    if transport == "jax":
        print("== weights: " + JAX_LINE.format(address=weight_source), flush=True)
        return JaxWeightOffer(host, port)
    raise ValueError(f"weight transport must be one of {WEIGHT_TRANSPORTS}, got {transport!r}")
