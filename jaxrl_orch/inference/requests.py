"""The driver's request records and the small helpers around them.

What it owns: ``PrefillGroup`` (one submitted prompt with its samples' futures and sampling
params, and the prefilled prefix they share) and ``Seq`` (one running sample: its future, the
ids, log-probs, versions and, when its sampling asks, alternatives generated so far, and its
``TokenListener`` when streamed); ``resolve`` (settle a future exactly once, whatever the
caller did with it); ``accepts`` (whether an engine method takes an optional keyword, so a
plain JetStream-shaped engine can be driven too); ``first_token`` (the token a JetStream-style
engine samples at prefill); ``valid_tokens`` (a decode step's valid tokens, log-probs and
versions per running slot, read from the result in one pass) and ``valid_tops`` (their
alternatives, from a top-k step); ``finish_reason`` (the host-side finishing rules);
``consumed`` (whether a failed engine call took the decode state with it); ``check_request`` (a
submission validated against the engine's ``RequestLimits``: prompt ids in the vocabulary,
alternatives the engine reports, settings that fit the engine's slot fields; sample i of one
seeded ``SamplingParams`` for n samples gets seed ``seed + i``). Host-side only; the thread
that uses them is the driver's (``driver.py`` and the parts it runs: ``intake``, ``slots``,
``prefixes``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_orch.inference.engine_api import JetStreamEngine, ResultTokens
from jaxrl_orch.inference.limits import FLOAT_SAMPLING, float32_refusal
from jaxrl_orch.types import SamplingParams

STOPPED = "InferenceDriver stopped before the request finished"
ABORTED = "abort"  # the finish reason of requests a pause("abort") ended (vLLM's word)
PAUSE_MODES = ("keep", "wait", "abort")  # weakest first
# An engine that reports no log-probs yields NaN: the trainer must recompute them
# (docs/design.md section 5).
NO_LP = float("nan")
# Streaming: called with (token_id, logprob, version) as each token of a sample is recorded,
# and the token's alternatives (``Completion.top_logprobs``' entry) when its sampling asked.
TokenListener = Callable[..., Any]


@dataclasses.dataclass(eq=False)
class PrefillGroup:
    prompt: np.ndarray
    members: list[tuple[concurrent.futures.Future, SamplingParams]]
    prefix: Any = None
    prefix_version: int | None = None
    first: tuple[int, float] | None = None  # a token the engine sampled at prefill, if any

    def use_prefix(self, entry: tuple[Any, tuple[int, float] | None], version: int) -> None:
        """Hold ``entry``, the prompt's prefix and first token computed under ``version``."""
        self.prefix, self.first = entry
        self.prefix_version = version


@dataclasses.dataclass(eq=False)
class Seq:
    future: concurrent.futures.Future
    sampling: SamplingParams
    prompt_len: int
    on_token: TokenListener | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None  # alternatives, when its sampling asks

    def __post_init__(self) -> None:
        if self.sampling.top_logprobs and self.top is None:
            self.top = []


def finish_reason(seq: Seq, token: int, cache_len: int | None) -> str | None:
    """Why ``seq`` ends with ``token``, its latest: ``"stop"`` (a stop id), ``"length"``
    (``max_tokens``, or past the engine's ``cache_len``), or None while it runs on."""
    if token in seq.sampling.stop_token_ids:
        return "stop"
    n = len(seq.token_ids)
    if n >= seq.sampling.max_tokens or (cache_len is not None and seq.prompt_len + n > cache_len):
        return "length"
    return None


