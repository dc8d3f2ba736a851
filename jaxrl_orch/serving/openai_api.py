"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` (SSE streaming).

What it owns: ``openai_routes(host, timeout_s=..., tool_parser=...)``, the router ``app.make_app``
mounts; turning a validated request (``openai_schemas``) into prompt ids and one ``SamplingParams``
per choice, running it (``generation.Generation``) and answering with OpenAI's shapes
(``openai_shapes``), whole or as ``text/event-stream``.

Prompts: a completion's ``prompt`` is text (encoded with the host's tokenizer, which adds no
BOS of its own) or token ids, used as given. A chat's ``messages`` are rendered with the
checkpoint's chat template (``apply_chat_template(..., add_generation_prompt=True)``) and
encoded once, as the environments render prompts (``envs/base.py``).

Sampling: OpenAI's defaults (temperature 1, top_p 1; completions ``max_tokens`` 16; chat up
to the cache's room, ``max_model_len`` minus the prompt). Log-probs with k alternatives
(completions ``logprobs=k``, chat ``top_logprobs=k``) ask the engine for each generated token's
top k (``SamplingParams.top_logprobs``). A completions ``echo`` with ``logprobs`` also scores
the prompt (``EngineHost.score``: one prefill-shaped forward, no decode step, its prefix reused
by the samples); with ``max_tokens`` 0 nothing is decoded. Both endpoints stop at the
tokenizer's stop ids (its eos and the turn-end tokens) unless ``ignore_eos``, plus
``stop_token_ids``; the stop token is never part of the text. ``seed`` with ``n`` > 1 gives
choice i the seed ``seed + i`` (vLLM's rule), so the choices differ and each is reproducible.

Tools (chat): ``tools`` are rendered by the checkpoint's own template (``tools=``, as
``transformers`` passes them) unless ``tool_choice`` is ``none``, and each reply is parsed for
calls by the server's tool-call parser (``tool_parser``, else the one the template's format
implies: ``tool_parsers.infer_tool_parser``); ``tool_calls`` says what a reply may carry. With
tools in use the text is decoded with its special tokens (vLLM's rule for the Hermes parser:
some checkpoints mark ``<tool_call>`` special).

Refusals (``ApiError``, each naming the value and what is allowed): a ``model`` other than the
served one (404), a prompt past ``max_prompt_len`` or a prompt plus ``max_tokens`` past
``max_model_len`` (400), token ids outside the vocabulary, more stop ids than the engine holds,
a chat template that rejects the conversation. ``NotReady`` / ``Busy`` from the host reach the
app's handlers (503 / 429).

