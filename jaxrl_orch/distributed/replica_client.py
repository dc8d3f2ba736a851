"""RemoteEngineClient: the orchestrator's face of one engine replica, over its HTTP contract.

Owns: one ``aiohttp.ClientSession`` to a replica served by ``serving`` (``EngineHost`` +
``make_app`` + ``HttpServer``) and the mapping of HTTP failures onto the errors the
orchestrator acts on. Same duck type as ``inference.client.EngineClient`` (``generate()`` +
``in_flight``), so ``ClientPool`` / ``RemotePool`` pin groups to remote replicas unchanged.

The contract (``serving.contract``): every route called here is one of its ``Route`` objects,
every request body is built from its request model (a sampling outside it raises pydantic's
``ValidationError`` before anything is sent), and every answer is read through its reply model,
so a reply the orchestrator cannot use (no policy version per token, a key missing) is refused
by name. ``generate`` asks for one sample and the sampled token's log-prob (a log-prob the
engine did not report comes back NaN); ``load_weights`` has the replica pull an offer from the
one weight source it was started with (a request never names an address). With an API key
every request carries ``Authorization: Bearer <key>``.

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
  naming the replica, the route and the server's message, and likewise an answer that does not
  fit the contract; no answer within ``timeout_s``: ``RuntimeError`` naming ``timeout_s``.

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
from pydantic import BaseModel, ValidationError

from jaxrl_orch.distributed.addresses import bind_of
from jaxrl_orch.serving.contract import (
    GENERATE,
    HEALTH,
    MAX_QUEUED,
    UPDATE_WEIGHTS,
    GenerateChoice,
    GenerateRequest,
    Health,
    Route,
    UpdateWeights,
    WeightsLoaded,
    WireSampling,
)
from jaxrl_orch.types import Completion, SamplingParams

# Per replica: one per request in flight, and a replica admits no more than that by default.
MAX_CONNECTIONS = MAX_QUEUED
# Idle connections are dropped before uvicorn's 5 s keep-alive ends them, so a POST (which
# aiohttp never retries) is not sent on a connection the replica is closing at that moment.
KEEPALIVE_S = 3.0
# The connection refused, reset or closed under a request, or its answer cut or garbled.
_BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)
_JSON = {"Content-Type": "application/json"}


class _Card(BaseModel):
    id: str


class _Models(BaseModel):
    data: list[_Card]


# vLLM's model list: keyed where the replica has a key (the health probe is not), so a joining
# replica that answers it with the run's key is one that takes the run's key.
MODELS = Route("GET", "/v1/models", None, _Models)


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
        self.status = status
        self.message = message
        self.from_app = from_app

    @property
    def going_down(self) -> bool:
        """503 (stopping, or no weights yet), or a 5xx the app did not write: uvicorn's own
        "Internal Server Error" for a request cut off by a shutdown."""
        return self.status == 503 or (self.status >= 500 and not self.from_app)


def wire_sampling(sampling: SamplingParams) -> WireSampling:
    """``sampling`` as the generate route's ``sampling_params`` (the sampled token's log-prob)."""
    return WireSampling(
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        max_tokens=int(sampling.max_tokens),
        seed=sampling.seed,
        stop_token_ids=[int(t) for t in sampling.stop_token_ids],
        logprobs=1,
    )


def completion(choice: GenerateChoice) -> Completion:
    """A generate answer's choice (one version per token: the contract checked it) as a
    ``Completion``."""
    return Completion(
        token_ids=choice.token_ids,
        logprobs=[math.nan if c.logprob is None else c.logprob for c in choice.logprobs.content],
        versions=choice.policy_versions,
        finish_reason=choice.finish_reason,
    )


class RemoteEngineClient:
    def __init__(
        self, address: str, *, replica: int, timeout_s: float, api_key: str | None = None
    ) -> None:
        bind_of(address, "replica address")  # refuse a bad URL here, not at the first request
        self.address = address.rstrip("/")
        self.replica = int(replica)
        self.timeout_s = float(timeout_s)
        self.in_flight = 0
        self.alive = True
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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

    async def _call(self, route: Route, body: BaseModel | None, timeout_s: float) -> Any:
        """``route``'s answer as its reply model: ``body`` as the client set it, nothing more.
        Raises ``_Status`` for an error status and ``ValueError`` for an answer that does not
        fit the contract; connection and timeout errors propagate as aiohttp / asyncio raise
        them."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        kwargs = {"headers": self._auth, "timeout": timeout}
        if body is not None:
            kwargs["headers"] = {**self._auth, **_JSON}
            kwargs["data"] = body.model_dump_json(exclude_unset=True)
        request = self._client().request(route.method, route.path, **kwargs)
        async with request as r:
            text = await r.text()
            if r.status >= 400:
                raise _Status(r.status, *_message(text))
            return _read(route.reply, text)

    async def _abandonable(self, call: Awaitable[Any]) -> Any:
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
        waiters = self._waiters
        self._waiters = set()
        for w in waiters:
            if not w.done():
                w.set_result(cause)
        return len(waiters)

    def _lost(self, cause: str) -> ReplicaLost:
        self.alive = False
        return ReplicaLost(self.replica, self.address, cause)

    def _failed(self, route: Route, cause: str) -> RuntimeError:
        where = f"replica {self.replica} at {self.address}: {route.path}"
        return RuntimeError(f"{where}: {cause}")

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """One sample of ``prompt_ids``; cancelling the awaiting task cancels it on the replica."""
        body = GenerateRequest(
            token_ids=[int(t) for t in prompt_ids], sampling_params=wire_sampling(sampling)
        )
        self.in_flight += 1
        try:
            call = self._call(GENERATE, body, self.timeout_s)
            return completion((await self._abandonable(call)).choices[0])
        except ValueError as err:  # an answer outside the contract: name the replica
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

    async def health(self, timeout_s: float) -> Health | None:
        """The replica's health answer, or None when it does not answer in time."""
        try:
            answer = await self._call(HEALTH, None, timeout_s)
        except (TimeoutError, _Status, aiohttp.ClientError, ValueError):
            self.alive = False
            return None
        self.alive = True
        return answer

    async def served_model(self, timeout_s: float) -> str:
        """The model the replica serves, asked with the run's key; a ``RuntimeError`` saying
        why when it does not answer, refuses the key or answers outside vLLM's model list."""
        try:
            cards = (await self._call(MODELS, None, timeout_s)).data
        except _Status as err:
            hint = " (it does not take the run's API key)" if err.status in (401, 403) else ""
            raise self._failed(MODELS, f"{err}{hint}") from None
        except (TimeoutError, aiohttp.ClientError, ValueError) as err:
            raise self._failed(MODELS, f"{type(err).__name__}: {err}") from None
        if len(cards) != 1:
            raise self._failed(MODELS, f"lists {len(cards)} models, not one")
        return cards[0].id

    async def load_weights(
        self,
        version: int,
        uuid: int,
        timeout_s: float,
        *,
        extra_s: float,
        layout: dict | None = None,
        part: str = "weights",
    ) -> WeightsLoaded:
        """Have the replica pull offer ``uuid`` from its weight source within ``timeout_s`` and
        serve it as ``version``; the request waits ``extra_s`` longer, for the swap (or a first
        load's engine warm-up). ``layout``: how the sender laid the arrays out
        (``source.transfer_targets``) when it is not the replica's own; ``part``: what the
        offer holds (``contract.UpdateWeights``)."""
        body = UpdateWeights(
            version=int(version),
            uuid=int(uuid),
            layout=layout,
            timeout_s=float(timeout_s),
            part=part,
        )
        try:
            call = self._call(UPDATE_WEIGHTS, body, timeout_s + extra_s)
            return await self._abandonable(call)
        except TimeoutError:
            # A replica whose pull failed says so (504, 500: WeightPullError); one that says
            # nothing past the pull's deadline is not answering at all, as if it were dead.
            cause = (
                f"no answer to {UPDATE_WEIGHTS.path} (version {version}) within "
                f"{timeout_s + extra_s:g} s (timeout_s={timeout_s:g} plus extra_s={extra_s:g})"
            )
            raise self._lost(cause) from None
        except _Status as err:
            if err.going_down:  # during the load: the pool moves on without it
                raise self._lost(str(err)) from None
            raise WeightPullError(self.replica, version, str(err)) from None
        except _BROKEN as err:
            raise self._lost(f"{type(err).__name__}: {err}") from None

    async def close(self) -> None:
        session = self._session
        self._session = None
        self._loop = None
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


def _read(model: type[BaseModel], text: str) -> Any:
    """``text`` as ``model``; a ``ValueError`` naming each field that does not fit."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        wrong = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'the answer'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise ValueError(f"the answer is not a {model.__name__}: {wrong}") from None