def consumed(state: Any) -> bool:
    """Whether a decode state holds an array already deleted (donated to a call that failed)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


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
    per = result.samples_per_slot
    data = np.asarray(result.data)
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


def valid_tops(result: ResultTokens, slots: Sequence[int]) -> list[list[list[tuple[int, float]]]]:
    """Per slot of ``slots``, per valid step of a top-k generate result, its ``(id, logprob)``
    alternatives, most likely first."""
    data = np.asarray(result.data)[list(slots)]
    steps = result.tokens_idx[1] - result.tokens_idx[0]
    ids = data[:, slice(*result.top_idx)].reshape(len(slots), steps, -1)
    lps = data[:, slice(*result.top_logprob_idx)].view(np.float32).reshape(ids.shape)
    valid = data[:, slice(*result.valid_idx)].astype(bool)
    return [
        [
            list(zip(i, v, strict=True))
            for i, v in zip(ids[r][m].tolist(), lps[r][m].tolist(), strict=True)
        ]
        for r, m in enumerate(valid)
    ]


def _valid(tokens: Any, valid: Any, logprobs: Any, versions: Any) -> tuple:
    keep = lambda a: None if a is None else a[valid].tolist()  # noqa: E731
    return keep(tokens), keep(logprobs), keep(versions)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one engine can hold of a submission (``of``: read from the engine once)."""

    max_prefill: int  # prompt tokens one prefill takes
    max_stop: int | None = None  # stop ids a slot holds (None: any number)
    vocab: int | None = None  # prompt ids must be in [0, vocab) (None: unknown, e.g. a plug-in)
    max_top: int = 0  # alternatives per generated token (0: the engine computes none)

    @classmethod
    def of(cls, engine: JetStreamEngine) -> RequestLimits:
        vocab = getattr(getattr(engine, "config", None), "vocab_size", None)
        top = accepts(engine.generate, "top_logprobs")
        max_top = int(getattr(engine, "max_top_logprobs", 0)) if top else 0
        stop = getattr(engine, "max_stop_tokens", None)
        return cls(int(engine.max_prefill_length), stop, vocab, max_top)


# The engine holds each setting in a per-slot int32 / float32 field: a value past it would fail
# (or wrap) at insert time, inside the decode loop, instead of naming itself to its caller; a
# float float32 cannot hold (``limits.float32_refusal``) would sample with another value.
_INT32_MAX = 2**31 - 1


def check_request(
    prompt_ids: Any,
    sampling: SamplingParams | Sequence[SamplingParams],
    n: int | None,
    limits: RequestLimits,
) -> tuple[np.ndarray, list[SamplingParams]]:
    """A submission's prompt as int32 ids and one ``SamplingParams`` per sample, validated
    against the engine's ``limits`` (every error names the bad value and the limit)."""
    prompt = _prompt(prompt_ids, limits)
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
        _check_sampling(sp, limits)
    return prompt, samplings


def _prompt(prompt_ids: Any, limits: RequestLimits) -> np.ndarray:
    raw = np.asarray(list(prompt_ids))
    if raw.ndim != 1 or raw.size == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence, got {prompt_ids!r}")
    if raw.dtype.kind not in "iuO":
        raise ValueError(f"prompt_ids must be integer token ids, got {raw.dtype} values")
    high = _INT32_MAX + 1 if limits.vocab is None else int(limits.vocab)
    ok = [isinstance(t, int) and 0 <= t < high for t in raw] if raw.dtype.kind == "O" else None
    bad = np.flatnonzero((raw < 0) | (raw >= high) if ok is None else ~np.array(ok))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"prompt_ids[{i}]={raw.tolist()[i]} is outside the vocabulary: ids must be in "
            f"[0, {high})"
        )
    if raw.size > limits.max_prefill:
        raise ValueError(
            f"prompt has {raw.size} tokens; this engine allows at most "
            f"max_prefill_length={limits.max_prefill}"
        )
    return raw.astype(np.int32)


def _check_sampling(sp: SamplingParams, limits: RequestLimits) -> None:
    if sp.top_logprobs > limits.max_top:
        raise ValueError(
            f"top_logprobs={sp.top_logprobs} alternatives per token; this engine reports at "
            f"most {limits.max_top}"
        )
    if limits.max_stop is not None and len(sp.stop_token_ids) > limits.max_stop:
        raise ValueError(
            f"{len(sp.stop_token_ids)} stop_token_ids {sp.stop_token_ids}; this engine "
            f"holds at most max_stop_tokens={limits.max_stop}"
        )
    for name in ("top_k", "max_tokens"):
        value = getattr(sp, name)
        if value > _INT32_MAX:
            raise ValueError(f"{name}={value} is past what the engine holds: at most {_INT32_MAX}")
    for name in FLOAT_SAMPLING:
        refusal = float32_refusal(name, getattr(sp, name))
        if refusal is not None:
            raise ValueError(refusal)
    outside = [t for t in sp.stop_token_ids if not -_INT32_MAX - 1 <= t <= _INT32_MAX]
    if outside:
        raise ValueError(f"stop_token_ids hold {outside[0]}, outside int32 token ids")
