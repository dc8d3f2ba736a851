"""The engine replicas' HTTP contract: every route a pool calls, and the bodies both ways.

What it owns: ``Route`` (method, path, request model, reply model) and the routes a pool
(``distributed.pool`` through ``distributed.replica_client``) calls on a replica: ``GENERATE``
(vLLM's token-in/token-out route: ``GenerateRequest`` -> ``GenerateResponse``), ``HEALTH`` (the
state a pool reads, open without the API key: ``Health``) and ``UPDATE_WEIGHTS`` (pull an offer
from the one source the server was started with: ``UpdateWeights`` -> ``WeightsLoaded``);
``MAX_QUEUED``, the samples a replica holds in flight unless told otherwise (past it: 429).

Both sides import it: the server (``rl_api``, ``ops``, ``guard``, ``host``) serves these paths
and validates these requests; the client builds its bodies from the request models and reads
every reply through its reply model. Pydantic only, so the client never imports the server's
stack (the one bound it shares with the engine, ``inference.limits``, is pure data).

Requests (what a client may send, and nothing else):
- Every request model forbids unknown keys and is strict (no ``"1"`` for 1, no ``1`` for
  ``true``): a key this engine would not honour is refused by name, never ignored.
- Keys accepted without effect on the tokens, and why: ``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``include_stop_str_in_output`` and ``detokenize`` shape
  text, which the token route never returns; ``logprobs`` 0 or 1 (the sampled token's log-prob
  is always returned; alternatives are not: training clients send 1, and the training path
  must not pay for a top-k); ``routed_experts_prompt_start`` (verifiers sends it
  on bridged turns; this engine returns no routed experts); ``cache_salt`` (prefixes are shared
  only between identical prompts of one version, so a salt could only narrow reuse and never
  changes a result). Penalties and ``min_p`` / ``min_tokens`` are accepted only at their neutral
  values and ``ignore_eos`` only false; ``priority`` only 0 (requests are served in arrival
  order), as vLLM answers when priority scheduling is off.
- ``prompt_logprobs`` (vLLM's): k in [0, ``MAX_TOP_LOGPROBS``] scores the prompt
  (``inference.scoring``: ``log_softmax`` of the raw logits, no temperature, the trainer's
  log-probs at T = 1); null does not. vLLM's -1 (the whole vocabulary) is refused.
- ``UpdateWeights`` never names an address, and always its pull's deadline (``timeout_s``).

Replies:
- A generate reply holds one choice per sample; a choice holds one log-prob entry and one policy
  version per token id (``content[j].token == "token_id:<id>"``; a log-prob the engine did not
  report is null). ``policy_versions`` is ours: a choice without one version per token is
  refused when read, since the orchestrator bounds staleness by them (docs/design.md section 3).
- ``prompt_logprobs`` (only when asked), vLLM's shape: one entry per prompt token, null for the
  first; entry i maps ``str(token id)`` to ``PromptLogprob`` (``logprob``, ``rank``: 1 + the
  tokens more likely, ``decoded_token``: null, as the token route returns no text) for
  token i itself and the k most likely tokens there. ``prompt_policy_version`` (ours, null
  unless asked) is the params version that scored the prompt.
- A reader ignores keys a reply model does not name (another engine may add some); the
  server's own replies hold exactly these keys, which the tests hold it to.

A float sampling setting the engine's float32 slot fields cannot hold (a ``top_p`` of 1e-300
would reach the device as 0) is refused by name, with the smallest value allowed
(``inference.limits.float32_refusal``). Limits that need the served model (vocabulary, context)
are the server's to check.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxrl_orch.inference.limits import float32_refusal, top_logprobs_refusal

MAX_QUEUED = 4096


def _float32(value: float, name: str) -> float:
    """``value``, unless the engine's float32 slot field cannot hold it (``float32_refusal``)."""
    refusal = float32_refusal(name, value)
    if refusal is not None:
        raise ValueError(refusal)
    return value


_STRICT = ConfigDict(extra="forbid", strict=True)
_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "min_tokens": 0,
}


