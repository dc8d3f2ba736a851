"""Sequence packing: variable-length training samples -> fixed-shape ``[R, row_len]`` rows.

What this owns: ``pack_samples`` and its output ``PackedBatch``. Samples are placed whole into
rows of ``row_len`` tokens by first-fit-decreasing (longest sample first, into the first row
with room; ties keep input order), so the trainer runs a few dense rows instead of many
padded ones. For example, 128 samples of ~150 tokens (~19,000 tokens) in rows of
2,048 pack 13 to a row into 10 rows.

Per-token arrays (numpy, ``[R, row_len]``):

- ``tokens`` int32, ``loss_mask`` bool, ``advantages`` / ``logprobs`` float32: copied from the
  samples, aligned exactly as in ``Sample`` (token ``t``'s behavior log-prob sits at ``t``).
- ``temperatures`` float32: each token's sampling temperature.
- ``segment_ids`` int32: 1, 2, ... for the samples of a row in placement order; 0 = padding.
  The model restricts attention to equal segment ids, so packed samples never see each other.
- ``positions`` int32: restart at 0 at each sample's first token.

Padding: token ``pad_id`` (default 0), position 0, segment 0, loss_mask False, advantage 0,
logprob 0, temperature 1.0 (so a trainer that divides logits by the temperature never divides
by zero on padding).

Invariants: every token of every sample appears exactly once, contiguous and in order, in one
row (``placement[i] = (row, start, length)`` says where sample ``i`` went); no sample spans
two rows; padding carries no loss. With ``num_rows`` the row count is padded up to a fixed
value (fixed shapes for ``jit``); if the samples need more rows it raises. A sample longer
than ``row_len`` raises unless ``truncate=True``, which keeps its first ``row_len`` tokens.

Who drives it: the trainer, once per ``TrainBatch``. Pure host NumPy; never imports
orchestration, engine or trainer code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_orch.types import Sample

PAD_TEMPERATURE = 1.0


@dataclasses.dataclass
class PackedBatch:
    tokens: np.ndarray  # int32 [R, L]
    positions: np.ndarray  # int32 [R, L]
    segment_ids: np.ndarray  # int32 [R, L], 0 = padding
    loss_mask: np.ndarray  # bool [R, L]
    advantages: np.ndarray  # float32 [R, L]
    logprobs: np.ndarray  # float32 [R, L]
    temperatures: np.ndarray  # float32 [R, L]
    placement: np.ndarray  # int64 [N, 3]: (row, start, length) per input sample

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def row_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def num_samples(self) -> int:
        return int(self.placement.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.segment_ids > 0).sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def fill_ratio(self) -> float:
        """Real tokens / slots; 0.0 for an empty batch."""
        slots = self.tokens.size
        return self.num_tokens / slots if slots else 0.0

    def samples_per_row(self) -> np.ndarray:
        return self.segment_ids.max(axis=1, initial=0).astype(np.int64)


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Assign item indices to bins of capacity ``row_len``; returns bins in creation order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(row_len - n)
    return bins


def _check_sample(i: int, s: Sample) -> None:
    n = len(s)
    for field in ("loss_mask", "logprobs", "advantages", "temperatures"):
        got = np.shape(getattr(s, field))
        if got != (n,):
            raise ValueError(
                f"sample {i}: {field} has shape {got} but token_ids has {n} tokens; "
                "every per-token array must have the same length"
            )


def pack_samples(
    samples: Sequence[Sample],
    row_len: int,
    *,
    num_rows: int | None = None,
    truncate: bool = False,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack ``samples`` into rows of ``row_len`` tokens (first-fit-decreasing)."""
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len!r}")
    if num_rows is not None and num_rows < 0:
        raise ValueError(f"num_rows must be >= 0 or None, got {num_rows!r}")
    lengths: list[int] = []
    for i, s in enumerate(samples):
        _check_sample(i, s)
        n = len(s)
        if n == 0:
            raise ValueError(f"sample {i} is empty; every sample needs at least one token")
        if n > row_len:
            if not truncate:
                raise ValueError(
                    f"sample {i} has {n} tokens, more than row_len={row_len}; raise row_len, "
                    "shorten the rollout, or pass truncate=True to keep its first row_len tokens"
                )
            n = row_len
        lengths.append(n)

    bins = first_fit_decreasing(lengths, row_len)
    rows = len(bins) if num_rows is None else num_rows
    if len(bins) > rows:
        raise ValueError(
            f"{len(samples)} samples ({sum(lengths)} tokens) need {len(bins)} rows of "
            f"{row_len} tokens, but num_rows={num_rows}"
        )

    shape = (rows, row_len)
    out = PackedBatch(
        tokens=np.full(shape, pad_id, np.int32),
        positions=np.zeros(shape, np.int32),
        segment_ids=np.zeros(shape, np.int32),
        loss_mask=np.zeros(shape, bool),
        advantages=np.zeros(shape, np.float32),
        logprobs=np.zeros(shape, np.float32),
        temperatures=np.full(shape, PAD_TEMPERATURE, np.float32),
        placement=np.zeros((len(samples), 3), np.int64),
    )
    for row, members in enumerate(bins):
        start = 0
        for seg, i in enumerate(members, start=1):
            s = samples[i]
            n = lengths[i]
            sl = slice(start, start + n)
            out.tokens[row, sl] = s.token_ids[:n]
            out.positions[row, sl] = np.arange(n, dtype=np.int32)
            out.segment_ids[row, sl] = seg
            out.loss_mask[row, sl] = s.loss_mask[:n]
            out.advantages[row, sl] = s.advantages[:n]
            out.logprobs[row, sl] = s.logprobs[:n]
            out.temperatures[row, sl] = s.temperatures[:n]
            out.placement[i] = (row, start, n)
            start += n
    return out
