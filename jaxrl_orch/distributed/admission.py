"""Replicas that join and leave a running run: the requests, and the desk that carries them.

What it owns
    ``JOIN`` and ``DRAIN``, the two routes trainer process 0's weight server takes besides its
    offers (``offer_server``): ``POST /replicas/join?url=http://HOST:PORT`` asks the run to admit
    the replica serving at that URL; ``POST /replicas/drain?url=...`` asks it to stop sending that
    replica work and answers once the replica holds none. Both sides import them from here: the
    server, and a replica's ``ask`` (``--join`` at its start, its drain on SIGTERM).
    ``JoinDesk``: the hand-off from the weight server's thread, where the requests arrive, to
    the pool's event loop, which decides them (``pool.RemotePool``), and the count of refusals.

The key rule. A join request names an address the run will then dial, so it is taken only
with the run's API key: without the key it is refused (401) before anything is dialled, and a
run without a key (loopback only) takes no joins at all. The pool then checks the replica
itself before it sends it work: it answers its health probe, serves the run's model, and
takes the run's key; a replica failing one is refused (403) naming what failed. Every refusal
is one console line naming the URL and why, and counted (``refused_total``); the run goes on.

Thread contract: ``submit`` and ``refuse`` are called from the weight server's thread;
``serve`` runs on the pool's loop for as long as the pool takes requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Awaitable, Callable

import aiohttp
from pydantic import BaseModel

from jaxrl_orch.serving.contract import Route


class Decision(BaseModel):
    """What the run answers a join or drain: ``replica`` its index in the pool (-1: none),
    ``version`` the weights it is to serve (join) or served last (drain), and why."""

    replica: int
    version: int
    message: str


JOIN = Route("POST", "/replicas/join", None, Decision)
DRAIN = Route("POST", "/replicas/drain", None, Decision)
KINDS = {JOIN.path: "join", DRAIN.path: "drain"}

MAX_SAID = 50  # refusals said on the console; all are counted
Answer = tuple[int, Decision]  # an HTTP status and its body
Handler = Callable[[str, str], Awaitable[Answer]]  # (kind, url) -> answer, on the pool's loop


class JoinDesk:
    """See the module docstring. ``has_key``: whether the run has an API key (no joins
    without one)."""

    def __init__(self, *, has_key: bool) -> None:
        self.has_key = bool(has_key)
        self._lock = threading.Lock()
        self._refused = 0
        self._serving: tuple[asyncio.AbstractEventLoop, Handler] | None = None

    @property
    def refused_total(self) -> int:
        with self._lock:
            return self._refused

    def refuse(self, url: str, why: str) -> None:
        """Count a refused join (any thread) and say so in one line; past ``MAX_SAID`` lines
        they are only counted, so a stranger's requests cannot fill the console."""
        with self._lock:
            self._refused += 1
            n = self._refused
        if n <= MAX_SAID:
            print(
                f"!! engine replica join refused: {url[:200]}: {why}; the run goes on", flush=True
            )
        if n == MAX_SAID:
            print(f"!! {MAX_SAID} joins refused: further ones are counted, not said", flush=True)

    async def serve(self, handler: Handler) -> None:
        """Take requests with ``handler`` on this loop until cancelled."""
        self._serving = (asyncio.get_running_loop(), handler)
        try:
            await asyncio.Event().wait()
        finally:
            self._serving = None

    def submit(self, kind: str, url: str) -> concurrent.futures.Future[Answer] | None:
        """``handler(kind, url)`` on the pool's loop; None while the pool takes no requests
        (the run has not started its replicas, or has stopped)."""
        serving = self._serving
        if serving is None:
            return None
        loop, handler = serving
        return asyncio.run_coroutine_threadsafe(handler(kind, url), loop)


class JoinRefused(RuntimeError):
    """The run answered a join or drain with a refusal: ``status`` and the run's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


async def ask(
    route: Route, weight_source: str, url: str, api_key: str | None, timeout_s: float
) -> Decision:
    """Ask the run whose weight server is ``weight_source`` (HOST:PORT) to ``route`` (``JOIN``
    or ``DRAIN``) the replica at ``url``, with the run's key. Raises ``JoinRefused`` on a
    refusal, aiohttp's or asyncio's errors when the run does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # A leader that is gone may also drop packets: the connection itself gets a few seconds.
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 5.0))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        where = f"http://{weight_source}{route.path}"
        async with session.request(route.method, where, params={"url": url}, headers=headers) as r:
            text = await r.text()
            if r.status >= 400:
                raise JoinRefused(r.status, _message(text))
            return Decision.model_validate_json(text)


def _message(text: str) -> str:
    """The message of the weight server's error body (``serving.errors``), else the body, cut."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500] or "(empty body)"
