"""A tiny model config (d_model 32, 2 layers) and random RL batches for the trainer tests."""

import numpy as np

from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.types import Sample, TrainBatch

TINY = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    max_seq_len=64,
)


def make_sample(rng: np.random.Generator, n: int, vocab: int = 64) -> Sample:
    """A prompt (first half, no loss) + a completion with one advantage and engine log-probs."""
    mask = np.zeros(n, bool)
    mask[n // 2 :] = True
    return Sample(
        token_ids=rng.integers(1, vocab, n).astype(np.int32),
        loss_mask=mask,
        logprobs=np.where(mask, rng.uniform(-5.0, -3.0, n), 0.0).astype(np.float32),
        advantages=np.where(mask, rng.normal(), 0.0).astype(np.float32),
        temperatures=np.full(n, rng.choice([0.8, 1.0]), np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32),
    )


def make_batch(step: int, seed: int = 0, n_samples: int = 8, max_len: int = 30) -> TrainBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, max_len, n_samples)
    return TrainBatch(step=step, samples=[make_sample(rng, int(n)) for n in lengths], rollouts=[])
