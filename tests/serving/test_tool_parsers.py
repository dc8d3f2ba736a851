"""The tool-call parsers, the per-request tool use and the tool fields' validation, unit by unit.

The Hermes parser is checked against ``renderers``' ``Qwen3ToolParser`` (which parses token ids)
on a tokenizer whose ``<tool_call>`` markers are single special ids; a stream fed in pieces of
every size must end with what the whole text parses to.
"""

from __future__ import annotations

import json

import pytest
from renderers.base import ToolCallParseStatus
from renderers.parsers import Qwen3ToolParser
from support.chat_checkpoints import LLAMA3_TEMPLATE, QWEN_TEMPLATE, write_qwen3_tokenizer

from jaxrl_orch import serve
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.serving.errors import ApiError
from jaxrl_orch.serving.openai_schemas import ChatRequest
from jaxrl_orch.serving.tool_calls import ToolUse
from jaxrl_orch.serving.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    get_tool_parser,
    infer_tool_parser,
)
from jaxrl_orch.serving.tool_schemas import check_tools, schema_problem

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = PARIS.replace("Paris", "Rome")


def calls(parsed):
    content, found = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in found]


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (PARIS, None, [("get_weather", {"city": "Paris"})]),
        ("Let me look.\n" + PARIS, "Let me look.\n", [("get_weather", {"city": "Paris"})]),
        (PARIS + "\n" + ROME, None, [("get_weather", {"city": p}) for p in ("Paris", "Rome")]),
        (
            PARIS + ROME + " trailing",
            None,
            [("get_weather", {"city": p}) for p in ("Paris", "Rome")],
        ),
        (PARIS[: -len("</tool_call>")], None, [("get_weather", {"city": "Paris"})]),  # unclosed
        ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
        (
            '<tool_call>{"name": "f", "arguments": {"s": "é"}}</tool_call>',
            None,
            [("f", {"s": "é"})],
        ),
    ],
)
def test_hermes_parses_well_formed_calls(text, content, expected):
    assert calls(HermesParser().extract(text)) == (content, expected)


@pytest.mark.parametrize(
    "text",
    [
        "It is 21 C in Paris.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f"]</tool_call>',
        PARIS + '<tool_call>{"name": </tool_call>',  # one bad block spoils the reply
    ],
)
def test_hermes_gives_text_for_anything_else(text):
    assert HermesParser().extract(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "g", "parameters": {"city": "Paris"}}', [("g", {"city": "Paris"})]),
        ('  <|python_tag|>{"name": "f", "arguments": {"x": 1}}', [("f", {"x": 1})]),
        (
            '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
            [("f", {}), ("g", {})],
        ),
    ],
)
def test_llama3_json_parses_calls(text, expected):
    assert calls(Llama3JsonParser().extract(text))[1] == expected


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        'Here: {"name": "f", "parameters": {}}',  # calls only open the reply
        '{"name": "f", "parameters": {}} and then text',
        '{"name": "f", "parameters": ',
        '{"city": "Paris"}',  # no name
        '{"name": "f", "parameters": "x"}',
    ],
)
def test_llama3_json_gives_text_for_anything_else(text):
    assert Llama3JsonParser().extract(text) is None


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


def test_the_parser_is_inferred_from_the_templates_own_format():
    assert infer_tool_parser(QWEN_TEMPLATE) == "hermes"
    llama31_tools = '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    assert infer_tool_parser(llama31_tools) == "llama3_json"
    assert infer_tool_parser(LLAMA3_TEMPLATE) is None
    assert infer_tool_parser(None) is None


def test_tool_use_keeps_only_calls_the_request_allows():
    hermes = HermesParser()
    assert ToolUse(hermes, frozenset({"get_weather"})).parse(PARIS) is not None
    assert ToolUse(hermes, frozenset({"get_time"})).parse(PARIS) is None  # undeclared: text
    both = ToolUse(hermes, frozenset({"get_weather"}), parallel=False).parse(PARIS + ROME)
    assert calls(both)[1] == [("get_weather", {"city": "Paris"})]


