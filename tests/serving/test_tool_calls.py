"""Tool calls through ``/v1/chat/completions`` with the official ``openai`` client.

The served checkpoint (``support.tool_checkpoint``) is a tiny Qwen2.5-style model taught a few
replies to prompts its own template renders with ``tools``: a call of ``get_weather``, the
answer once the tool's result is in, two calls in one reply, a malformed call and a plain
reply. Greedy decoding gives those replies, so what the server makes of them is checked
exactly: parsed calls with ``finish_reason`` ``tool_calls``, the round trip's final answer, the
same through a stream accumulated by the client's own stream helper, a malformed call as text.
The template has a ``<tool_call>`` format, so the server infers the ``hermes`` parser.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.tool_checkpoint import (
    ANSWER,
    ASK,
    BOTH,
    BROKEN,
    BROKEN_REPLY,
    GREET,
    HELLO,
    MODEL,
    TOOLS,
    answered,
    call_text,
    tool_chat_host,
)

from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.runner import HttpServer

GREEDY = {"model": MODEL, "temperature": 0.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    host = tool_chat_host(tmp_path_factory.mktemp("tools") / "checkpoint")
    yield host
    host.stop()


def ask(client, messages, **kwargs):
    return client.chat.completions.create(messages=messages, **{**GREEDY, **kwargs})


def streamed(client, messages, **kwargs):
    """The stream's chunks and the completion the client's stream helper accumulates."""
    chunks = []
    with client.chat.completions.stream(messages=messages, **{**GREEDY, **kwargs}) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return chunks, stream.get_final_completion()


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def back(choice):
    """The assistant's turn as a client sends it back: its calls, no content."""
    return choice.message.model_dump(include={"role", "content", "tool_calls"})


def test_round_trip_call_result_answer(client):
    first = ask(client, ASK, tools=TOOLS).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    assert calls_of(first.message) == [("get_weather", {"city": "Paris"})]
    [call] = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}
    final = ask(client, [*ASK, back(first), result], tools=TOOLS).choices[0]
    assert (final.message.content, final.finish_reason) == (ANSWER, "stop")
    assert not final.message.tool_calls


def test_streamed_round_trip(client):
    chunks, first = streamed(client, ASK, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    # vLLM's and OpenAI's shape: the call's id, type and name first, then its arguments.
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    head, args = deltas
    assert (head.index, head.id, head.type, head.function.name) == (
        0,
        choice.message.tool_calls[0].id,
        "function",
        "get_weather",
    )
    assert head.function.arguments == "" and args.id is None and args.function.name is None
    assert json.loads(args.function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    call_id = choice.message.tool_calls[0].id
    _, final = streamed(client, answered(call_id), tools=TOOLS)
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls


def test_two_calls_in_one_reply(client):
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    whole = ask(client, BOTH, tools=TOOLS).choices[0]
    assert (whole.finish_reason, calls_of(whole.message)) == ("tool_calls", expected)
    assert len({c.id for c in whole.message.tool_calls}) == 2
    chunks, accumulated = streamed(client, BOTH, tools=TOOLS)
    assert calls_of(accumulated.choices[0].message) == expected
    indices = [d.index for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert indices == [0, 0, 1, 1]


def test_parallel_tool_calls_false_keeps_the_first(client):
    reply = ask(client, BOTH, tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert calls_of(reply.message) == [("get_weather", {"city": "Paris"})]


def test_malformed_call_is_text_with_its_own_finish_reason(client):
    whole = ask(client, BROKEN, tools=TOOLS).choices[0]
    assert (whole.message.content, whole.finish_reason) == (BROKEN_REPLY, "stop")
    assert not whole.message.tool_calls
    _, accumulated = streamed(client, BROKEN, tools=TOOLS)
    assert accumulated.choices[0].message.content == BROKEN_REPLY
    assert accumulated.choices[0].finish_reason == "stop"
    assert not accumulated.choices[0].message.tool_calls


def test_plain_reply_streams_as_content(client):
    chunks, accumulated = streamed(client, GREET, tools=TOOLS)
    assert accumulated.choices[0].message.content == HELLO
    assert accumulated.choices[0].finish_reason == "stop"
    # Released as decoded, not held to the end: more than one chunk carries text.
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1


def test_required_is_checked_not_forced(client):
    reply = ask(client, GREET, tools=TOOLS, tool_choice="required").choices[0]
    assert (reply.message.content, reply.finish_reason) == (HELLO, "stop")
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = ask(client, ASK, tools=TOOLS, tool_choice=named).choices[0]
    assert calls_of(reply.message) == [("get_weather", {"city": "Paris"})]


def test_tool_choice_none_renders_and_parses_no_tools(client, host):
    tok = host.tokenizer
    plain = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True))
    with_tools = ask(client, ASK, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > len(plain)
    reply = ask(client, ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens == len(plain)
    assert not reply.choices[0].message.tool_calls


def _refusal(client, **body):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**GREEDY, "max_tokens": 4, **body})
    return info.value.body


BAD_SCHEMA = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": {"type": "obj"}}}]
UNCALLED = [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "21"}]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "'get_weather'",
        ),
        ({"tools": BAD_SCHEMA}, "tools[0].function.parameters", "JSON Schema types are"),
        ({"messages": UNCALLED}, "messages[1].tool_call_id", "no earlier assistant"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(client, body, param, says):
    error = _refusal(client, **{"messages": ASK, "tools": TOOLS, **body})
    assert error["param"] == param
    assert says in error["message"]
    # ... and the server keeps serving.
    assert ask(client, GREET, tools=TOOLS).choices[0].message.content == HELLO


def test_call_arguments_must_be_a_json_object(url):
    messages = answered()
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "JSON object" in error["message"]


def test_the_servers_parser_setting_wins_over_the_templates_format(host):
    """Served with ``llama3_json``, the model's Hermes-style call is not a call: plain text."""
    server = HttpServer(make_app(host, tool_parser="llama3_json")).start_in_thread()
    try:
        http = httpx.Client(trust_env=False)
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http
        ) as other:
            reply = ask(other, ASK, tools=TOOLS).choices[0]
    finally:
        server.stop()
    assert (reply.message.content, reply.finish_reason) == (call_text("Paris"), "stop")
    assert not reply.message.tool_calls
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        make_app(host, tool_parser="pythonic")
