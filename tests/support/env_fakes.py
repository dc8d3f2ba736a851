"""Fakes for env tests: a byte tokenizer and a scripted inference client.

The fake tokenizer maps byte b to id b + 3 (0 pad, 1 bos, 2 eos), like a byte-level model's.
The scripted client returns pre-written turns, records every prompt it was sent, and stamps
each turn with its own version and distinctive log-probs so tests can check alignment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from jaxrl_orch.types import Completion, SamplingParams

OFFSET = 3


class FakeByteTokenizer:
    pad_id, bos_id, eos_id = 0, 1, 2
    vocab_size = 256 + OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        body = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


class ScriptedClient:
    """Plays back ``turns``: each is (text, version, finish_reason, append_eos)."""

    def __init__(self, tokenizer, turns):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []

    async def generate(self, prompt_ids, sampling):
        await asyncio.sleep(0)
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        text, version, finish, eos = self.turns[len(self.prompts) - 1]
        ids = self.tokenizer.encode(text) + ([self.tokenizer.eos_id] if eos else [])
        ids = ids[: sampling.max_tokens]
        # Distinctive per-turn log-probs: turn k, token j -> -(k + 1) - j / 1000.
        k = len(self.prompts) - 1
        logprobs = [-(k + 1) - j / 1000 for j in range(len(ids))]
        return Completion(ids, logprobs, [version] * len(ids), finish)