class WireSampling(BaseModel):
    model_config = _STRICT

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None  # None: what is left of the context after the prompt
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    detokenize: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    routed_experts_prompt_start: int | None = None
    prompt_logprobs: int | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0.0 or v == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {v!r}")
        return _float32(v, "temperature")

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {v!r}")
        return _float32(v, "top_p")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {v!r}")
        return max(v, 0)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v!r}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**31:
            raise ValueError(f"seed must be null or an int in [0, 2**31), got {v!r}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"n must be >= 1, got {v!r}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and v not in (0, 1):
            raise ValueError(
                f"logprobs={v!r} asks for {v} alternatives per token; this server returns the "
                "sampled token's log-prob only (top_logprobs stays empty): use 0, 1 or null"
            )
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v: int | None) -> int | None:
        refusal = None if v is None else top_logprobs_refusal("prompt_logprobs", v)
        if refusal is not None:
            raise ValueError(f"{refusal}, or null for none")
        return v

    @field_validator("ignore_eos")
    @classmethod
    def _ignore_eos(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "ignore_eos=true is not supported: only false; decoding stops on the "
                "stop_token_ids given (leave them out to decode to max_tokens)"
            )
        return v

    @field_validator(*_NEUTRAL)
    @classmethod
    def _neutral(cls, v: float, info: Any) -> float:
        neutral = _NEUTRAL[info.field_name]
        if v != neutral:
            raise ValueError(
                f"{info.field_name}={v!r} is not supported: this engine samples without "
                f"penalties, so only {info.field_name}={neutral!r} is accepted"
            )
        return v

    @field_validator("routed_experts_prompt_start")
    @classmethod
    def _routed(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"routed_experts_prompt_start must be >= 0, got {v!r}")
        return v


class GenerateRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None  # None: the served one
    token_ids: list[int]
    sampling_params: WireSampling = Field(default_factory=WireSampling)
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0

    @field_validator("token_ids")
    @classmethod
    def _token_ids(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("token_ids must hold at least one token id, got []")
        return v

    @field_validator("priority")
    @classmethod
    def _priority(cls, v: int) -> int:
        if v != 0:
            raise ValueError(
                f"priority={v!r} is not supported: requests are served in arrival order, so "
                "only priority=0 is accepted"
            )
        return v


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None  # None: the engine did not report it
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class GenerateChoice(BaseModel):
    index: int = 0
    token_ids: list[int]
    logprobs: ChoiceLogprobs
    finish_reason: str
    policy_versions: list[int] | None = None  # None is refused: see ``_one_per_token``

    @model_validator(mode="after")
    def _one_per_token(self) -> GenerateChoice:
        n = len(self.token_ids)
        if len(self.policy_versions or ()) != n:
            raise ValueError(
                "the engine's answer has no policy_versions with one version per token; the "
                "orchestrator bounds staleness by them (docs/design.md section 3), so an engine "
                "serving it must report the version of every token it generates"
            )
        if len(self.logprobs.content) != n:
            raise ValueError(
                f"the engine's answer has {len(self.logprobs.content)} log-prob entries for "
                f"{n} token ids: one per token"
            )
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class GenerateResponse(BaseModel):
    request_id: str | None = None
    choices: list[GenerateChoice] = Field(min_length=1)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_policy_version: int | None = None
    usage: Usage | None = None


class UpdateWeights(BaseModel):
    """An offer to pull from the source the server was started with; never an address.

    ``part``: what the offer holds. ``weights``: every weight, served as ``version``. A LoRA
    run's replica takes ``base`` (the frozen base, kept and not served) once, then
    ``adapters`` per version (merged into the base it holds, then served)."""

    model_config = _STRICT

    version: int
    uuid: int
    layout: Any = None
    timeout_s: float
    part: typing.Literal["weights", "base", "adapters"] = "weights"

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not 0.0 < v < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {v!r}")
        return v


class WeightsLoaded(BaseModel):
    version: int  # served from the next decode step on (a LoRA base: the one still served)
    pull_s: float
    swap_s: float


class Health(BaseModel):
    status: str
    model: str
    ready: bool  # False (and version -1) until the first weight update lands
    version: int
    paused: bool
    in_flight: int
    queued: int
    slots: int
    active_slots: int
    engine_s: float  # prefill + decode seconds since the process started
    pid: int


@dataclasses.dataclass(frozen=True)
class Route:
    method: str
    path: str
    request: type[BaseModel] | None  # None: no body
    reply: type[BaseModel]


GENERATE = Route("POST", "/inference/v1/generate", GenerateRequest, GenerateResponse)
HEALTH = Route("GET", "/health", None, Health)
UPDATE_WEIGHTS = Route("POST", "/update_weights", UpdateWeights, WeightsLoaded)
ROUTES = (GENERATE, HEALTH, UPDATE_WEIGHTS)
