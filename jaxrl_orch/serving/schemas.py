"""The RL endpoints' request bodies as pydantic models: what a client may send, and nothing else.

What it owns: ``GenerateRequest`` (``POST /inference/v1/generate``: ``model``, ``token_ids``,
``sampling_params``, optional ``request_id`` / ``cache_salt`` / ``priority``), its
``WireSampling`` (vLLM's sampling keys that this engine honours), ``UpdateWeights``
(``POST /update_weights``), ``to_samplings`` (one ``types.SamplingParams`` per sample; an
absent ``max_tokens`` is what the context leaves after the prompt) and ``allowed_keys`` (the
keys an object of a request may hold, for the error that refuses another).

Invariants:
- Every model forbids unknown keys and is strict (no ``"1"`` for 1, no ``1`` for ``true``): a
  key this engine would not honour is refused by name, never ignored.
- Keys accepted without effect on the tokens, and why: ``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``include_stop_str_in_output`` and ``detokenize`` shape
  text, which the token endpoint never returns; ``logprobs`` 0 or 1 (the sampled token's
  log-prob is always returned; alternatives are not); ``routed_experts_prompt_start`` (verifiers
  sends it on bridged turns; this engine returns no routed experts); ``cache_salt`` (prefixes are
  shared only between identical prompts of one version, so a salt could only narrow reuse and
  never changes a result). Penalties and ``min_p`` / ``min_tokens`` are accepted only at their
  neutral values and ``ignore_eos`` only false; ``priority`` only 0 (requests are served in
  arrival order), as vLLM answers when priority scheduling is off.
- Seeds of ``n > 1`` samples follow the driver's rule: sample i of seed s gets ``s + i``.

Who uses it: ``rl_api`` (the routes) and ``app`` (``allowed_keys`` in the validation handler).
It never touches the engine; limits that need the served model (vocabulary, context) are
checked by the route.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxrl_orch.types import SamplingParams

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

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0.0 or v == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {v!r}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {v!r}")
        return v

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


class UpdateWeights(BaseModel):
    """An offer to pull from the source the server was started with; never an address.

    ``part``: what the offer holds. ``weights``: every weight, served as ``version``. A LoRA
    run's replica takes ``base`` (the frozen base, kept and not served) once, then
    ``adapters`` per version (merged into the base it holds, then served)."""

    model_config = _STRICT

    version: int
    uuid: int
    layout: Any = None
    timeout_s: float = 120.0
    part: typing.Literal["weights", "base", "adapters"] = "weights"

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not 0.0 < v < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {v!r}")
        return v


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


def allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys the object at ``loc`` (a pydantic error location below ``model``) may hold, or
    None when ``loc`` does not lead to a model."""
    for part in loc:
        if not isinstance(part, str):
            continue  # a list index: the item type is found with the field
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # Optional[M], list[M], M | None ...
        found = _model_in(arg)
        if found is not None:
            return found
    return None
