"""The engine as verifiers' training client sees it: vLLM's token-in/token-out route on loopback.

verifiers' ``TrainClient`` renders each chat turn to token ids with ``renderers`` and POSTs them
to ``<base>/inference/v1/generate`` with the rollout's trace id in ``X-Session-ID``; ``renderers``
also reads ``GET /v1/models`` once for the prompt cap. ``EngineBridge`` serves those two routes
with aiohttp inside the orchestrator's own event loop: a request is answered by awaiting the
``InferenceClient`` of the rollout that owns the session (the dispatcher's replica of its group),
so there is no thread hop and no second engine front. Every reply is recorded under its session
(``Session.replies``): the engine's ids, behaviour log-probs and per-token versions, which the
trace is later checked against (``envs.vf.traces``).

Why a socket and not an in-process transport: verifiers builds its client's HTTP stack itself
(``build_async_openai``); pointing its config at a loopback URL is the one seam it offers, and it
keeps the client exactly the one prime-rl runs against vLLM.

Invariants
- Bound to 127.0.0.1 only; the route accepts a session only while its rollout runs, so a
  request naming any other session is refused (404) and nothing is generated for it.
- Sampling keys outside ``SAMPLING_KEYS`` are refused by name (400); a temperature other than the
  rollout's is refused, since the trainer scores the tokens at the rollout's temperature.
- ``max_tokens`` is capped at the rollout's own budget (``RL.max_new_tokens``).
- Closing a session cancels its engine requests still in flight (a cancelled or timed-out
  rollout frees its engine slots at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from jaxrl_orch.types import Completion, InferenceClient, SamplingParams

SESSION_HEADER = "X-Session-ID"
# What the route takes, and the keys that change nothing here: renderers always sends
# ``logprobs=1`` (one per sampled id, which the engine always reports) and
# ``skip_special_tokens`` (no text is returned, only ids); verifiers sends
# ``routed_experts_prompt_start`` on a bridged turn (where a mixture-of-experts engine starts
# recording routing; the models here route nothing).
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "stop_token_ids",
    "n",
    "logprobs",
    "skip_special_tokens",
    "routed_experts_prompt_start",
)


class BridgeError(ValueError):
    """A request the bridge refuses: ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(eq=False)
class Session:
    """One rollout's view of the engine: its client, its sampling, the replies it got."""

    client: InferenceClient
    sampling: SamplingParams
    replies: list[Completion] = dataclasses.field(default_factory=list)
    trace_ids: list[str] = dataclasses.field(default_factory=list)
    in_flight: set[asyncio.Task] = dataclasses.field(default_factory=set)


def check_sampling_keys(keys: Any, where: str) -> None:
    """Refuse sampling keys the engine does not take, naming them and what is allowed."""
    bad = sorted(set(keys) - set(SAMPLING_KEYS))
    if bad:
        raise BridgeError(
            400,
            f"{where}: sampling keys {bad} are not supported by the engine; allowed: "
            f"{list(SAMPLING_KEYS)}",
        )


def to_sampling(params: Mapping[str, Any], rollout: SamplingParams) -> SamplingParams:
    """A request's ``sampling_params`` as the engine's, within the rollout's own sampling."""
    check_sampling_keys(params, "generate")
    try:
        return _within(params, rollout)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, BridgeError):
            raise
        raise BridgeError(400, f"sampling_params: {exc}") from None


def _within(params: Mapping[str, Any], rollout: SamplingParams) -> SamplingParams:
    if int(params.get("n", 1)) != 1:
        raise BridgeError(400, f"n={params['n']!r}: one sample per request (n=1)")
    temperature = float(params.get("temperature", rollout.temperature))
    if not math.isclose(temperature, rollout.temperature, rel_tol=0.0, abs_tol=1e-9):
        raise BridgeError(
            400,
            f"temperature {temperature:g} differs from the rollout's {rollout.temperature:g}: "
            "the trainer scores sampled tokens at the rollout's temperature; leave it unset",
        )
    max_tokens = params.get("max_tokens")
    budget = rollout.max_tokens if max_tokens is None else min(int(max_tokens), rollout.max_tokens)
    stops = (*rollout.stop_token_ids, *(int(t) for t in params.get("stop_token_ids", ())))
    return dataclasses.replace(
        rollout,
        top_p=float(params.get("top_p", rollout.top_p)),
        top_k=max(0, int(params.get("top_k", rollout.top_k))),  # vLLM's -1: off
        max_tokens=budget,
        seed=params.get("seed", rollout.seed),
        stop_token_ids=tuple(dict.fromkeys(stops)),
    )


def reply_json(request_id: str, prompt_len: int, c: Completion) -> dict[str, Any]:
    """vLLM's generate response for one completion, with its per-token policy versions."""
    content = [
        {"token": f"token_id:{t}", "logprob": None if math.isnan(lp) else lp}
        for t, lp in zip(c.token_ids, c.logprobs, strict=True)
    ]
    n = len(c.token_ids)
    return {
        "request_id": request_id,
        "choices": [
            {
                "index": 0,
                "token_ids": list(c.token_ids),
                "logprobs": {"content": content},
                "finish_reason": "abort" if c.finish_reason == "cancelled" else c.finish_reason,
                "policy_versions": list(c.versions),
            }
        ],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": n,
            "total_tokens": prompt_len + n,
        },
    }


class EngineBridge:
    def __init__(self, model: str, max_model_len: int) -> None:
        self.model = model
        self.max_model_len = int(max_model_len)
        self._sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]  # port 0: the one the OS picked
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    async def stop(self) -> None:
        for session in list(self._sessions.values()):
            self.close(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, client: InferenceClient, sampling: SamplingParams) -> Session:
        return Session(client, sampling)

    def bind(self, session: Session, trace_id: str) -> None:
        """Route ``trace_id``'s calls (verifiers mints it before its first call) to ``session``."""
        session.trace_ids.append(trace_id)
        self._sessions[trace_id] = session

    def close(self, session: Session) -> None:
        for trace_id in session.trace_ids:
            self._sessions.pop(trace_id, None)
        for task in list(session.in_flight):
            task.cancel()

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            session, ids, sampling = self._parse(request, await request.read())
        except BridgeError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=exc.status)
        task = asyncio.ensure_future(session.client.generate(ids, sampling))
        session.in_flight.add(task)
        try:
            completion = await task
        except asyncio.CancelledError:
            if task.cancelled() and not _current_cancelling():
                msg = "the rollout ended while this request ran"
                return web.json_response({"error": {"message": msg}}, status=499)
            raise
        finally:
            session.in_flight.discard(task)
        session.replies.append(completion)
        body = reply_json(f"gen-{uuid.uuid4().hex}", len(ids), completion)
        # orjson: a reply carries a log-prob object per token, and the stdlib encoder was more
        # than half of the bridge's own time per call (docs/environments.md).
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def _parse(self, request: web.Request, raw: bytes) -> tuple[Session, list[int], SamplingParams]:
        sid = request.headers.get(SESSION_HEADER)
        session = self._sessions.get(sid or "")
        if session is None:
            raise BridgeError(404, f"{SESSION_HEADER} {sid!r} names no running rollout")
        try:
            body = orjson.loads(raw)
            ids = [int(t) for t in body["token_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise BridgeError(400, f"a generate body needs token_ids: {exc}") from None
        if not ids:
            raise BridgeError(400, "token_ids is empty")
        return session, ids, to_sampling(body.get("sampling_params") or {}, session.sampling)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})


def _current_cancelling() -> bool:
    """Whether the handler itself is being cancelled (not only the engine request)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
