"""One chat request's tool use: which calls its replies may carry, whole or streamed.

What it owns: ``ToolUse`` (the server's parser, the request's ``tool_choice`` and functions)
with ``parse(text)``, a reply's content and calls or None (the reply is text); and
``ToolStream``, the same decision made on a stream of text deltas.

The rules (vLLM's where it has one):
- A reply's calls are its parser's (``tool_parsers``). They count only when every call is
  well formed and names a function the request allows: any of its ``tools`` (``auto``,
  ``required``), or the named one. Otherwise the whole reply is text and keeps its own
  ``finish_reason``; with calls it is ``tool_calls`` and the content is the text before them.
- ``parallel_tool_calls: false`` keeps the first call only.
- Nothing is constrained while decoding: ``required`` and a named function are checked on the
  reply, not forced on the model, so a reply without a call is plain text.

Streaming (``ToolStream``): text before the calls is released as it comes, less a tail that
could still begin them (a partial ``<tool_call>``); from where the calls begin the text is
held to the end, then parsed whole, so a stream ends with exactly the content and calls the
whole response would have (malformed calls come out as the held text).
"""

from __future__ import annotations

import dataclasses

from jaxrl_orch.serving.tool_parsers import HermesParser, Llama3JsonParser, Parsed, ToolCall


@dataclasses.dataclass(frozen=True)
class ToolUse:
    parser: HermesParser | Llama3JsonParser
    allowed: frozenset[str]  # the function names a call may name
    parallel: bool = True

    def parse(self, text: str) -> Parsed | None:
        parsed = self.parser.extract(text)
        if parsed is None:
            return None
        content, calls = parsed
        if not calls or any(c.name not in self.allowed for c in calls):
            return None
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's text deltas in, the content to release now out; ``finish`` at the end."""

    def __init__(self, use: ToolUse) -> None:
        self._use = use
        self._text = ""
        self._released = 0  # characters of _text already released as content
        self._calls_begun = False

    def feed(self, delta: str) -> str:
        self._text += delta
        if self._calls_begun:
            return ""
        start = self._use.parser.section_start(self._text)
        if start is not None:
            self._calls_begun = True
            end = start
        else:
            end = len(self._text) - self._use.parser.held(self._text)
        out = self._text[self._released : max(end, self._released)]
        self._released = max(end, self._released)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still to release and the calls, once the choice has ended."""
        parsed = self._use.parse(self._text)
        if parsed is None:
            return self._text[self._released :], []
        content, calls = parsed
        # The content is the text before the calls, all released by now.
        return (content or "")[self._released :], calls