Lifetime: a request never outlives its client. Whole responses wait through
``waiting.await_completions`` (client gone or past ``timeout_s``: every sample is cancelled);
a stream cancels its samples when the client disconnects (Starlette closes the generator, or
drops it unstarted), when it fails, and past ``timeout_s`` (an error event). After headers are
sent, a failure is an ``{"error": ...}`` event followed by ``[DONE]``, as vLLM does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxrl_orch.serving.contract import GENERATE
from jaxrl_orch.serving.errors import ApiError, error_body
from jaxrl_orch.serving.generation import Generation
from jaxrl_orch.serving.openai_schemas import ChatRequest, CompletionRequest, parse_request
from jaxrl_orch.serving.openai_shapes import Reply, sse
from jaxrl_orch.serving.tool_calls import ToolUse
from jaxrl_orch.serving.tool_parsers import TOOL_PARSERS, get_tool_parser, infer_tool_parser
from jaxrl_orch.serving.tool_schemas import check_tools
from jaxrl_orch.serving.waiting import await_completions
from jaxrl_orch.types import SamplingParams

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.models.tokenizer import Tokenizer
    from jaxrl_orch.serving.host import EngineHost

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def openai_routes(
    host: EngineHost, *, timeout_s: float, tool_parser: str | None = None
) -> APIRouter:
    """``tool_parser``: the name (``tool_parsers.TOOL_PARSERS``) chat replies' tool calls are
    parsed with; None: the one the checkpoint's chat template implies, if any."""
    parser_name = tool_parser or infer_tool_parser(_template_source(host))
    parser = None if parser_name is None else get_tool_parser(parser_name)
    router = APIRouter()

    @router.post(COMPLETIONS)
    async def completions(request: Request) -> Any:
        req = parse_request(CompletionRequest, await _body(request), COMPLETIONS)
        prompt = _completion_prompt(host, req)
        tokenizer = _tokenizer(host)
        reply = Reply(False, host.model, tokenizer, req.logprobs, req.return_token_ids)
        if req.echo:
            reply.echo = _echo_text(tokenizer, req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        return await _answer(request, host, req, prompt, max_tokens, reply, timeout_s)

    @router.post(CHAT)
    async def chat_completions(request: Request) -> Any:
        req = parse_request(ChatRequest, await _body(request), CHAT)
        check_tools(req.messages, req.tools, req.tool_choice)
        tools = _tool_use(req, parser, parser_name)
        prompt = _chat_prompt(host, req, tools is not None)
        max_tokens = req.completion_limit or max(host.max_model_len - len(prompt), 1)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        reply = Reply(True, host.model, _tokenizer(host), logprobs, req.return_token_ids)
        reply.tools = tools
        if tools is not None:
            # vLLM's rule: some checkpoints mark their tool-call markers special, and a
            # reply decoded without them could not be parsed.
            req.skip_special_tokens = False
        return await _answer(request, host, req, prompt, max_tokens, reply, timeout_s)

    return router


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


def _tokenizer(host: EngineHost) -> Tokenizer:
    if host.tokenizer is None:
        raise ApiError(
            400,
            f"{host.model} is served without a tokenizer, so it has no text endpoints: use "
            f"{GENERATE.method} {GENERATE.path} with token ids",
        )
    return host.tokenizer


def _check_model(host: EngineHost, req: Any) -> None:
    if req.model is not None and req.model != host.model:
        raise ApiError(
            404,
            f"model {req.model!r} does not exist: this server serves {host.model!r}",
            param="model",
        )


def _completion_prompt(host: EngineHost, req: CompletionRequest) -> list[int]:
    _check_model(host, req)
    tokenizer = _tokenizer(host)
    if isinstance(req.prompt, str):
        return list(tokenizer.encode(req.prompt))
    vocab = host.vocab_size
    bad = [i for i in req.prompt if vocab is not None and i >= vocab]
    if bad:
        raise ApiError(
            400,
            f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab})",
            param="prompt",
        )
    return list(req.prompt)


def _echo_text(tokenizer: Tokenizer, prompt: str | list[int]) -> str:
    """The prompt as an echo writes it: as given, or its ids' text (special tokens spelled)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt, skip_special_tokens=False)


def _template_source(host: EngineHost) -> str | None:
    template = getattr(host.tokenizer, "chat_template", None)
    return getattr(template, "source", None)


def _tool_use(req: ChatRequest, parser: Any, parser_name: str | None) -> ToolUse | None:
    """The request's tool use, or None: no tools, or ``tool_choice`` ``none``."""
    mode = req.tool_mode
    if not req.tools or mode == "none":
        return None
    if parser is None:
        raise ApiError(
            400,
            "tools: this server has no tool-call parser (its chat template shows no known "
            "tool-call format); start it with --tool_call_parser, one of "
            f"{', '.join(sorted(TOOL_PARSERS))}",
            param="tools",
        )
    names = [t.function.name for t in req.tools]
    allowed = names if isinstance(mode, str) else [mode.function.name]
    return ToolUse(parser, frozenset(allowed), parallel=req.parallel_tool_calls is not False)


def _chat_prompt(host: EngineHost, req: ChatRequest, with_tools: bool) -> list[int]:
    """The conversation rendered by the checkpoint's template; its tools only when they are
    in use (``tool_choice`` ``none`` leaves them out)."""
    _check_model(host, req)
    tokenizer = _tokenizer(host)
    extra = {"tools": [t.template_entry() for t in req.tools or []]} if with_tools else {}
    try:
        text = tokenizer.apply_chat_template(
            req.conversation(), add_generation_prompt=True, **extra
        )
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    return list(tokenizer.encode(text))