STREAMED = [
    "plain text without calls",
    "Sure.\n" + PARIS + "\n" + ROME,
    "<tool_c is not a marker",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
    '{"name": "f", "parameters": {"x": 1}}',
    "  <|python_tag|>not json",
]


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()], ids=lambda p: p.name)
def test_a_stream_ends_with_what_the_whole_text_parses_to(text, parser):
    use = ToolUse(parser, frozenset({"get_weather", "f"}))
    whole = use.parse(text)
    for size in range(1, 9):
        stream = use.stream()
        released = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        tail, found = stream.finish()
        if whole is None:
            assert (released + tail, found) == (text, [])
        else:
            assert released + tail == (whole[0] or "")
            assert [(c.name, c.arguments) for c in found] == [
                (c.name, c.arguments) for c in whole[1]
            ]


def test_a_stream_holds_back_what_could_begin_a_call():
    stream = ToolUse(HermesParser(), frozenset({"get_weather"})).stream()
    assert stream.feed("Sure <tool") == "Sure "
    assert stream.feed("_call>") == ""  # the calls begin: held to the end
    assert stream.feed('{"name": "get_weather"}</tool_call>') == ""
    assert stream.finish()[1][0].name == "get_weather"


class _HFShim:
    """Our tokenizer behind the two methods of Hugging Face's that ``renderers`` calls."""

    unk_token_id = None

    def __init__(self, tok):
        self._tok = tok

    def convert_tokens_to_ids(self, token):
        return self._tok._tok.token_to_id(token)

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize(
    "text", [PARIS, "Hi.\n" + PARIS + "\n" + ROME, '<tool_call>{"name": 1, </tool_call>']
)
def test_hermes_agrees_with_renderers_qwen3_parser(tmp_path, text):
    tok = load_tokenizer(write_qwen3_tokenizer(tmp_path / "qwen3"))
    ids = tok.encode(text)
    content_ids, theirs = Qwen3ToolParser(_HFShim(tok)).extract(ids)
    ours = HermesParser().extract(tok.decode(ids, skip_special_tokens=False))
    if any(c.status != ToolCallParseStatus.OK for c in theirs):
        assert ours is None
        return
    assert calls(ours) == (
        tok.decode(content_ids) or None,
        [(c.name, c.arguments) for c in theirs],
    )


def _request(**body):
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])
    return ChatRequest.model_validate({"messages": messages, **body})


def _tool(name="f", parameters=None):
    fn = {"name": name, **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": fn}


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "object", "properties": {"x": {"type": "text"}}}, "properties.x.type"),
        ({"type": "object", "properties": []}, "properties must map"),
        ({"type": "object", "required": "x"}, "required must be a list"),
        ({"type": "object", "properties": {"x": {"type": "array", "items": 3}}}, "items must be"),
        ({"type": "object", "properties": {"x": {"enum": []}}}, "enum must be"),
    ],
)
def test_schema_problems_are_named_by_path(schema, says):
    assert says in schema_problem(schema, "parameters")


def test_a_valid_schema_has_no_problem():
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris"]},
            "days": {"type": ["integer", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/p"}]},
        },
        "required": ["city"],
        "additionalProperties": False,
        "$defs": {"p": {"type": "object"}},
    }
    assert schema_problem(schema, "parameters") is None


FN = "tools[0].function"
USER_CALLING = {
    "role": "user",
    "content": "x",
    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [_tool(), _tool()]}, "tools[1].function", "declared twice"),
        ({"tools": [_tool(parameters={"type": "string"})]}, f"{FN}.parameters", "'object'"),
        ({"messages": [USER_CALLING]}, "messages[0].tool_calls", "assistant messages only"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
            "tool messages",
        ),
    ],
)
def test_tool_field_rules_are_400s_naming_the_field(body, param, says):
    req = _request(**body)
    with pytest.raises(ApiError) as info:
        check_tools(req.messages, req.tools, req.tool_choice)
    assert (info.value.status, info.value.param) == (400, param)
    assert says in info.value.message


def test_tool_names_follow_openais_pattern():
    with pytest.raises(ValueError, match="pattern"):
        _request(tools=[_tool(name="get weather")])


def test_the_serve_command_refuses_an_unknown_parser_before_building(capsys):
    assert serve.main(["--tool_call_parser", "pythonic"]) == 2
    assert "hermes, llama3_json" in capsys.readouterr().err
