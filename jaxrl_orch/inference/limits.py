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
(``compose/engines``); ``jaxrl-aot``'s cost model sizes the prefill from it. Pure data: no JAX.
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
