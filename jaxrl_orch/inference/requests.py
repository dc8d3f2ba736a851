"""The driver's request records and the small helpers around them.

What it owns: ``Group`` (one submitted prompt with its samples' futures and sampling params,
and the prefilled prefix they share) and ``Seq`` (one running sample: its future and the ids,
log-probs and versions generated so far); ``resolve`` (settle a future exactly once, whatever
the caller did with it); ``accepts`` (whether an engine method takes an optional keyword, so a
plain JetStream-shaped engine can be driven too); ``first_token`` (the token a JetStream-style
engine samples at prefill); ``valid_tokens`` (a decode step's valid tokens, log-probs and
versions per running slot, read from the result in one pass); ``check_request`` (a submission
validated against the engine's limits; sample i of one seeded ``SamplingParams`` for n samples
gets seed ``seed + i``). Host-side only; the thread that uses them is ``driver.py``'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_orch.inference.engine_api import ResultTokens
from jaxrl_orch.types import SamplingParams

STOPPED = "InferenceDriver stopped before the request finished"
ABORTED = "abort"  # the finish reason of requests a pause("abort") ended (vLLM's word)
PAUSE_MODES = ("keep", "wait", "abort")  # weakest first
# An engine that reports no log-probs yields NaN: the trainer must recompute them (DESIGN 5).
NO_LP = float("nan")


@dataclasses.dataclass(eq=False)
class Group:
    prompt: np.ndarray
    members: list[tuple[concurrent.futures.Future, SamplingParams]]
    prefix: Any = None
    prefix_version: int | None = None
    first: tuple[int, float] | None = None  # a token the engine sampled at prefill, if any


@dataclasses.dataclass(eq=False)
class Seq:
    future: concurrent.futures.Future
    sampling: SamplingParams
    prompt_len: int
    on_token: Any = None  # called with (token, logprob, version) as each token is recorded
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)


def accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def resolve(future: concurrent.futures.Future, *, result: Any = None, error: Any = None) -> None:
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by the caller in the meantime: nobody is waiting for it


def first_token(result: Any) -> tuple[int, float] | None:
    """A JetStream-style engine samples the first token at prefill; ours defers it."""
    if result is None:
        return None
    tokens, valid, logprobs, _ = slot_columns(result.get_result_at_slot(0))
    if valid.size == 0 or not valid[0]:
        return None
    return int(tokens[0]), float(logprobs[0]) if logprobs is not None else NO_LP


def slot_columns(data: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """A slot's ``(tokens, valid, logprobs, versions)`` as flat host arrays. Upstream
    JetStream's ``SlotData`` has only ``tokens``/``valid``/``lengths``, each ``[samples, steps]``:
    its log-probs and versions are None (the driver then records NaN log-probs, for the
    trainer to recompute, and the version it decoded with)."""
    flat = lambda name: (
        None if getattr(data, name, None) is None else np.asarray(getattr(data, name)).reshape(-1)
    )
    return flat("tokens"), flat("valid").astype(bool), flat("logprobs"), flat("versions")


def valid_tokens(result: Any, slots: Sequence[int]) -> list[tuple[list, list | None, list | None]]:
    """``(tokens, logprobs, versions)`` of each of ``slots`` in a generate result, the valid
    steps only, as Python lists (None where the engine reports none). Our ``ResultTokens`` is
    read as one array for all slots (the per-token host work of a decode step); another
    engine's result through its ``get_result_at_slot``."""
    if not isinstance(result, ResultTokens) or not slots:
        return [_valid(*slot_columns(result.get_result_at_slot(s))) for s in slots]
    per, data = result.samples_per_slot, np.asarray(result.data)
    rows = np.concatenate([np.arange(s * per, (s + 1) * per) for s in slots])

    def cols(idx: tuple[int, int] | None) -> np.ndarray | None:
        return None if idx is None else data[rows, idx[0] : idx[1]].reshape(len(slots), -1)

    lps = cols(result.logprob_idx)
    columns = (
        cols(result.tokens_idx),
        cols(result.valid_idx).astype(bool),
        None if lps is None else lps.view(np.float32),
        cols(result.version_idx),
    )
    return [_valid(*(None if c is None else c[i] for c in columns)) for i in range(len(slots))]


def _valid(tokens: Any, valid: Any, logprobs: Any, versions: Any) -> tuple:
    keep = lambda a: None if a is None else a[valid].tolist()  # noqa: E731
    return keep(tokens), keep(logprobs), keep(versions)


def check_request(
    prompt_ids: Any,
    sampling: SamplingParams | Sequence[SamplingParams],
    n: int | None,
    *,
    max_prefill: int,
    max_stop: int | None,
) -> tuple[np.ndarray, list[SamplingParams]]:
    """A submission's prompt as int32 ids and one ``SamplingParams`` per sample, validated
    against the engine's limits (every error names the bad value and the limit)."""
    prompt = np.asarray(list(prompt_ids), dtype=np.int32)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence, got {prompt_ids!r}")
    if prompt.size > max_prefill:
        raise ValueError(
            f"prompt has {prompt.size} tokens; this engine allows at most "
            f"max_prefill_length={max_prefill}"
        )
    samplings = [sampling] * (n or 1) if isinstance(sampling, SamplingParams) else list(sampling)
    if isinstance(sampling, SamplingParams) and sampling.seed is not None:
        # One seeded setting for n samples (vLLM's rule): sample i gets seed + i, so the
        # group's samples differ but each stays reproducible on any engine or slot.
        samplings = [
            dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**31)
            for i in range(len(samplings))
        ]
    if n is not None and n != len(samplings) or not samplings:
        raise ValueError(f"n must be >= 1 and match the sampling list, got n={n!r}")
    for sp in samplings:
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sp).__name__}")
        if max_stop is not None and len(sp.stop_token_ids) > max_stop:
            raise ValueError(
                f"{len(sp.stop_token_ids)} stop_token_ids {sp.stop_token_ids}; this engine "
                f"holds at most max_stop_tokens={max_stop}"
            )
    return prompt, samplings
