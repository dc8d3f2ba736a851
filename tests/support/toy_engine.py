"""A hand-calculable engine for driver/client tests (host NumPy, no model).

Its "logits" put mass ``STRENGTH`` on token ``(prev + 1 + version) % vocab`` and 0 elsewhere,
so greedy decoding counts upwards (shifted by the params version, so a swap is visible in the
tokens) and every greedy log-prob is ``STRENGTH - log(exp(STRENGTH) + vocab - 1)``. Params are
just the int version. It follows the same contract as the real engine: the last prompt token
is fed by the first generate call, several steps per call, per-slot stop/length handling.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrl_orch.inference.engine_api import ResultTokens
from jaxrl_orch.types import SamplingParams

STRENGTH = 5.0


def greedy_logprob(vocab: int) -> float:
    return STRENGTH - math.log(math.exp(STRENGTH) + vocab - 1)


def expected_tokens(prompt: list[int], n: int, vocab: int, version: int = 0) -> list[int]:
    out, prev = [], prompt[-1]
    for _ in range(n):
        prev = (prev + 1 + version) % vocab
        out.append(prev)
    return out


class ToyEngine:
    def __init__(self, slots=4, vocab=50, steps_per_call=3, cache_len=64, max_prefill=16):
        self.vocab, self.steps = vocab, steps_per_call
        self.max_concurrent_decodes = slots
        self.max_prefill_length = max_prefill
        self.max_target_length = cache_len
        self.prefill_calls = 0
        self.generate_calls = 0
        self.on_generate = None  # test hook, called with the call index before decoding
        self.fail_generate_at: int | None = None
        self.fail_prefill_for: int | None = None  # first prompt token that makes prefill raise

    def init_decode_state(self):
        n = self.max_concurrent_decodes
        return {
            "tok": np.zeros(n, np.int64),
            "pos": np.zeros(n, np.int64),
            "gen": np.zeros(n, np.int64),
            "active": np.zeros(n, bool),
            "max": np.zeros(n, np.int64),
            "stop": [()] * n,
        }

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
        self.prefill_calls += 1
        if self.fail_prefill_for is not None and padded_tokens[0] == self.fail_prefill_for:
            raise ValueError("toy prefill failure")
        prefix = (int(padded_tokens[true_length - 1]), true_length - 1)
        empty = np.zeros((1, 3), np.int32)
        return prefix, ResultTokens(empty, (0, 1), (1, 2), (2, 3))

    def insert(self, prefix, decode_state, slot, sampling):
        assert isinstance(sampling, SamplingParams)
        tok, pos = prefix
        s = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in decode_state.items()}
        s["tok"][slot], s["pos"][slot], s["gen"][slot] = tok, pos, 0
        s["active"][slot], s["max"][slot] = True, sampling.max_tokens
        s["stop"][slot] = sampling.stop_token_ids
        return s

    def generate(self, params, decode_state, version):
        if self.on_generate is not None:
            self.on_generate(self.generate_calls)
        self.generate_calls += 1
        if self.fail_generate_at == self.generate_calls:
            raise RuntimeError("toy generate failure")
        assert params == version
        s = decode_state
        n, k = self.max_concurrent_decodes, self.steps
        toks, valid = np.zeros((n, k), np.int32), np.zeros((n, k), np.int32)
        for j in range(k):
            for b in range(n):
                if not s["active"][b]:
                    continue
                t = (int(s["tok"][b]) + 1 + version) % self.vocab
                toks[b, j], valid[b, j] = t, 1
                s["gen"][b] += 1
                s["tok"][b], s["pos"][b] = t, s["pos"][b] + 1
                if (
                    t in s["stop"][b]
                    or s["gen"][b] >= s["max"][b]
                    or s["pos"][b] >= self.max_target_length
                ):
                    s["active"][b] = False
        lps = np.full((n, k), greedy_logprob(self.vocab), np.float32).view(np.int32)
        vers = np.full((n, k), version, np.int32)
        data = np.concatenate([toks, valid, s["gen"][:, None].astype(np.int32), lps, vers], 1)
        return s, ResultTokens(
            data,
            (0, k),
            (k, 2 * k),
            (2 * k, 2 * k + 1),
            1,
            (2 * k + 1, 3 * k + 1),
            (3 * k + 1, 4 * k + 1),
        )
