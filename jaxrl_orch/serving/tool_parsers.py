"""Tool calls in a chat model's text, one parser per model family, chosen by name.

What it owns: ``TOOL_PARSERS`` (name -> parser, the names ``jaxrl-serve --tool_call_parser``
takes, vLLM's names for the same formats), ``get_tool_parser`` (an unknown name refused with
the allowed list), ``infer_tool_parser`` (the parser a chat template's own tool-call format
implies), and ``ToolCall`` (one parsed call, OpenAI's ``function.arguments`` as JSON text).

Formats:
- ``hermes``: Hermes 2 Pro, Qwen2.5 and Qwen3 write ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call, after optional text. The content is the text before
  the first block; a last block left unclosed still counts when its JSON is whole (vLLM's rule).
- ``llama3_json``: Llama 3.1 / 3.2 write the whole reply as ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``; several calls joined by ``;``), ``arguments``
  accepted for ``parameters``. A reply that does not start with one is text.

Each parser answers three questions about decoded text: ``extract`` (the content before the
calls and the calls, or None when the text holds no well-formed call: a malformed one, bad
JSON, a missing name or non-object arguments, is text, as vLLM returns it), and for streaming
``section_start`` (where the calls begin, once that is certain) and ``held`` (how many trailing
characters could still begin them, so no marker leaks out as content).

Why not ``renderers.parsers`` (``Qwen3ToolParser``): it parses token ids and finds a block only
where ``<tool_call>`` is a single vocabulary id, through Hugging Face's tokenizer interface
(``convert_tokens_to_ids``); Hermes fine-tunes that spell the marker in ordinary tokens give no
calls. It has no incremental (streaming) interface and no Llama 3 JSON format. Parsing the
decoded text, as vLLM's parsers do, serves both formats and both response kinds from one
function; the tests check it against ``Qwen3ToolParser`` where both apply.

Pure text work: no engine, tokenizer or HTTP state.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


Parsed = tuple[str | None, list[ToolCall]]


def _call(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from one decoded JSON value, or None when it is not a well-formed one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    found = [obj[k] for k in arguments_keys if k in obj]
    arguments = found[0] if found else {}  # a call of a function without parameters
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesParser:
    name: ClassVar[str] = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def section_start(self, text: str) -> int | None:
        at = text.find(self.START)
        return None if at < 0 else at

    def held(self, text: str) -> int:
        return _prefix_overlap(text, self.START)

    def extract(self, text: str) -> Parsed | None:
        start = self.section_start(text)
        if start is None:
            return None
        calls = []
        rest = text[start:]
        while rest.startswith(self.START):
            body, closed, rest = rest[len(self.START) :].partition(self.END)
            try:
                call = _call(json.loads(body), ("arguments",))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
            if not closed:
                break
            # Blocks may be separated by whitespace; any other text after a block is dropped
            # (vLLM keeps only the text before the first block).
            nxt = rest.find(self.START)
            rest = "" if nxt < 0 else rest[nxt:]
        return (text[:start] or None), calls


class Llama3JsonParser:
    name: ClassVar[str] = "llama3_json"
    TAG = "<|python_tag|>"

    def _body_start(self, text: str) -> int | None:
        """Where the JSON calls begin (past the tag), when the reply is calls."""
        stripped = text.lstrip()
        at = len(text) - len(stripped)
        if stripped.startswith(self.TAG):
            stripped = stripped[len(self.TAG) :].lstrip()
            at = len(text) - len(stripped)
        return at if stripped.startswith("{") else None

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def held(self, text: str) -> int:
        # Calls only open the reply: hold it while it is blank or a prefix of the tag.
        stripped = text.lstrip()
        if not stripped or (self.TAG.startswith(stripped) and stripped != self.TAG):
            return len(text)
        return 0

    def extract(self, text: str) -> Parsed | None:
        at = self._body_start(text)
        if at is None:
            return None
        decoder = json.JSONDecoder()
        calls, rest = [], text[at:]
        while True:
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return None
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = rest[end:].strip()
            if not rest:
                return (text[: self.section_start(text)] or None), calls
            if not rest.startswith(";"):
                return None
            rest = rest[1:].lstrip()


TOOL_PARSERS: dict[str, type] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_tool_parser(name: str) -> HermesParser | Llama3JsonParser:
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; the parsers are {', '.join(sorted(TOOL_PARSERS))}"
        )
    return TOOL_PARSERS[name]()


def infer_tool_parser(template_source: str | None) -> str | None:
    """The parser whose format a chat template writes its assistant tool calls in, or None
    when it shows none of them (a server then refuses tools until told which parser)."""
    if not template_source:
        return None
    if HermesParser.START in template_source:
        return HermesParser.name
    if Llama3JsonParser.TAG in template_source or '"parameters": ' in template_source:
        return Llama3JsonParser.name
    return None
