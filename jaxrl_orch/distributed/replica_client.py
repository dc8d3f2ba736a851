"""RemoteEngineClient: the orchestrator's face of one engine replica, over its HTTP contract.

Owns: one ``aiohttp.ClientSession`` to a replica served by ``serving`` (``EngineHost`` +
``make_app`` + ``HttpServer``) and the mapping of HTTP failures onto the errors the
orchestrator acts on. Same duck type as ``inference.client.EngineClient`` (``generate()`` +
``in_flight``), so ``ClientPool`` / ``RemotePool`` pin groups to remote replicas unchanged.

Routes (``serving/__init__``): ``POST /inference/v1/generate`` (one sample: ``token_ids`` and
``sampling_params`` with ``logprobs: 1``; back come ``choices[0].token_ids``, the log-probs of
``choices[0].logprobs.content`` (``null`` -> NaN), ``choices[0].policy_versions`` and
``finish_reason``), ``GET /health`` and ``POST /update_weights`` ``{"version", "uuid",
"layout", "timeout_s"}``: the replica pulls the offer from the one weight source it was started
with; a request never names an address. With an API key every request carries
``Authorization: Bearer <key>``.

Errors:
- ``ReplicaLost`` (``.replica``, ``.address``, ``.cause``): the replica is gone, going or not
  answering (connection refused, reset or closed mid-request, a truncated answer, 503 from a
  replica stopping or holding no weights, a 5xx without the contract's error body, i.e. written
  by the server machinery, not the replica: uvicorn answers so for a request cut off by its
  shutdown; a weight update with no answer at all past its deadline; every request in flight
  when the pool calls ``abandon``): the caller re-dispatches the work elsewhere. ``alive``
  turns False; a later ``health()`` that answers turns it True again.
- ``WeightPullError`` (``.replica``, ``.version``): the replica answered that an update failed
  (its pull timed out, offer never made, version going backwards, no weight source); the
  message carries the server's.
- Any other 4xx / 5xx (a bad request, 429 over ``max_queued``, an engine error): ``RuntimeError``
  naming the replica, the route and the server's message; no answer within ``timeout_s``:
  ``RuntimeError`` naming ``timeout_s``.

Why aiohttp, not httpx: measured with ``benchmarks/replica_protocol.py`` at the pool's load
(64 requests in flight, each held ~0.5 s by the decode), ``httpx.AsyncClient`` spent 4-8 ms of
client CPU per request (its pool scans every connection per event; encode/httpx#3215) and fell
behind the replica; aiohttp ~0.2 ms, as cheap as the gRPC channel this replaced (~0.3 ms).

A replica that stops answering (SIGSTOP, a wedged process) keeps its connections open, so no
connection error ever comes: the pool decides it is lost (``pool.RemotePool``: no health answer
within its deadline) and calls ``abandon(cause)``, which fails every ``generate`` and
``load_weights`` in flight on it at once with ``ReplicaLost`` and closes their connections (a
replica that resumes sees its clients gone and cancels those samples).

Loop contract: every method except ``abandon`` is a coroutine for the caller's event loop and
never blocks it (``abandon`` is a plain call on that loop). The session is created lazily on the
running loop (sessions belong to one loop); a client used from a new loop (e.g. a second
``asyncio.run``) opens a new one there. Cancelling the task that awaits ``generate`` closes its
connection, which the replica sees as a client gone: it cancels the sample and frees the slot.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Sequence
from typing import Any

import aiohttp

from jaxrl_orch.distributed.addresses import bind_of
from jaxrl_orch.types import Completion, SamplingParams

GENERATE, HEALTH, UPDATE = "/inference/v1/generate", "/health", "/update_weights"
MAX_CONNECTIONS = 4096  # per replica: one per request in flight, well above a replica's slots
# Idle connections are dropped before uvicorn's 5 s keep-alive ends them, so a POST (which
# aiohttp never retries) is not sent on a connection the replica is closing at that moment.
KEEPALIVE_S = 3.0
# The connection refused, reset or closed under a request, or its answer cut or garbled.
_BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)


class ReplicaLost(RuntimeError):
    def __init__(self, replica: int, address: str, cause: str) -> None:
        super().__init__(f"replica {replica} at {address} is lost: {cause}")
        self.replica = replica
        self.address = address
        self.cause = cause


class WeightPullError(RuntimeError):
    def __init__(self, replica: int, version: int, cause: str) -> None:
        super().__init__(f"replica {replica}: loading weights version {version} failed: {cause}")
        self.replica = replica
        self.version = version


class _Status(Exception):
    """A reply with an error status: ``status``, the server's message, and whether the replica's
    app wrote it (the contract's error body) rather than the server machinery around it."""

    def __init__(self, status: int, message: str, from_app: bool) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.from_app = status, message, from_app

    @property
    def going_down(self) -> bool:
        """503 (stopping, or no weights yet), or a 5xx the app did not write: uvicorn's own
        "Internal Server Error" for a request cut off by a shutdown."""
        return self.status == 503 or (self.status >= 500 and not self.from_app)


def sampling_params(sampling: SamplingParams) -> dict[str, Any]:
    """``sampling`` as the generate route's ``sampling_params`` (the sampled token's log-prob)."""
    return {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "max_tokens": int(sampling.max_tokens),
        "seed": sampling.seed,
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "logprobs": 1,
    }


def completion(body: dict[str, Any]) -> Completion:
    """The first choice of a generate response as a ``Completion``. The staleness bound needs
    the policy version of every token: an engine that answers without ``policy_versions`` (one
    that takes its weights out of band must report the version it holds there) is refused."""
    choice = body["choices"][0]
    if len(choice.get("policy_versions") or ()) != len(choice["token_ids"]):
        raise ValueError(
            "the engine's answer has no choices[0].policy_versions with one version per token; "
            "the orchestrator bounds staleness by them (DESIGN.md section 3), so an engine "
            "serving it must report the version of every token it generates"
        )
    return Completion(
        token_ids=[int(t) for t in choice["token_ids"]],
        logprobs=[
            math.nan if c["logprob"] is None else float(c["logprob"])
            for c in choice["logprobs"]["content"]
        ],
        versions=[int(v) for v in choice["policy_versions"]],
        finish_reason=str(choice["finish_reason"]),
    )


class RemoteEngineClient:
    def __init__(
        self, address: str, *, replica: int, timeout_s: float = 600.0, api_key: str | None = None
    ) -> None:
        bind_of(address, "replica address")  # refuse a bad URL here, not at the first request
        self.address = address.rstrip("/")
        self.replica = int(replica)
        self.timeout_s = float(timeout_s)
        self.in_flight = 0
        self.alive = True
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # One per call in flight: ``abandon`` resolves them with its cause.
        self._waiters: set[asyncio.Future] = set()

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(self.address, connector=connector)
            self._loop = loop
        return self._session

    async def _call(self, method: str, route: str, body: Any, timeout_s: float) -> dict:
        """The JSON answer of ``route``; raises ``_Status`` for an error status. Connection and
        timeout errors propagate as aiohttp / asyncio raise them."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        kwargs = {"json": body} if body is not None else {}
        request = self._client().request(
            method, route, headers=self._headers, timeout=timeout, **kwargs
        )
        async with request as r:
            text = await r.text()
            if r.status >= 400:
                raise _Status(r.status, *_message(text))
            return json.loads(text)

    async def _abandonable(self, call: Awaitable[dict]) -> dict:
        """``call``'s answer, unless ``abandon`` comes first: then ``ReplicaLost`` and ``call``
        is cancelled (its connection closed). A caller's cancellation cancels ``call`` too."""
        task = asyncio.ensure_future(call)
        task.add_done_callback(_retrieve)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            if task.done():  # answered (or failed) before, or as, it was abandoned
                return task.result()
            raise self._lost(waiter.result())
        finally:
            self._waiters.discard(waiter)
            task.cancel()

    def abandon(self, cause: str) -> int:
        """Fail every call in flight now with ``ReplicaLost(cause)`` (see the module docstring);
        returns how many. Calls made later are not affected."""
        waiters, self._waiters = self._waiters, set()
        for w in waiters:
            if not w.done():
                w.set_result(cause)
        return len(waiters)

    def _lost(self, cause: str) -> ReplicaLost:
        self.alive = False
        return ReplicaLost(self.replica, self.address, cause)

    def _failed(self, route: str, cause: str) -> RuntimeError:
        return RuntimeError(f"replica {self.replica} at {self.address}: {route}: {cause}")

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """One sample of ``prompt_ids``; cancelling the awaiting task cancels it on the replica."""
        body = {
            "token_ids": [int(t) for t in prompt_ids],
            "sampling_params": sampling_params(sampling),
        }
        self.in_flight += 1
        try:
            answer = await self._abandonable(self._call("POST", GENERATE, body, self.timeout_s))
            return completion(answer)
        except ValueError as err:  # an answer the orchestrator cannot use: name the replica
            raise self._failed(GENERATE, str(err)) from None
        except TimeoutError:
            raise self._failed(GENERATE, f"no answer within timeout_s={self.timeout_s:g}") from None
        except _Status as err:
            if err.going_down:
                raise self._lost(str(err)) from None
            raise self._failed(GENERATE, str(err)) from None
        except _BROKEN as err:
            raise self._lost(f"{type(err).__name__}: {err}") from None
        finally:
            self.in_flight -= 1

    async def health(self, timeout_s: float = 5.0) -> dict | None:
        """The replica's ``GET /health`` answer, or None when it does not answer in time."""
        try:
            answer = await self._call("GET", HEALTH, None, timeout_s)
        except (TimeoutError, _Status, aiohttp.ClientError, ValueError):
            self.alive = False
            return None
        self.alive = True
        return answer

    async def load_weights(
        self,
        version: int,
        uuid: int,
        timeout_s: float,
        layout: dict | None = None,
        extra_s: float = 30.0,
        part: str = "weights",
    ) -> dict:
        """Have the replica pull offer ``uuid`` from its weight source and serve it as
        ``version``; returns ``{"version", "pull_s", "swap_s"}``. ``layout``: how the sender
        laid the arrays out (``source.transfer_targets``) when it is not the replica's own;
        ``part``: what the offer holds (``serving.schemas.UpdateWeights``)."""
        body = {"version": int(version), "uuid": int(uuid), "timeout_s": float(timeout_s)}
        if layout is not None:
            body["layout"] = layout
        if part != "weights":
            body["part"] = part
        try:
            # The request outlives the pull's own deadline by the swap (at most a decode step),
            # or the first load's engine warm-up (``extra_s``).
            return await self._abandonable(self._call("POST", UPDATE, body, timeout_s + extra_s))
        except TimeoutError:
            # A replica whose pull failed says so (504, 500: WeightPullError); one that says
            # nothing past the pull's deadline is not answering at all, as if it were dead.
            cause = (
                f"no answer to {UPDATE} (version {version}) within {timeout_s + extra_s:g} s "
                f"(timeout_s={timeout_s:g} plus extra_s={extra_s:g})"
            )
            raise self._lost(cause) from None
        except _Status as err:
            if err.going_down:  # during the load: the pool moves on without it
                raise self._lost(str(err)) from None
            raise WeightPullError(self.replica, version, str(err)) from None
        except _BROKEN as err:
            raise self._lost(f"{type(err).__name__}: {err}") from None

    async def close(self) -> None:
        session, self._session, self._loop = self._session, None, None
        if session is not None and not session.closed:
            await session.close()


def _retrieve(task: asyncio.Future) -> None:
    """Marks the error of a call nobody awaits any more (abandoned, cancelled late) as seen."""
    if not task.cancelled():
        task.exception()


def _message(text: str) -> tuple[str, bool]:
    """The server's message out of the contract's error body, True; else the body itself, cut,
    False."""
    try:
        return str(json.loads(text)["error"]["message"]), True
    except (ValueError, KeyError, TypeError):
        return text[:500] or "(empty body)", False
