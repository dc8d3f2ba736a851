"""Shared pieces of the verifiers adapter tests (``envs.vf``): engines and clients to point at.

- ``tiny_byte_engine(version)``: the embedded default's tiny byte model on a real
  ``DecodeEngine`` with random weights, served by an ``InferenceDriver`` that stamps ``version``
  on every token; ``EngineClient`` over it.
- ``RecordingClient(inner)``: an ``InferenceClient`` that keeps every completion the engine
  returned, as the reference a rollout's sampled spans must equal.
- ``ScriptedClient(tokenizer, texts, versions)``: an engine that answers call ``k`` with the ids
  of ``texts[k]`` (so a test can make a tiny model call a tool), log-probs that differ per token
  and per-token ``versions``; it records prompts and can be made to wait (``hold``) so a test can
  cancel a rollout mid-request and see the request cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from jaxrl_orch.types import Completion, SamplingParams


def tiny_byte_engine(version: int = 3) -> tuple[Any, Any, Any]:
    """``(tokenizer, client, driver)``; the caller stops the driver."""
    from jaxrl_orch.compose.model import model_config
    from jaxrl_orch.inference.client import EngineClient
    from jaxrl_orch.inference.driver import InferenceDriver
    from jaxrl_orch.inference.engine import DecodeEngine
    from jaxrl_orch.inference.limits import EngineLimits
    from jaxrl_orch.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("byte")
    limits = EngineLimits(
        max_concurrent_decodes=4, max_target_length=256, max_prefill_length=192, steps_per_call=8
    )
    engine = DecodeEngine(model_config("tiny-byte", tokenizer), limits=limits)
    driver = InferenceDriver(engine, engine.load_params(seed=0), version)
    driver.start()
    return tokenizer, EngineClient(driver), driver


class RecordingClient:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], SamplingParams, Completion]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        out = await self.inner.generate(prompt_ids, sampling)
        self.calls.append((list(prompt_ids), sampling, out))
        return out


class ScriptedClient:
    def __init__(self, tokenizer: Any, texts: Sequence[str], versions: Sequence[int]) -> None:
        self.tokenizer, self.texts, self.versions = tokenizer, list(texts), list(versions)
        self.prompts: list[list[int]] = []
        self.replies: list[Completion] = []
        self.hold: asyncio.Event | None = None  # set: requests wait for it
        self.cancelled = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        k = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        if self.hold is not None:
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        ids = self.tokenizer.encode(self.texts[k % len(self.texts)])
        half = len(ids) // 2  # the weights changed mid-turn: two versions in one reply
        v0 = self.versions[k % len(self.versions)]
        out = Completion(
            token_ids=ids,
            logprobs=[-0.25 - 0.01 * i - 0.1 * k for i in range(len(ids))],
            versions=[v0] * half + [v0 + 1] * (len(ids) - half),
            finish_reason="stop",
        )
        self.replies.append(out)
        return out
