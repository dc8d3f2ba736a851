"""Request bodies of the OpenAI text endpoints, validated before anything reaches the engine.

What it owns: the fields ``/v1/completions`` (``CompletionRequest``) and
``/v1/chat/completions`` (``ChatRequest``) accept, their ranges and defaults, and
``parse_request`` which turns a JSON body into one of them or an ``ApiError`` 400 naming the bad
field and what is allowed.

Rules:
- Unknown keys are refused by name with the list of accepted ones (``extra="forbid"``), never
  ignored: a caller asking for a response format or penalties must learn that this engine
  does not do them, not get a silently different sample. The penalty fields and
  ``logit_bias`` are accepted only at their neutral values (what many clients send anyway).
- OpenAI's fields keep OpenAI's meaning and defaults (``max_tokens`` 16 for completions,
  temperature 1); vLLM's extras (``top_k``, ``stop_token_ids``, ``ignore_eos``,
  ``skip_special_tokens``, ``return_token_ids``) keep vLLM's.
- Log-probs: completions' ``logprobs`` and chat's ``top_logprobs`` (which needs
  ``logprobs: true``, as OpenAI's) take k in [0, ``MAX_TOP_LOGPROBS``]: alternatives per token.
- ``echo`` (completions) returns the prompt, scored, before the completion; ``max_tokens`` 0
  is allowed with it only (the prompt's scores alone, as lm-evaluation-harness asks), and an
  echo is not streamed.
- Chat tools (``tool_schemas``): ``tools``, ``tool_choice``, ``parallel_tool_calls``, an
  assistant message's ``tool_calls`` and a tool message's ``tool_call_id``; the rules across
  them are ``tool_schemas.check_tools``, run by the route.
- ``prompt`` is one prompt (a string or a list of token ids); a batch of several is refused.
- A ``temperature`` or ``top_p`` the engine's float32 slot fields cannot hold (a positive value
  that would reach the device as 0) is refused, naming the smallest allowed
  (``inference.limits.float32_refusal``).

Pure validation (pydantic): no engine, tokenizer or HTTP state.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxrl_orch.inference.limits import (
    FLOAT_SAMPLING,
    MAX_TOP_LOGPROBS,
    float32_refusal,
    top_logprobs_refusal,
)
from jaxrl_orch.serving.errors import ApiError
from jaxrl_orch.serving.tool_schemas import (
    CalledFunction,
    FunctionDef,
    FunctionName,
    MessageToolCall,
    NamedToolChoice,
    Tool,
    parse_tool_choice,
)

MAX_N = 64  # choices per request: each takes an engine slot
MAX_STOPS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampled(BaseModel):
    """What both endpoints share: the model, the sampling, stop rules and streaming."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**31)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] | None = Field(None, validate_default=True)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator(*FLOAT_SAMPLING)
    @classmethod
    def _float32(cls, value: float | None, info: Any) -> float | None:
        refusal = None if value is None else float32_refusal(info.field_name, value)
        if refusal is not None:
            raise ValueError(refusal)
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or at most {MAX_STOPS} non-empty strings, "
                f"got {value!r}"
            )
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int]:
        if any(i < 0 for i in value or []):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {value!r}")
        return list(value or [])

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: Any) -> float | None:
        if value:
            raise ValueError(
                f"{info.field_name}={value!r} is not supported: this engine samples without "
                "penalties (only 0 is accepted)"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError(f"logit_bias is not supported (only {{}} is accepted), got {value!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampled:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _alternatives(name: str, value: int | None) -> int | None:
    refusal = None if value is None else top_logprobs_refusal(name, value)
    if refusal is not None:
        raise ValueError(refusal)
    return value


class CompletionRequest(_Sampled):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(
                    f"prompt holds a batch of {len(value)} prompts; send one prompt (a string "
                    "or a list of token ids) per request"
                )
            return value[0]
        return value

    @field_validator("prompt")
    @classmethod
    def _ids(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and any(i < 0 for i in value):
            raise ValueError(f"prompt token ids must be >= 0, got {value!r}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        return _alternatives("logprobs", value)

    @model_validator(mode="after")
    def _echo_rules(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens=0 asks for nothing: it is allowed with echo=true only (the prompt "
                "and its log-probs); otherwise max_tokens must be >= 1"
            )
        if self.echo and self.stream:
            raise ValueError("echo=true is not streamed: send it with stream=false")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """OpenAI's content parts: text only, joined."""
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {kind!r} is not supported; only 'text'")
            texts.append(part["text"])
        return "".join(texts)


class ChatRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return parse_tool_choice(value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        return _alternatives("top_logprobs", value)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(
                f"top_logprobs={self.top_logprobs} needs logprobs=true (OpenAI's rule); "
                f"send both, top_logprobs in [0, {MAX_TOP_LOGPROBS}]"
            )
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: a ``name`` or ``tool_call_id`` only
        where one was given, a call's ``arguments`` as the object its JSON text holds (what
        the templates write back with ``tojson``, as vLLM hands them over)."""
        out = []
        for m in self.messages:
            entry: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.name:
                entry["name"] = m.name
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": c.type,
                        "function": {
                            "name": c.function.name,
                            "arguments": json.loads(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            out.append(entry)
        return out


# The model that owns each nested object, by the field names on the way to it (list indices
# left out): an unknown key there is refused with that model's fields.
_NESTED: dict[tuple[str, ...], type[BaseModel]] = {
    ("messages",): ChatMessage,
    ("messages", "tool_calls"): MessageToolCall,
    ("messages", "tool_calls", "function"): CalledFunction,
    ("stream_options",): StreamOptions,
    ("tools",): Tool,
    ("tools", "function"): FunctionDef,
    ("tool_choice",): NamedToolChoice,
    ("tool_choice", "function"): FunctionName,
}


def parse_request(cls: type[_Sampled], body: Any, endpoint: str) -> Any:
    """``body`` as a ``cls``, or ``ApiError`` 400 naming every unknown key (with the accepted
    ones) or the first bad value (with its range)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body of {endpoint} must be a JSON object, got {body!r:.80}")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise _to_api_error(exc, cls, endpoint) from None


def _to_api_error(exc: ValidationError, cls: type[BaseModel], endpoint: str) -> ApiError:
    errors = exc.errors(include_url=False)
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        where = unknown[0][:-1]
        owner = _NESTED.get(tuple(str(p) for p in where if not isinstance(p, int)), cls)
        names = ", ".join(repr(".".join(map(str, loc))) for loc in unknown)
        accepted = ", ".join(sorted(owner.model_fields))
        what = endpoint if owner is cls else f"{'.'.join(map(str, where))} in {endpoint}"
        param = ".".join(map(str, unknown[0]))
        return ApiError(400, f"unknown field {names}: {what} accepts {accepted}", param=param)
    first = errors[0]
    param = ".".join(map(str, first["loc"])) or None
    if first["type"] == "value_error":
        return ApiError(400, str(first["ctx"]["error"]), param=param)
    message = f"{param or 'body'}: {first['msg']}, got {first.get('input')!r:.200}"
    return ApiError(400, message, param=param)
