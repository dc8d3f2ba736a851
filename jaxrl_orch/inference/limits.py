"""EngineLimits: the numbers that fix a decoding engine's shapes, validated in one place.

What it owns: the slot count (``max_concurrent_decodes``), the KV cache length
(``max_target_length``: prompt plus completion), the longest prompt a prefill takes
(``max_prefill_length``), the decode steps one ``generate`` call runs (``steps_per_call``) and
the stop ids a slot holds (``max_stop_tokens``); and the one rule for an unset prefill limit:
half the cache (``max_target_length // 2``), the other half being room to generate. Nothing
else may restate that rule: read ``EngineLimits(...).max_prefill_length``.

Invariants: every limit is a positive int and a prompt fits the cache
(``max_prefill_length <= max_target_length``); a bad value raises ``ValueError`` naming it.
Once built, ``max_prefill_length`` is an int.

Who reads it: ``DecodeEngine`` is built with one; a plug-in engine factory is called with one
(``compose/engines``); ``jaxrl-aot``'s cost model sizes the prefill from it.

Also here, the one bound on a request's float sampling settings (``FLOAT_SAMPLING``), which the
engine holds in float32 slot fields (``decode_state``) and samples with in float32:
``float32_refusal`` says why a value would sample with another one (0, inf, NaN), for the
driver's submission check (``requests.check_request``) and the HTTP request models
(``serving.contract``, ``serving.openai_schemas``) alike; and ``MAX_TOP_LOGPROBS``, the most
alternatives per token a request may ask for (``top_logprobs_refusal``), which is also the
fixed width of the engine's top-k outputs. Pure data: no JAX.
"""

from __future__ import annotations

import dataclasses

_POSITIVE = (
    "max_concurrent_decodes",
    "max_target_length",
    "max_prefill_length",
    "steps_per_call",
    "max_stop_tokens",
)

FLOAT32_MAX = (2 - 2**-23) * 2.0**127  # past it, a setting overflows its float32 slot field
# Each float sampling setting's smallest value above 0, and what goes wrong below it (0 itself
# is allowed where the setting allows it: a temperature of 0 is greedy). Below top_p's, float32
# holds it as 0 (XLA flushes subnormals): a top_p of 0 keeps no token, and the slot samples
# token 0 forever. Below temperature's, the tempered logits ``logits / T`` overflow to inf (and
# the log-probs to NaN) once a logit passes T * 2**128: at 2**-100 past 2**28, which no model's
# logits reach; at float32's smallest normal value, 2**-126, past 4, which most do.
FLOAT_SAMPLING = {
    "temperature": (2.0**-100, "overflows the tempered logits (logits / temperature) in float32"),
    "top_p": (2.0**-126, "becomes 0 in the engine's float32 slot field"),
}


def float32_refusal(name: str, value: float) -> str | None:
    """Why float sampling setting ``name`` (``FLOAT_SAMPLING``) cannot take ``value`` in the
    engine's float32 fields, naming the value and the bound; None when it can."""
    if value > FLOAT32_MAX:
        return f"{name}={value!r} is past float32's largest value {FLOAT32_MAX:.6g}"
    smallest, why = FLOAT_SAMPLING[name]
    if 0 < value < smallest:
        return f"{name}={value!r} {why}; the smallest {name} allowed above 0 is {smallest!r}"
    return None


# vLLM's default ``max_logprobs``. The engine's scoring and top-k decode programs always compute
# this many alternatives (one program whatever a request's k), and the host keeps the first k.
MAX_TOP_LOGPROBS = 20


def top_logprobs_refusal(name: str, value: int) -> str | None:
    """Why ``value`` alternatives per token cannot be asked for under ``name``; None when they
    can (0 to ``MAX_TOP_LOGPROBS``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        return (
            f"{name}={value!r} is out of range: alternatives per token must be an int in "
            f"[0, {MAX_TOP_LOGPROBS}]"
        )
    return None


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """See the module docstring. ``max_prefill_length=None``: half of ``max_target_length``."""

    max_concurrent_decodes: int = 8
    max_target_length: int = 256
    max_prefill_length: int | None = None
    steps_per_call: int = 4
    max_stop_tokens: int = 4

    def __post_init__(self) -> None:
        if self.max_prefill_length is None and isinstance(self.max_target_length, int):
            object.__setattr__(self, "max_prefill_length", self.max_target_length // 2)
        for name in _POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_prefill_length > self.max_target_length:
            raise ValueError(
                f"max_prefill_length={self.max_prefill_length} must be <= "
                f"max_target_length={self.max_target_length} (the prompt has to fit the cache)"
            )
