"""Response bodies and stream chunks of the OpenAI text endpoints, as OpenAI writes them.

What it owns: ``Reply`` (one response's id, timestamp, served model and endpoint kind) and the
JSON it sends: the whole ``text_completion`` / ``chat.completion`` body, the ``text_completion``
/ ``chat.completion.chunk`` stream chunks (the first chat chunk of each choice carries
``role: assistant``), the usage chunk (empty ``choices``), and the two log-prob shapes:
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` and chat's
``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.

Tool calls (chat with a ``ToolUse``): a reply whose text holds well-formed calls comes back as
``message.tool_calls`` (``id``, ``type: function``, ``function: {name, arguments}``), the text
before them as ``content`` (null when none) and ``finish_reason`` ``tool_calls``; otherwise as
plain content with its own finish reason (``tool_calls.ToolUse.parse``). Streamed, the content
before the calls comes as it is decoded and each call as two chunks, ``{index, id, type,
function: {name, arguments: ""}}`` then ``{index, function: {arguments}}``, after the choice
ended (``tool_calls.ToolStream``), the last carrying the finish reason.

Our extras ride on each choice: ``policy_versions`` (the params version that produced each
token, one per token, for the chunk's tokens in a stream) and, when asked with vLLM's
``return_token_ids``, ``token_ids`` (and ``prompt_token_ids``).

Log-probs of generated tokens are at the sampling temperature (greedy: the plain log-softmax),
as the engine recorded them, and so are their alternatives (chat's ``top_logprobs`` k of them,
most likely first; completions' ``top_logprobs`` a dict of the k most likely and the sampled
token, as vLLM writes it). An engine that records none reports null.

Echo (completions): the choice's text starts with the prompt, and when log-probs are asked its
``logprobs`` start with the prompt's tokens, scored at no temperature (``inference.scoring``):
``token_logprobs`` and ``top_logprobs`` null at the first token, ``text_offset`` each token's
start in the echoed text (the lengths of the tokens' own texts added up, as vLLM counts them),
the completion's offsets after the prompt's; ``prompt_policy_version`` (ours) says which
params scored it.

Pure shaping: it reads finished ``generation.Choice`` records and never touches the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from jaxrl_orch.serving.detokenize import token_text
from jaxrl_orch.serving.generation import Choice, Generation
from jaxrl_orch.serving.tool_calls import ToolStream, ToolUse

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.inference.scoring import PromptScores
    from jaxrl_orch.models.tokenizer import Tokenizer


@dataclasses.dataclass
class Reply:
    chat: bool
    model: str
    tokenizer: Tokenizer
    logprobs: int | None  # alternatives per token (0: none); None: no log-probs asked
    token_ids: bool = False  # vLLM's return_token_ids
    echo: str | None = None  # completions' echo: the prompt's text
    tools: ToolUse | None = None  # chat with tools: the calls its replies may carry
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())
        self._streams: dict[int, ToolStream] = {}  # per choice, while a stream runs

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
        if self.echo is not None:
            scores = gen.prompt_scores
            out["prompt_policy_version"] = None if scores is None else scores.version
            prompt = self._echoed(scores)
            for choice in choices:
                choice["text"] = self.echo + choice["text"]
                if choice["logprobs"] is not None:
                    choice["logprobs"] = _joined(prompt, choice["logprobs"], len(self.echo))
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

    def chunks(self, choice: Choice, delta: str) -> list[dict[str, Any]]:
        """The stream chunks for a choice's text delta (and its end, once it has ended)."""
        if self.tools is None:
            return [self._chunk(self._choice(choice, choice.unreported(), delta, final=False))]
        stream = self._streams.setdefault(choice.index, self.tools.stream())
        text, calls = stream.feed(delta), []
        if choice.finish_reason is not None:
            tail, calls = stream.finish()
            text += tail
        first = self._choice(choice, choice.unreported(), text, final=False)
        if not calls:
            return [self._chunk(first)]
        # OpenAI's and vLLM's order: per call its index, id, type and name, then its
        # arguments; the finish reason rides on the last chunk.
        first["finish_reason"] = None
        out = [self._chunk(first)]
        for i, call in enumerate(calls):
            head = {"index": i, "id": call.id, "type": "function"}
            named = {**head, "function": {"name": call.name, "arguments": ""}}
            out.append(self._chunk(self._bare(choice, {"tool_calls": [named]})))
            args = {"index": i, "function": {"arguments": call.arguments}}
            out.append(self._chunk(self._bare(choice, {"tool_calls": [args]})))
        out[-1]["choices"][0]["finish_reason"] = "tool_calls"
        return out

    def _bare(self, c: Choice, delta: dict[str, Any]) -> dict[str, Any]:
        """A chunk's choice carrying ``delta`` and no tokens."""
        out = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
        out["policy_versions"] = []
        if self.token_ids:
            out["token_ids"] = []
        return out

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**self._head(self._chunk_kind), "choices": [], "usage": gen.usage()}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self._chunk_kind), "choices": [choice]}

    def _choice(self, c: Choice, span: slice, text: str, *, final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"index": c.index}
        finish = c.finish_reason if final or c.finish_reason else None
        if self.chat and final:
            out["message"], finish = self._message(text, finish)
        elif self.chat:
            out["delta"] = _delta(text)
        else:
            out["text"] = text
        out["logprobs"] = self._logprobs(c, span)
        out["finish_reason"] = finish
        out["policy_versions"] = c.versions[span]
        if self.token_ids:
            out["token_ids"] = c.token_ids[span]
        return out

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole reply's message and finish reason: its tool calls when it made any."""
        parsed = None if self.tools is None else self.tools.parse(text)
        if parsed is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = parsed
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ],
        }
        return message, "tool_calls"

    def _logprobs(self, c: Choice, span: slice) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        texts = [token_text(self.tokenizer, t) for t in c.token_ids[span]]
        values = [_finite(lp) for lp in c.logprobs[span]]
        alts = c.tops[span]
        if self.chat:
            return {
                "content": [
                    {**_entry(t, v), "top_logprobs": [_entry(*self._alt(a)) for a in top]}
                    for t, v, top in zip(texts, values, alts, strict=True)
                ]
            }
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": self._legacy_top(texts, values, alts),
            "text_offset": c.text_offsets[span],
        }

    def _alt(self, alternative: tuple[int, float]) -> tuple[str, float | None]:
        token, value = alternative
        return token_text(self.tokenizer, token), _finite(value)

    def _legacy_top(self, texts: list[str], values: list, alts: list) -> list[dict] | None:
        """Completions' ``top_logprobs``: per token a dict of its k alternatives and itself."""
        if not self.logprobs:
            return None
        out = []
        for text, value, top in zip(texts, values, alts, strict=True):
            entry: dict[str, float | None] = {}
            # Two ids can share a text (byte pieces of one character): the likelier one's
            # value stays, so the dict's max is still the distribution's.
            for token, lp in map(self._alt, top):
                entry.setdefault(token, lp)
            entry.setdefault(text, value)
            out.append(entry)
        return out

    def _echoed(self, scores: PromptScores | None) -> dict[str, list]:
        """The echoed prompt's share of a completions ``logprobs``."""
        if scores is None:
            return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        texts = [token_text(self.tokenizer, t) for t in scores.token_ids]
        values = [None if v is None else _finite(v) for v in scores.logprobs]
        offsets = [0, *itertools.accumulate(len(t) for t in texts[:-1])]
        alts = [[] if a is None else a for a in scores.top]
        top = self._legacy_top(texts, values, alts)
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": None if top is None else [None, *top[1:]],
            "text_offset": offsets,
        }


def _entry(token: str, value: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode())}


def _joined(prompt: dict[str, list], completion: dict[str, Any], shift: int) -> dict[str, Any]:
    """An echo's ``logprobs``: the prompt's, then the completion's (offsets past the prompt)."""
    top = completion["top_logprobs"]
    return {
        "tokens": prompt["tokens"] + completion["tokens"],
        "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
        "top_logprobs": None if top is None else prompt["top_logprobs"] + top,
        "text_offset": prompt["text_offset"] + [o + shift for o in completion["text_offset"]],
    }


def _delta(text: str) -> dict[str, str]:
    return {"content": text} if text else {}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; JSON without NaN (which JSON cannot carry)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)
    return f"data: {data}\n\n"
