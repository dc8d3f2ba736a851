"""vLLM's RL routes: token-in/token-out generation, pause and resume, weight updates.

What it owns: ``rl_routes(host, limits, metrics)``, an ``APIRouter`` with the contract's
``GENERATE`` and ``UPDATE_WEIGHTS`` (``contract``: paths and bodies),
``POST /pause?mode=keep|wait|abort`` (vLLM's default mode: abort; any other query parameter is
refused), ``POST /resume`` and ``GET /is_paused``; ``to_samplings`` (a request's sampling as one
``types.SamplingParams`` per sample) and the checks a request needs the served model for (its
vocabulary, its prompt and context lengths, its queue bound), each refusal naming the bad value
and the bound.

Invariants:
- A generate reply is a ``contract.GenerateResponse``, written here as plain data: building it
  through the models cost 3-4 times the dict's time (about 300 us against 85 us for 256
  tokens, ``timeit``), on the route that carries every rollout. A request ended by
  ``pause("abort")`` answers 200 with its partial tokens and ``finish_reason: "abort"``.
- A sample that outlives ``limits.request_timeout_s`` or whose client goes away is cancelled and
  frees its slot (``waiting.await_completions``).
- ``prompt_logprobs`` scores the prompt (``EngineHost.score``), queued before the samples so
  they reuse the scoring forward's prefix; the reply's ``prompt_logprobs`` is vLLM's shape.
- Seeds of ``n > 1`` samples follow the driver's rule: sample i of seed s gets ``s + i``.
- A weight update names an offer (``uuid``) of the one source the server was started with,
  never an address, and a pull deadline (``timeout_s``) of at most ``limits.max_pull_s``, so
  no request holds the host's load lock longer; a failed pull leaves the host serving the
  weights it had.

Driven by the app's event loop; the driver's futures are awaited, never blocked on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import uuid as uuidlib

from fastapi import APIRouter, Request

from jaxrl_orch.inference.requests import PAUSE_MODES
from jaxrl_orch.inference.scoring import PromptScores
from jaxrl_orch.serving.contract import (
    GENERATE,
    UPDATE_WEIGHTS,
    GenerateRequest,
    UpdateWeights,
    WeightsLoaded,
    WireSampling,
)
from jaxrl_orch.serving.errors import ApiError
from jaxrl_orch.serving.fastjson import JsonBytes, parse_body
from jaxrl_orch.serving.guard import Limits
from jaxrl_orch.serving.host import EngineHost, UpdateRefused
from jaxrl_orch.serving.ops import Metrics
from jaxrl_orch.serving.waiting import await_completions
from jaxrl_orch.types import Completion, SamplingParams


def rl_routes(host: EngineHost, limits: Limits, metrics: Metrics) -> APIRouter:
    router = APIRouter()

    async def generate(request: Request) -> JsonBytes:
        body = parse_body(GenerateRequest, await request.body())
        futures = submit_generate(host, body, check_generate(host, body))
        outs = await await_completions(request, futures, limits.request_timeout_s)
        scores = outs.pop(0) if body.sampling_params.prompt_logprobs is not None else None
        metrics.count_generated(sum(len(c.token_ids) for c in outs))
        request_id = body.request_id or f"gen-{uuidlib.uuid4().hex}"
        # The route's JSON both ways is ``fastjson``'s: its per-request cost is most of the
        # server's at 64 concurrent clients.
        return JsonBytes(generate_response(request_id, len(body.token_ids), outs, scores))

    # A plain Starlette route: the body is parsed here (``fastjson``), so FastAPI's dependency
    # solving has nothing to do but would still cost about 50 us per request.
    router.add_route(GENERATE.path, generate, methods=[GENERATE.method])

    @router.post("/pause")
    async def pause(request: Request, mode: str = "abort") -> dict:
        unknown = sorted(set(request.query_params) - {"mode"})
        if unknown:  # older vLLM's wait_for_inflight_requests=true, ignored, would abort instead
            raise ApiError(
                400,
                f"unknown query parameter {unknown[0]!r}; /pause takes only mode=",
                param=unknown[0],
            )
        if mode not in PAUSE_MODES:
            raise ApiError(
                400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode"
            )
        await host.pause(mode, caller=caller_of(request))
        return {"status": "paused" if host.paused else "resumed", "mode": mode}

    @router.post("/resume")
    async def resume(request: Request) -> dict:
        host.resume(caller=caller_of(request))
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": host.paused}

    @router.api_route(UPDATE_WEIGHTS.path, methods=[UPDATE_WEIGHTS.method])
    async def update_weights(body: UpdateWeights) -> WeightsLoaded:
        if body.timeout_s > limits.max_pull_s:  # checked before the load lock is waited for
            raise ApiError(
                400,
                f"timeout_s={body.timeout_s:g} is over the longest pull this server takes: "
                f"timeout_s must be at most {limits.max_pull_s:g}",
                param="timeout_s",
            )
        try:
            return await host.update_weights(
                body.version, body.uuid, body.layout, timeout_s=body.timeout_s, part=body.part
            )
        except UpdateRefused:
            raise
        except TimeoutError as exc:
            raise ApiError(
                504,
                f"pulling offer uuid={body.uuid} did not finish within timeout_s="
                f"{body.timeout_s:g} ({exc}); still serving version {host.version}",
            ) from None
        except Exception as exc:  # noqa: BLE001 - the pull failed; the server keeps serving
            raise ApiError(
                500,
                f"weight update to version {body.version} failed: {type(exc).__name__}: {exc}; "
                f"still serving version {host.version}",
            ) from None

    return router


def caller_of(request: Request) -> str:
    """The client's address, as a pause or resume it asked for is reported."""
    client = request.client
    return f"{client.host}:{client.port}" if client is not None else "an unnamed client"


