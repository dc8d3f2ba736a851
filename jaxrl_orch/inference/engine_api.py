"""The engine contract the driver drives: JetStream's Engine method shape plus RL extras.

Owns: ``ResultTokens`` / ``SlotData`` (what prefill and generate hand back), the
``JetStreamEngine`` Protocol (the methods and properties the driver relies on), ``RLEngine``
(that plus where its weights live: what the run moves the trainer's weights into) and
``ReplicaEngine`` (that plus what an engine replica pulls weights into). Written from
JetStream's ``engine_api`` shape (prefill / insert / generate / init_decode_state / load_params
and the capacity properties); the ``google-jetstream`` package is deliberately not a dependency.

Result layout: every per-slot quantity of one call lives in a single int32 array ``data`` of
shape ``[slots * samples_per_slot, columns]`` so one device-to-host copy fetches everything.
Column ranges (half-open ``(start, stop)`` pairs):
- ``tokens_idx``: sampled ids, one column per decode step in the call (``steps`` columns);
- ``valid_idx``: 1 where that step produced a real token for the slot, else 0;
- ``length_idx``: one column, tokens generated so far by the slot's current request;
RL extras (docs/design.md section 5), absent (``None``) for an engine that cannot provide them:
- ``logprob_idx``: behavior log-probs, float32 bit-cast into the int32 array;
- ``version_idx``: params version of the call that produced each token;
- ``top_idx`` / ``top_logprob_idx`` (only from a call asked for alternatives): each step's k
  most likely ids and their log-probs (float32 bit-cast), ``steps * k`` columns each,
  step-major (step s at columns ``[s * k, (s + 1) * k)`` of the range), most likely first.

Invariants: a step's columns are only meaningful where valid is 1; once a slot's request has
finished (stop token or length) the engine reports no further valid tokens for it until a new
prefix is inserted. This module holds no state and imports nothing from the rest of the
package.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class SlotData:
    """One slot's share of a ``ResultTokens`` (host numpy arrays, ``[steps]`` each)."""

    tokens: np.ndarray
    valid: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray | None = None
    versions: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class ResultTokens:
    data: Any  # int32 [slots * samples_per_slot, columns], device or host array
    tokens_idx: tuple[int, int]
    valid_idx: tuple[int, int]
    length_idx: tuple[int, int]
    samples_per_slot: int = 1
    logprob_idx: tuple[int, int] | None = None
    version_idx: tuple[int, int] | None = None
    top_idx: tuple[int, int] | None = None
    top_logprob_idx: tuple[int, int] | None = None

    def convert_to_numpy(self) -> ResultTokens:
        return dataclasses.replace(self, data=np.asarray(self.data))

    def get_result_at_slot(self, slot: int) -> SlotData:
        """Rows of ``slot`` (``samples_per_slot`` of them); 1-sample engines squeeze to 1-D."""
        per = self.samples_per_slot
        rows = np.asarray(self.data)[slot * per : (slot + 1) * per]

        def cols(idx: tuple[int, int] | None) -> np.ndarray | None:
            if idx is None:
                return None
            out = rows[:, idx[0] : idx[1]]
            return out[0] if self.samples_per_slot == 1 else out

        logprobs = cols(self.logprob_idx)
        return SlotData(
            tokens=cols(self.tokens_idx),
            valid=cols(self.valid_idx),
            lengths=cols(self.length_idx),
            logprobs=None if logprobs is None else logprobs.view(np.float32),
            versions=cols(self.version_idx),
        )


@runtime_checkable
class JetStreamEngine(Protocol):
    """What ``InferenceDriver`` needs. Extra keyword arguments the driver passes when the
    engine's signature accepts them: ``insert(..., sampling=SamplingParams)``,
    ``generate(..., version=int)`` and ``generate(..., top_logprobs=True)`` (only while a
    running request asks for alternatives). An engine with ``score(*, params, padded_tokens,
    true_length) -> (prefix, arrays)`` (``inference.scoring``) serves prompt scoring; the
    driver refuses it for one without. A JetStream-style engine whose prefill already samples
    the first token (valid = 1 in its result) is driven too: that token opens every slot
    the prefix is inserted into."""

    def prefill(
        self, *, params: Any, existing_prefix: Any = None, padded_tokens: Any, true_length: int
    ) -> tuple[Any, ResultTokens]: ...

    def insert(self, prefix: Any, decode_state: Any, slot: int) -> Any: ...

    def generate(self, params: Any, decode_state: Any) -> tuple[Any, ResultTokens]: ...

    def init_decode_state(self) -> Any: ...

    @property
    def max_concurrent_decodes(self) -> int: ...

    @property
    def max_prefill_length(self) -> int: ...


@runtime_checkable
class RLEngine(JetStreamEngine, Protocol):
    """An engine the RL run moves weights into: JetStream's methods plus ``param_shardings``
    (the tree of shardings the trainer's weights are resharded onto, on the engine's mesh).
    ``param_dtype`` (the weights' dtype, cast to on the way) and ``reports_logprobs`` are read
    where present; the built-in ``DecodeEngine`` has both."""

    param_shardings: Any


@runtime_checkable
class ReplicaEngine(RLEngine, Protocol):
    """An engine an engine replica serves, whose weights it pulls (``distributed.source``):
    ``RLEngine``'s plus the weights' dtype (what the pulled bytes are), their abstract tree (the
    pull's targets) and its ``mesh`` (a LoRA replica's adapters are replicated on it). The
    built-in ``DecodeEngine`` has them."""

    param_dtype: Any
    mesh: Any

    def abstract_params(self) -> Any: ...
