"""Prompt scoring: the log-prob of each prompt token given its prefix, and the top-k there.

What it owns: ``prompt_scores`` (the traced maths the engine's scoring program runs on a
prompt's logits), ``PromptScores`` (what a scored prompt gives its caller, host data) and
``ScoreQueue`` (prompts waiting for the driver's loop to score them).

The distribution: ``log_softmax`` of the raw logits, no temperature (``T = 1``), over the full
vocabulary; the quantity the trainer's log-probs are at ``T = 1`` (``algorithms.losses``
``token_logprobs``; ``tests/inference/test_prompt_scoring.py`` holds the two equal) and what an
eval's log-likelihood means. It is computed as ``logit - logsumexp(logits)`` so no second
``[L, V]`` array is built, and the prompt token's value and its top-k entry come from the one
expression: equal, bit for bit, when the token is among the top k (an eval's "is greedy" test
compares them).

Alignment (vLLM's ``prompt_logprobs``): position 0 has nothing before it, so its entry is None;
position i >= 1 holds token i's log-prob given tokens ``[0, i)``, its rank (1 + the tokens
strictly more likely) and the ``k`` most likely tokens there, most likely first. The program
always computes ``MAX_TOP_LOGPROBS`` of them (one program per prompt bucket, whatever k) and
the host keeps k.

How it runs: the driver's loop thread scores queued prompts between two decode steps, one
prompt per prefill-shaped forward (``prefixes.Prefixes.score``), never inside a decode step;
the forward also yields the prompt's KV, kept in the prefix cache, so an echo that also
generates prefills once. ``PromptScores.version`` is the params version that scored it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def prompt_scores(logits: jax.Array, tokens: jax.Array, k: int) -> dict[str, jax.Array]:
    """Traced: ``logits[L, V]`` of a prompt ``tokens[L]`` -> per position t < L - 1 the scores
    of token t + 1: ``logprobs[L-1]``, ``ranks[L-1]``, ``top_logprobs[L-1, k]``,
    ``top_ids[L-1, k]``."""
    logits = logits[:-1].astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[1:, None].astype(jnp.int32), axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logits, k)
    return {
        "logprobs": chosen - lse,
        "ranks": 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32),
        "top_logprobs": top - lse[:, None],
        "top_ids": ids.astype(jnp.int32),
    }


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """One scored prompt: per position (None at 0) the token's log-prob, its rank and the
    ``top`` most likely ``(id, logprob)`` pairs; ``version`` scored it."""

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[int, float]] | None]
    version: int

    @classmethod
    def of(cls, prompt: np.ndarray, arrays: dict[str, Any], k: int, version: int) -> PromptScores:
        """From ``prompt_scores``' arrays of ``prompt`` padded to a bucket: the prompt's own
        positions, ``k`` alternatives each."""
        n = int(prompt.size) - 1
        host = {name: np.asarray(a)[:n] for name, a in arrays.items()}
        ids = host["top_ids"][:, :k].tolist()
        values = host["top_logprobs"][:, :k].tolist()
        top = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        return cls(
            token_ids=prompt.tolist(),
            logprobs=[None, *host["logprobs"].tolist()],
            ranks=[None, *host["ranks"].tolist()],
            top=[None, *top],
            version=int(version),
        )


@dataclasses.dataclass(eq=False)
class ScoreRequest:
    prompt: np.ndarray
    top_logprobs: int
    future: concurrent.futures.Future


class ScoreQueue:
    """Prompts to score, in arrival order. Called under the driver's condition variable."""

    def __init__(self) -> None:
        self._pending: collections.deque[ScoreRequest] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, prompt: np.ndarray, top_logprobs: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.append(ScoreRequest(prompt, top_logprobs, future))
        return future

    def pop(self) -> ScoreRequest | None:
        """The oldest request its caller still waits for (cancelled ones are dropped)."""
        while self._pending:
            request = self._pending.popleft()
            if not request.future.cancelled():
                return request
        return None

    def drain(self) -> list[concurrent.futures.Future]:
        futures = [r.future for r in self._pending]
        self._pending.clear()
        return futures
