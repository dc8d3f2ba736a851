"""An engine with upstream JetStream's exact surface, for tests: the built-in ``DecodeEngine``
behind JetStream's method signatures and result types.

Upstream (``jetstream.engine.engine_api``) differs from the built-in engine in what matters
here: ``ResultTokens`` carries only token, validity and length columns, and
``get_result_at_slot`` returns a ``SlotData(tokens, valid, lengths)`` whose arrays are
``[samples_per_slot, steps]`` (no squeeze); there are no log-probs and no per-token versions;
``insert(prefix, decode_state, slot)`` takes no per-request sampling and ``generate(params,
decode_state)`` no version. The sampler is the engine's own (fixed at construction).

``Engine.kind = 'support.upstream_engines:UpstreamShapedEngine'`` (with ``tests/`` on the path)
plugs it into a run as a user would plug in theirs: the run calls it as a plug-in engine factory,
``(model_config, mesh=..., limits=EngineLimits(...), tokenizer=..., seed=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.types import SamplingParams


@dataclasses.dataclass
class SlotData:
    tokens: np.ndarray
    valid: np.ndarray
    lengths: np.ndarray


@dataclasses.dataclass
class ResultTokens:
    data: Any
    tokens_idx: tuple[int, int]
    valid_idx: tuple[int, int]
    length_idx: tuple[int, int]
    samples_per_slot: int

    def convert_to_numpy(self) -> ResultTokens:
        return dataclasses.replace(self, data=np.asarray(self.data))

    def get_result_at_slot(self, slot: int) -> SlotData:
        start, end = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        rows = np.asarray(self.data)[start:end]
        return SlotData(
            tokens=rows[:, self.tokens_idx[0] : self.tokens_idx[1]],
            valid=rows[:, self.valid_idx[0] : self.valid_idx[1]],
            lengths=rows[:, self.length_idx[0] : self.length_idx[1]][:, 0],
        )


def upstream_result(ours: Any) -> ResultTokens:
    """Keep only the columns upstream has (tokens, valid, lengths)."""
    end = ours.length_idx[1]
    return ResultTokens(
        data=np.asarray(ours.data)[:, :end],
        tokens_idx=ours.tokens_idx,
        valid_idx=ours.valid_idx,
        length_idx=ours.length_idx,
        samples_per_slot=ours.samples_per_slot,
    )


class UpstreamShapedEngine:
    """See the module docstring. Samples at ``temperature`` whatever a request asks for."""

    def __init__(
        self,
        model_config: Any,
        *,
        limits: EngineLimits = EngineLimits(),
        temperature: float = 1.0,
        **kwargs: Any,
    ) -> None:
        self._inner = DecodeEngine(model_config, limits=limits, **kwargs)
        self.param_shardings = self._inner.param_shardings
        self.temperature = temperature
        self.max_concurrent_decodes = self._inner.max_concurrent_decodes
        self.max_prefill_length = self._inner.max_prefill_length
        self.max_target_length = self._inner.max_target_length
        self.samples_per_slot = 1

    def load_params(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.load_params(*args, **kwargs)

    def init_decode_state(self) -> Any:
        return self._inner.init_decode_state()

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
        prefix, result = self._inner.prefill(
            params=params,
            existing_prefix=existing_prefix,
            padded_tokens=padded_tokens,
            true_length=true_length,
        )
        return prefix, upstream_result(result)

    def insert(self, prefix: Any, decode_state: Any, slot: int) -> Any:
        room = self.max_target_length - int(prefix["pos"]) - 1
        sampling = SamplingParams(temperature=self.temperature, max_tokens=max(room, 1))
        return self._inner.insert(prefix, decode_state, slot, sampling=sampling)

    def generate(self, params: Any, decode_state: Any) -> tuple[Any, ResultTokens]:
        state, result = self._inner.generate(params, decode_state)
        return state, upstream_result(result)
