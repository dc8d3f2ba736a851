"""Rollout traces -> training ``Sample``s, one whole prompt group per vectorised pass.

What it owns: the conversion the train sink calls "tokenize" (the traces already hold the
engine's token ids; nothing is re-tokenized). Each rollout becomes one ``Sample``: token ids as
sampled, the loss mask, behavior log-probs and versions kept on model tokens (``0`` and
``NO_VERSION`` elsewhere, as the ``Sample`` contract requires), the sampling temperature fanned
out to every token, advantages zero until the group is scored.

Why per group: a rollout's arrays are short, so converting them one rollout at a time costs
mostly NumPy call overhead (a dozen calls per rollout). ``group_to_samples`` concatenates the
group's traces, converts each field once, and hands every rollout views into the shared
buffers; ``GroupArrays`` keeps those buffers so the sink can fan advantages out and check
log-probs for the whole group in one call each.

Invariants: the result is exactly what ``trace_to_sample`` gives per rollout (the tests compare
them); a rollout whose trace cannot be converted (misaligned lengths, values that do not fit
the dtypes) never poisons its group: the group falls back to per-rollout conversion, so only
that rollout fails, with the error ``trace_to_sample`` raises. Pure host NumPy; it touches only
the rollouts it is given (it may run on a worker thread) and never imports another
orchestrator component. A rollout whose trace branches (``Rollout.branches``) becomes a sample per
path (``trace_to_samples``); its group takes the per-rollout path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_orch.types import NO_VERSION, Branch, Rollout, Sample


def trace_to_sample(rollout: Rollout) -> Sample:
    """One rollout trace -> one ``Sample`` (advantages zero until the group is scored).

    Non-model tokens get log-prob 0 and version ``NO_VERSION`` whatever the trace says.
    Raises ``ValueError`` for a trace whose fields have different lengths.
    """
    rollout.validate_trace()
    return _path_sample(rollout, rollout.temperature)


def trace_to_samples(rollout: Rollout) -> list[Sample]:
    """The rollout's own trace, then each of its ``branches``: one ``Sample`` per path."""
    rollout.validate_trace()
    return [_path_sample(p, rollout.temperature) for p in (rollout, *rollout.branches)]


def _path_sample(path: Rollout | Branch, temperature: float) -> Sample:
    mask = np.asarray(path.loss_mask, dtype=bool)
    n = mask.shape[0]
    return Sample(
        token_ids=np.asarray(path.token_ids, dtype=np.int32).reshape(n),
        loss_mask=mask,
        logprobs=np.where(mask, np.asarray(path.logprobs, np.float32).reshape(n), 0.0).astype(
            np.float32
        ),
        advantages=np.zeros(n, np.float32),
        temperatures=np.full(n, temperature, np.float32),
        versions=np.where(mask, np.asarray(path.versions, np.int64).reshape(n), NO_VERSION).astype(
            np.int32
        ),
    )


@dataclasses.dataclass(eq=False)
class GroupArrays:
    """The shared buffers behind one group's samples. Only rollouts that were converted are
    listed."""

    rollouts: list[Rollout]
    lengths: list[int]  # tokens per rollout, in order: rollout i owns the i-th stretch
    loss_mask: np.ndarray  # bool, all tokens of the group
    logprobs: np.ndarray  # float32
    advantages: np.ndarray  # float32; every sample's ``advantages`` is a view into it

    def all_logprobs_finite(self) -> bool:
        return bool(np.isfinite(self.logprobs).all())

    def fan_out(self, advantages: np.ndarray) -> None:
        """Write one advantage per listed rollout onto its model tokens (0 elsewhere)."""
        per_token = np.repeat(np.asarray(advantages, np.float32), self.lengths)
        np.multiply(per_token, self.loss_mask, out=self.advantages)


def group_to_samples(rollouts: Sequence[Rollout]) -> GroupArrays | None:
    """Give every rollout in ``rollouts`` its one ``Sample`` (``rollout.samples``), converting
    the group in one pass. Returns the shared buffers, or None when some trace could not be
    converted with the others: then the caller converts per rollout (``trace_to_sample``)."""
    lens: list[int] = []
    toks: list[int] = []
    mask: list[bool] = []
    lps: list[float] = []
    vers: list[int] = []
    temps: list[float] = []
    for r in rollouts:
        n = len(r.token_ids)
        if r.branches or not n == len(r.loss_mask) == len(r.logprobs) == len(r.versions):
            return None  # a branching trace takes the per-rollout path (a sample per branch)
        lens.append(n)
        toks += r.token_ids
        mask += r.loss_mask
        lps += r.logprobs
        vers += r.versions
        temps.append(r.temperature)
    total = len(toks)
    try:
        tok_a = np.array(toks, np.int32)
        mask_a = np.array(mask, bool)
        lp_a = np.array(lps, np.float32)
        ver_a = np.array(vers, np.int64)
    except (ValueError, TypeError, OverflowError):
        return None
    if not tok_a.shape == mask_a.shape == lp_a.shape == ver_a.shape == (total,):
        return None  # nested or ragged entries: let the per-rollout path name the culprit
    lp_a[~mask_a] = 0.0
    ver_a = np.where(mask_a, ver_a, NO_VERSION).astype(np.int32)
    temp_a = np.repeat(np.array(temps, np.float32), lens)
    adv_a = np.zeros(total, np.float32)
    a = 0
    for r, n in zip(rollouts, lens, strict=True):
        b = a + n
        # Positional, in the field order of ``Sample``.
        r.samples = [
            Sample(tok_a[a:b], mask_a[a:b], lp_a[a:b], adv_a[a:b], temp_a[a:b], ver_a[a:b])
        ]
        a = b
    return GroupArrays(list(rollouts), lens, mask_a, lp_a, adv_a)
