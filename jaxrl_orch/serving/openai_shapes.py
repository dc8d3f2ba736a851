"""Response bodies and stream chunks of the OpenAI text endpoints, as OpenAI writes them.

What it owns: ``Reply`` (one response's id, timestamp, served model and endpoint kind) and the
JSON it sends: the whole ``text_completion`` / ``chat.completion`` body, the ``text_completion``
/ ``chat.completion.chunk`` stream chunks (the first chat chunk of each choice carries
``role: assistant``), the usage chunk (empty ``choices``), and the two log-prob shapes:
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` and chat's
``{content: [{token, logprob, bytes, top_logprobs: []}]}``.

Our extras ride on each choice: ``policy_versions`` (the params version that produced each
token, one per token, for the chunk's tokens in a stream) and, when asked with vLLM's
``return_token_ids``, ``token_ids`` (and ``prompt_token_ids``).

Log-probs are the sampled token's only, at the sampling temperature (greedy: the plain
log-softmax), as the engine recorded them; completions' ``top_logprobs`` (``logprobs=1``) holds
just that token. An engine that records none reports null.

Pure shaping: it reads finished ``generation.Choice`` records and never touches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from jaxrl_orch.serving.detokenize import token_text
from jaxrl_orch.serving.generation import Choice, Generation

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.models.tokenizer import Tokenizer


@dataclasses.dataclass
class Reply:
    chat: bool
    model: str
    tokenizer: Tokenizer
    logprobs: int | None  # completions: 0 / 1; chat: 1 when asked, else None
    token_ids: bool = False  # vLLM's return_token_ids
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, gen: Generation) -> dict[str, Any]:
        choices = [
            self._choice(c, slice(0, len(c.token_ids)), c.text, final=True) for c in gen.choices
        ]
        out = {**self._head(self.object), "choices": choices, "usage": gen.usage()}
        if self.token_ids:
            out["prompt_token_ids"] = gen.prompt_ids
        return out

    def opening_chunks(self, gen: Generation) -> list[dict[str, Any]]:
        """Chat streams announce the assistant role once per choice before any text."""
        if not self.chat:
            return []
        return [
            self._chunk(
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                    "policy_versions": [],
                }
            )
            for c in gen.choices
        ]

    def chunk(self, choice: Choice, delta: str) -> dict[str, Any]:
        return self._chunk(self._choice(choice, choice.unreported(), delta, final=False))

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**self._head(self._chunk_kind), "choices": [], "usage": gen.usage()}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self._chunk_kind), "choices": [choice]}

    def _choice(self, c: Choice, span: slice, text: str, *, final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"index": c.index}
        if self.chat:
            key = "message" if final else "delta"
            out[key] = {"role": "assistant", "content": text} if final else _delta(text)
        else:
            out["text"] = text
        out["logprobs"] = self._logprobs(c, span)
        out["finish_reason"] = c.finish_reason if final or c.finish_reason else None
        out["policy_versions"] = c.versions[span]
        if self.token_ids:
            out["token_ids"] = c.token_ids[span]
        return out

    def _logprobs(self, c: Choice, span: slice) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        texts = [token_text(self.tokenizer, t) for t in c.token_ids[span]]
        values = [_finite(lp) for lp in c.logprobs[span]]
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, v in zip(texts, values, strict=True)
                ]
            }
        top = [{t: v} for t, v in zip(texts, values, strict=True)] if self.logprobs else None
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": top,
            "text_offset": c.text_offsets[span],
        }


def _delta(text: str) -> dict[str, str]:
    return {"content": text} if text else {}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; JSON without NaN (which JSON cannot carry)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)
    return f"data: {data}\n\n"
