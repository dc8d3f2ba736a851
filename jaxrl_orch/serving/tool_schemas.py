"""The tool fields of a chat request, validated before anything is rendered.

What it owns: OpenAI's ``tools`` entries (``Tool``), ``tool_choice`` (``"none"``, ``"auto"``,
``"required"`` or ``NamedToolChoice``), an assistant message's ``tool_calls``
(``MessageToolCall``), and ``check_tools(messages, tools, tool_choice)``: the rules across
fields, each broken one an ``ApiError`` 400 naming the field (``param``) and what is allowed:

- a function name is 1 to 64 of ``a-z A-Z 0-9 _ -`` (OpenAI's rule), unique among the tools;
- a function's ``parameters`` is a JSON Schema of an object (``schema_problem``: the keywords
  a tool schema uses, checked for their JSON Schema types, recursively; not a full meta-schema
  validation);
- ``tool_choice`` other than ``"none"`` needs ``tools``; a named one must name one of them;
- ``tool_calls`` ride on assistant messages only, each call's ``arguments`` a JSON object as
  text; a ``tool`` message carries the ``tool_call_id`` of a call an earlier assistant message
  made.

Pure validation: no engine, tokenizer or HTTP state.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxrl_orch.serving.errors import ApiError

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
CHOICES = ("none", "auto", "required")
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef

    def template_entry(self) -> dict[str, Any]:
        """The tool as a chat template sees it: OpenAI's entry, unset fields left out."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def parse_tool_choice(value: Any) -> str | NamedToolChoice | None:
    """``tool_choice`` as sent: one of ``CHOICES``, a named function, or None (unset)."""
    if value is None or (isinstance(value, str) and value in CHOICES):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError:
            pass
    raise ValueError(
        f"tool_choice must be one of {', '.join(map(repr, CHOICES))} or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r:.200}'
    )


def schema_problem(schema: Any, where: str) -> str | None:
    """What is wrong with a JSON Schema (the keywords tool schemas use), or None."""
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema object, got {schema!r:.80}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in _TYPES for k in kinds):
        return f"{where}.type is {kind!r}; JSON Schema types are {', '.join(sorted(_TYPES))}"
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        return f"{where}.required must be a list of property names, got {required!r:.80}"
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        return f"{where}.enum must be a non-empty list, got {schema['enum']!r:.80}"
    subs: list[tuple[Any, str]] = []
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{where}.{key} must map names to schemas, got {schema[key]!r:.80}"
            subs += [(s, f"{where}.{key}.{name}") for name, s in schema[key].items()]
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{where}.{key} must be a list of schemas, got {schema[key]!r:.80}"
            subs += [(s, f"{where}.{key}[{i}]") for i, s in enumerate(schema[key])]
    for key in ("items", "additionalProperties", "not"):
        if key in schema and not isinstance(schema[key], bool):
            subs.append((schema[key], f"{where}.{key}"))
    for sub, at in subs:
        problem = schema_problem(sub, at)
        if problem is not None:
            return problem
    return None


def _check_definitions(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        where = f"tools[{i}].function"
        if fn.name in seen:
            raise ApiError(400, f"{where}.name: {fn.name!r} is declared twice", param=where)
        seen.add(fn.name)
        if fn.parameters is None:
            continue
        problem = schema_problem(fn.parameters, f"{where}.parameters")
        if problem is None and fn.parameters.get("type", "object") != "object":
            problem = f"{where}.parameters.type must be 'object' (a function takes named arguments)"
        if problem is not None:
            raise ApiError(400, f"invalid JSON Schema: {problem}", param=f"{where}.parameters")


def _check_choice(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> None:
    if choice is None or choice == "none":
        return
    if not tools:
        raise ApiError(
            400,
            f"tool_choice={choice if isinstance(choice, str) else 'a named function'!r} needs "
            "tools: send the functions in tools, or tool_choice 'none'",
            param="tool_choice",
        )
    names = [t.function.name for t in tools]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(
            400,
            f"tool_choice names function {choice.function.name!r}, which is not among the "
            f"tools; the functions are {', '.join(map(repr, names))}",
            param="tool_choice.function.name",
        )


def _check_messages(messages: list[Any]) -> None:
    call_ids: list[str] = []
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise ApiError(
                400,
                f"messages[{i}]: tool_calls ride on assistant messages only, not {m.role!r}",
                param=f"messages[{i}].tool_calls",
            )
        for j, call in enumerate(m.tool_calls or []):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                arguments = exc
            if not isinstance(arguments, dict):
                raise ApiError(
                    400,
                    f"{where} must be a JSON object as text, got {call.function.arguments!r:.120}",
                    param=where,
                )
            call_ids.append(call.id)
        if m.role != "tool" and m.tool_call_id is not None:
            raise ApiError(
                400,
                f"messages[{i}]: tool_call_id belongs on tool messages, not {m.role!r}",
                param=f"messages[{i}].tool_call_id",
            )
        if m.role == "tool" and m.tool_call_id not in call_ids:
            made = ", ".join(map(repr, call_ids)) or "none"
            raise ApiError(
                400,
                f"messages[{i}] is a tool result for tool_call_id={m.tool_call_id!r}, which no "
                f"earlier assistant message called; the calls made are: {made}",
                param=f"messages[{i}].tool_call_id",
            )


def check_tools(
    messages: list[Any], tools: list[Tool] | None, choice: str | NamedToolChoice | None
) -> None:
    """The rules across the tool fields (module docstring); ``ApiError`` 400 on the first."""
    _check_definitions(tools or [])
    _check_choice(tools, choice)
    _check_messages(messages)
