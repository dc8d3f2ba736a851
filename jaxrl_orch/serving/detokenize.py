"""Incremental detokenisation: the text a growing list of token ids adds, one id at a time.

What it owns: turning the engine's sampled ids into text deltas for the OpenAI endpoints, so a
stream's deltas concatenate to exactly what one ``tokenizer.decode`` of all the ids gives.

How: each ``push(id)`` decodes a short window of ids twice, without and with the new one, and
releases the difference (vLLM's prefix/read offsets). The window starts at a token boundary
where the text was complete, so a decoder that needs left context (a leading-space marker)
still gets it, and the work per token stays constant however long the completion grows.

Invariant: a delta never ends inside a character. Byte-level tokenizers (the default one, and
byte-level BPE) decode a multi-byte UTF-8 character split across ids as U+FFFD until its last
byte arrives, so a window whose text ends in U+FFFD is held back until it resolves; ``flush``
releases whatever is still held when the completion ends (a byte sequence the model never
completed stays U+FFFD, as ``decode`` writes it).

Pure host code on the server's event loop; it never sees the engine or the driver thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.models.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: a boundary where the released text was complete
        self._read = 0  # ids up to here have had their text released

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; the text it completes (often ``""`` mid-character)."""
        self._ids.append(int(token_id))
        released = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(released) or text.endswith(REPLACEMENT):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(released) :]

    def flush(self) -> str:
        """The held-back text, once no more ids will come."""
        released = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = len(self._ids)
        self._read = len(self._ids)
        return text[len(released) :]


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One id's own text, special tokens spelled out (a log-prob entry's ``token``)."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)
