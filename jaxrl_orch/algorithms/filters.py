"""Rollout filters: flag rollouts that must not be trained on, with a reason.

What this owns: the ``Filter`` interface and the stock filters. A filter looks at a list of
rollouts (one group for pre-filters, one batch cohort for post-filters) and, for each rollout
it rejects, sets ``rollout.filtered = True`` and appends its ``reason`` to
``rollout.filter_reasons``. Filters never drop, reorder or otherwise edit rollouts: the caller
(the train sink) decides what flagged rollouts mean (skipped from the batch, counted in the
metrics by reason).

Stock filters (any may be used as a pre- or post-filter):

- ``ZeroVarianceFilter``  ``zero_variance``: every rollout of a group whose rewards are all
  equal (within ``atol``). Such a group has zero advantage everywhere, so it carries no
  gradient; with DAPO dynamic sampling the sink drops it and waits for a replacement group.
  Groups are found by ``group_id`` within the list, so it works on a group or a cohort.
- ``RepetitionFilter``    ``repetition``: the model's tokens (``loss_mask`` true, all turns
  concatenated) repeat themselves: the fraction of their ``n``-grams that are repeats of an
  earlier ``n``-gram, ``1 - unique/total``, exceeds ``max_ratio``. Completions shorter than
  ``min_ngrams`` n-grams are never flagged (too short to call degenerate).
- ``LengthFilter``        ``length``: more than ``max_model_tokens`` model tokens; and
  ``truncated``: the environment flagged the rollout as cut off by the token limit
  (``finish_reason == "length"``) by setting ``rollout.metrics[truncated_key]`` to a non-zero
  value (default key ``"truncated"``).
- ``NoModelTokensFilter`` ``no_model_tokens``: nothing to train on (no loss-masked token).

Invariants: a filter flags each rollout at most once per call and never clears a flag set by
another filter (reasons accumulate). Pure host code; it must never import orchestration,
engine or trainer code.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from jaxrl_orch.types import Rollout


@runtime_checkable
class Filter(Protocol):
    """Flags rollouts in place. ``reject`` returns the rejection reason per rollout."""

    name: str

    def reject(self, rollouts: Sequence[Rollout]) -> list[str | None]: ...


def flag(rollout: Rollout, reason: str) -> None:
    """Mark ``rollout`` filtered with ``reason`` (reasons accumulate, no duplicates)."""
    rollout.filtered = True
    if reason not in rollout.filter_reasons:
        rollout.filter_reasons.append(reason)


def apply_filters(filters: Iterable[Filter], rollouts: Sequence[Rollout]) -> dict[str, int]:
    """Run each filter over ``rollouts`` in order; return how many each reason flagged.

    Every filter sees every rollout, including ones an earlier filter flagged, so the counts
    show each reason independently (a rollout may carry several reasons).
    """
    counts: dict[str, int] = defaultdict(int)
    for f in filters:
        reasons = f.reject(rollouts)
        if len(reasons) != len(rollouts):
            raise ValueError(
                f"filter {f.name!r} returned {len(reasons)} verdicts for {len(rollouts)} rollouts"
            )
        for r, reason in zip(rollouts, reasons, strict=True):
            if reason is not None:
                flag(r, reason)
                counts[reason] += 1
    return dict(counts)


def model_tokens(rollout: Rollout) -> list[int]:
    """The model's own tokens of a rollout trace, all turns concatenated."""
    return [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]


def ngram_repeat_ratio(tokens: Sequence[int], n: int) -> float:
    """Fraction of the ``n``-grams of ``tokens`` that repeat an earlier one (0 if none)."""
    if n < 1:
        raise ValueError(f"n-gram size must be >= 1, got {n!r}")
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    unique = {tuple(tokens[i : i + n]) for i in range(total)}
    return 1.0 - len(unique) / total


@dataclasses.dataclass(frozen=True)
class ZeroVarianceFilter:
    atol: float = 1e-6
    name: str = "zero_variance"

    def reject(self, rollouts: Sequence[Rollout]) -> list[str | None]:
        by_group: dict[int, list[float]] = defaultdict(list)
        for r in rollouts:
            # Non-finite rewards cannot show signal; they are filtered on their own account.
            if math.isfinite(r.reward):
                by_group[r.group_id].append(r.reward)
        signal = {
            gid
            for gid, rewards in by_group.items()
            if len(rewards) >= 2 and max(rewards) - min(rewards) > self.atol
        }
        return [None if r.group_id in signal else self.name for r in rollouts]


@dataclasses.dataclass(frozen=True)
class RepetitionFilter:
    n: int = 4
    max_ratio: float = 0.5
    min_ngrams: int = 16
    name: str = "repetition"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"RepetitionFilter n must be >= 1, got {self.n!r}")
        if not 0.0 <= self.max_ratio < 1.0:
            raise ValueError(
                f"RepetitionFilter max_ratio must be in [0, 1), got {self.max_ratio!r}"
            )

    def reject(self, rollouts: Sequence[Rollout]) -> list[str | None]:
        out: list[str | None] = []
        for r in rollouts:
            toks = model_tokens(r)
            if len(toks) - self.n + 1 < self.min_ngrams:
                out.append(None)
                continue
            out.append(self.name if ngram_repeat_ratio(toks, self.n) > self.max_ratio else None)
        return out


@dataclasses.dataclass(frozen=True)
class LengthFilter:
    max_model_tokens: int | None = None
    drop_truncated: bool = True
    truncated_key: str = "truncated"
    name: str = "length"

    def __post_init__(self) -> None:
        if self.max_model_tokens is not None and self.max_model_tokens < 1:
            raise ValueError(
                f"LengthFilter max_model_tokens must be >= 1 or None, got {self.max_model_tokens!r}"
            )

    def reject(self, rollouts: Sequence[Rollout]) -> list[str | None]:
        out: list[str | None] = []
        for r in rollouts:
            reason = None
            if self.max_model_tokens is not None and r.num_model_tokens > self.max_model_tokens:
                reason = "length"
            elif self.drop_truncated:
                v = r.metrics.get(self.truncated_key, 0.0)
                if v and not (isinstance(v, float) and math.isnan(v)):
                    reason = "truncated"
            out.append(reason)
        return out


@dataclasses.dataclass(frozen=True)
class NoModelTokensFilter:
    name: str = "no_model_tokens"

    def reject(self, rollouts: Sequence[Rollout]) -> list[str | None]:
        return [None if r.num_model_tokens > 0 else self.name for r in rollouts]
