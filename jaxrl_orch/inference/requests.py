"""The driver's request records and the small helpers around them.

What it owns: ``Group`` (one submitted prompt with its samples' futures and sampling params,
and the prefilled prefix they share) and ``Seq`` (one running sample: its future and the ids,
log-probs and versions generated so far); ``resolve`` (settle a future exactly once, whatever
the caller did with it); ``accepts`` (whether an engine method takes an optional keyword, so a
plain JetStream-shaped engine can be driven too); ``first_token`` (the token a JetStream-style
engine samples at prefill). Host-side only; the thread that uses them is ``driver.py``'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
from typing import Any

import numpy as np

from jaxrl_orch.types import SamplingParams

STOPPED = "InferenceDriver stopped before the request finished"
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
    data = result.get_result_at_slot(0)
    valid = np.asarray(data.valid).reshape(-1)
    if valid.size == 0 or not valid[0]:
        return None
    lp = float(np.asarray(data.logprobs).reshape(-1)[0]) if data.logprobs is not None else NO_LP
    return int(np.asarray(data.tokens).reshape(-1)[0]), lp
