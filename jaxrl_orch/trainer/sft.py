"""SFT warm-up on the trainer's machinery: (prompt ids, reference completion ids) -> steps.

Owns: turning a prompt and its reference completion into a ``Sample`` whose loss mask covers
only the completion (the prompt is context, as in RL), and the warm-up loop that packs a batch
of such samples and takes one optimizer step per batch on a ``Trainer`` built with
``StepConfig(kind="sft")``. It never touches versions or publishers: the warm-up produces the
initial policy; RL versions start counting after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jaxrl_orch.types import NO_VERSION, Sample, TrainBatch


def sft_sample(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> Sample:
    """Loss on the completion only; advantages 1 (unused by the SFT loss), temperature 1."""
    if not completion_ids:
        raise ValueError("an SFT sample needs at least one completion token")
    tokens = np.asarray([*prompt_ids, *completion_ids], np.int32)
    mask = np.zeros(tokens.shape[0], bool)
    mask[len(prompt_ids) :] = True
    n = tokens.shape[0]
    return Sample(
        token_ids=tokens,
        loss_mask=mask,
        logprobs=np.zeros(n, np.float32),
        advantages=mask.astype(np.float32),
        temperatures=np.ones(n, np.float32),
        versions=np.full(n, NO_VERSION, np.int32),
    )


def run_sft(
    trainer,
    batches: Iterator[list[Sample]],
    steps: int,
    *,
    start: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Steps ``start + 1 .. steps``, one optimizer step per batch from ``batches`` (``start``:
    steps a restored checkpoint already took); returns the per-step metrics of this call."""
    if trainer.step_cfg.kind != "sft":
        raise ValueError(
            f"run_sft needs a trainer built with kind='sft', got {trainer.step_cfg.kind!r}"
        )
    history = []
    t0 = time.perf_counter()
    for i in range(start + 1, steps + 1):
        samples = next(batches)
        # The trainer's own packing rounds the row count to its chunking (few distinct shapes).
        packed = trainer.pack(TrainBatch(step=i, samples=samples, rollouts=[]))
        metrics = trainer.train_packed(packed)
        metrics = {f"sft/{k}": v for k, v in metrics.items()}
        metrics["sft/step"] = float(i)
        metrics["sft/elapsed_s"] = time.perf_counter() - t0
        history.append(metrics)
        if on_step is not None:
            on_step(i, metrics)
    return history