def submit_generate(
    host: EngineHost, body: GenerateRequest, max_tokens: int
) -> list[concurrent.futures.Future]:
    """The request's futures: the prompt's scores first when ``prompt_logprobs`` asks (queued
    first, its forward leaves the prefix the samples reuse), then one per sample."""
    k = body.sampling_params.prompt_logprobs
    futures = []
    try:
        if k is not None:
            futures.append(host.score(body.token_ids, k))
        futures += host.submit(body.token_ids, to_samplings(body.sampling_params, max_tokens))
    except ValueError as exc:  # the engine's own limits (e.g. stop ids per slot)
        for f in futures:
            f.cancel()
        raise ApiError(400, str(exc)) from None
    return futures


def to_samplings(sp: WireSampling, max_tokens: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per sample of ``sp`` (``n`` of them), ``max_tokens`` resolved."""
    base = SamplingParams(
        temperature=float(sp.temperature),
        top_k=int(sp.top_k),
        top_p=float(sp.top_p),
        max_tokens=int(max_tokens),
        stop_token_ids=tuple(int(t) for t in sp.stop_token_ids),
        seed=sp.seed,
    )
    if sp.seed is None:
        return [base] * sp.n
    return [dataclasses.replace(base, seed=(sp.seed + i) % 2**31) for i in range(sp.n)]


def check_generate(host: EngineHost, body: GenerateRequest) -> int:
    """The request's ``max_tokens`` (resolved); raises ``ApiError`` naming what is out of
    bounds for the served model."""
    if body.model is not None and body.model != host.model:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {host.model!r}",
            param="model",
        )
    ids = body.token_ids
    sp = body.sampling_params
    n = len(ids)
    limit = host.max_prompt_len
    context = host.max_model_len
    if n > limit:
        raise ApiError(
            400,
            f"the prompt has {n} tokens; the max prompt length is {limit} "
            f"(max_model_len={context} holds prompt plus completion)",
            param="token_ids",
        )
    if sp.n > host.max_queued:  # could never be admitted: a 429 would invite endless retries
        raise ApiError(
            400,
            f"n={sp.n} samples can never be in flight at once here: max_queued={host.max_queued}",
            param="sampling_params.n",
        )
    _check_ids(host, ids, "token_ids")
    _check_ids(host, sp.stop_token_ids, "sampling_params.stop_token_ids")
    max_tokens = context - n if sp.max_tokens is None else sp.max_tokens
    if n + max_tokens > context or max_tokens < 1:
        raise ApiError(
            400,
            f"the prompt has {n} tokens and max_tokens={max_tokens}: {n + max_tokens} is past "
            f"the context of max_model_len={context}; ask for at most {context - n} tokens",
            param="sampling_params.max_tokens",
        )
    return max_tokens


def _check_ids(host: EngineHost, ids: list[int], param: str) -> None:
    vocab = host.vocab_size
    for i, t in enumerate(ids):
        if t < 0 or (vocab is not None and t >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise ApiError(
                400,
                f"{param}[{i}]={t} is outside the vocabulary: ids must be in {bound}",
                param=param,
            )


def generate_response(
    request_id: str, prompt_len: int, outs: list[Completion], scores: PromptScores | None = None
) -> dict:
    """A ``contract.GenerateResponse`` of ``outs`` (and the prompt's ``scores`` when it was
    scored) as plain data (see the module docstring)."""
    choices = []
    for i, c in enumerate(outs):
        content = [
            {
                "token": f"token_id:{t}",
                "logprob": None if math.isnan(lp) else lp,
                "bytes": None,
                "top_logprobs": [],
            }
            for t, lp in zip(c.token_ids, c.logprobs, strict=True)
        ]
        reason = "abort" if c.finish_reason == "cancelled" else c.finish_reason
        choices.append(
            {
                "index": i,
                "token_ids": list(c.token_ids),
                "logprobs": {"content": content},
                "finish_reason": reason,
                "policy_versions": list(c.versions),
            }
        )
    generated = sum(len(c.token_ids) for c in outs)
    usage = {
        "prompt_tokens": prompt_len,
        "completion_tokens": generated,
        "total_tokens": prompt_len + generated,
    }
    return {
        "request_id": request_id,
        "choices": choices,
        "prompt_logprobs": None if scores is None else prompt_logprobs(scores),
        "prompt_policy_version": None if scores is None else scores.version,
        "usage": usage,
    }


def prompt_logprobs(scores: PromptScores) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: per position, the token's own entry and its alternatives'."""
    out: list[dict[str, dict] | None] = [None]
    for token, lp, rank, top in zip(
        scores.token_ids[1:], scores.logprobs[1:], scores.ranks[1:], scores.top[1:], strict=True
    ):
        entry = {
            str(t): {"logprob": v, "rank": r, "decoded_token": None}
            for r, (t, v) in enumerate(top, 1)
        }
        entry.setdefault(str(token), {"logprob": lp, "rank": rank, "decoded_token": None})
        out.append(entry)
    return out