def _check_lengths(host: EngineHost, n_prompt: int, max_tokens: int) -> None:
    if n_prompt == 0:
        raise ApiError(400, "the prompt is empty: give at least one token", param="prompt")
    if n_prompt > host.max_prompt_len:
        raise ApiError(
            400,
            f"the prompt has {n_prompt} tokens; this server takes at most "
            f"max_prompt_len={host.max_prompt_len}",
            param="prompt",
        )
    if n_prompt + max_tokens > host.max_model_len:
        raise ApiError(
            400,
            f"the prompt's {n_prompt} tokens plus max_tokens={max_tokens} exceed "
            f"max_model_len={host.max_model_len}: ask for at most "
            f"{host.max_model_len - n_prompt} tokens",
            param="max_tokens",
        )


def _samplings(
    host: EngineHost, req: Any, max_tokens: int, alternatives: int
) -> list[SamplingParams]:
    stop_ids = [] if req.ignore_eos else list(_tokenizer(host).stop_ids)
    stop_ids += [i for i in req.stop_token_ids if i not in stop_ids]
    limit = getattr(host.engine, "max_stop_tokens", None)
    if limit is not None and len(stop_ids) > limit:
        raise ApiError(
            400,
            f"{len(stop_ids)} stop ids {stop_ids} (the tokenizer's and stop_token_ids); this "
            f"engine holds at most max_stop_tokens={limit}",
            param="stop_token_ids",
        )
    base = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=max(req.top_k or 0, 0),
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=max_tokens,
        stop_token_ids=tuple(stop_ids),
        top_logprobs=alternatives,
    )
    seeds = [None if req.seed is None else (req.seed + i) % 2**31 for i in range(req.n)]
    return [dataclasses.replace(base, seed=seed) for seed in seeds]


async def _answer(
    request: Request,
    host: EngineHost,
    req: Any,
    prompt: list[int],
    max_tokens: int,
    reply: Reply,
    timeout_s: float,
) -> Any:
    _check_lengths(host, len(prompt), max_tokens)
    samplings = _samplings(host, req, max(max_tokens, 1), reply.logprobs or 0)
    # An echo asking for log-probs scores its prompt; max_tokens 0 (echo only) decodes nothing.
    score = reply.logprobs if reply.echo is not None and reply.logprobs is not None else None
    try:
        gen = Generation(
            host,
            prompt,
            samplings,
            stops=req.stop,
            skip_special_tokens=req.skip_special_tokens,
            score=score,
            decode=max_tokens > 0,
        )
    except (ValueError, TypeError) as exc:  # the driver's own checks of the request
        raise ApiError(400, str(exc)) from None
    if req.stream:
        events = _stream(gen, reply, req.include_usage, timeout_s)
        weakref.finalize(events, gen.cancel)  # a stream dropped before its first chunk
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        await _collect(request, gen, timeout_s)
    finally:
        gen.cancel()
    return JSONResponse(reply.body(gen))


async def _collect(request: Request, gen: Generation, timeout_s: float) -> None:
    """Run ``gen`` to the end under ``await_completions``' watch (client gone, deadline,
    engine error), through one future standing for the whole request."""
    whole: concurrent.futures.Future = concurrent.futures.Future()
    task = asyncio.ensure_future(gen.run())

    def settle(t: asyncio.Task) -> None:
        if whole.done():
            return
        if t.cancelled():
            whole.cancel()
        elif t.exception() is not None:
            whole.set_exception(t.exception())
        else:
            whole.set_result(None)

    def abandon(f: concurrent.futures.Future) -> None:
        if f.cancelled():
            task.cancel()
            gen.cancel()

    task.add_done_callback(settle)
    whole.add_done_callback(abandon)
    await await_completions(request, [whole], timeout_s)


async def _stream(
    gen: Generation, reply: Reply, include_usage: bool, timeout_s: float
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    updates = gen.updates()
    try:
        for chunk in reply.opening_chunks(gen):
            yield sse(chunk)
        while True:
            try:
                choice, delta = await asyncio.wait_for(anext(updates), deadline - loop.time())
            except StopAsyncIteration:
                break
            for chunk in reply.chunks(choice, delta):
                yield sse(chunk)
        if include_usage:
            yield sse(reply.usage_chunk(gen))
    except TimeoutError:
        yield sse(error_body(504, f"the request did not finish within timeout_s={timeout_s:g}"))
    except (RuntimeError, ValueError) as exc:  # the engine's error, this request's only
        yield sse(error_body(500, f"generation failed: {type(exc).__name__}: {exc}"))
    finally:
        gen.cancel()  # also when the client went away: Starlette closes this generator
    yield sse("[DONE]")
