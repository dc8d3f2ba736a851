"""An in-process chat harness for verifiers 0.4: the agent program of the bundled examples.

verifiers runs a taskset's agent as a ``Harness`` whose ``launch`` talks OpenAI chat to the
rollout's interception endpoint. Its bundled ones build a program in a runtime (``uv sync``,
a sandbox), which needs the network; this one plays the seat in this process, which
``Harness.launch`` allows: it sends the task's opening messages (with the task's tools, if any),
then, for as many turns as ``follow_up`` answers, the environment's reply and the model's next
turn. A subclass sets ``follow_up``; the default is one turn.

Tool calls: ``run_tools`` executes the calls of a turn against ``TOOLS`` (name -> a function of
keyword arguments returning text) and answers each with a ``tool`` message; an unknown tool or
bad arguments become that message's text, as a real tool server would answer.

The chat calls go over the loop's shared loopback client (``envs.vf.loopback``), JSON in and
out, and each reply reaches ``follow_up`` as the OpenAI SDK's ``ChatCompletionMessage``; an
error status from the interception server raises ``ChatCallError`` with its body.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any, ClassVar

import aiohttp
import orjson
import verifiers.v1 as vf
from openai.types.chat import ChatCompletionMessage

from jaxrl_orch.envs.vf import loopback


class ChatCallError(RuntimeError):
    """The interception server answered a chat call with an error status."""


class ChatConfig(vf.HarnessConfig):
    max_turns: int = 4


class ChatHarness(vf.Harness[ChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    TOOLS: ClassVar[dict[str, Callable[..., str]]] = {}
    TOOL_SPECS: ClassVar[list[dict[str, Any]]] = []

    def follow_up(self, data: Any, reply: Any, turn: int) -> list[dict[str, Any]]:
        """The environment's messages after the model's turn ``turn``; [] ends the episode."""
        return self.run_tools(reply)

    def run_tools(self, reply: Any) -> list[dict[str, Any]]:
        out = []
        for call in reply.tool_calls or []:
            fn = self.TOOLS.get(call.function.name)
            try:
                args = json.loads(call.function.arguments or "{}")
                text = str(fn(**args)) if fn else f"unknown tool {call.function.name!r}"
            except (TypeError, ValueError) as exc:
                text = f"bad arguments: {exc}"
            out.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return out

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_: Any):
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m if isinstance(m, dict) else m.model_dump() for m in prompt or []]
        url = f"{endpoint.rstrip('/')}/chat/completions"
        headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        async with contextlib.AsyncExitStack() as stack:
            http = loopback.session() or await stack.enter_async_context(loopback.new_session())
            for turn in range(self.config.max_turns):
                body: dict[str, Any] = {"model": ctx.model, "messages": messages}
                if self.TOOL_SPECS:
                    body["tools"] = self.TOOL_SPECS
                wire = await _chat(http, url, headers, body)
                messages.append({k: v for k, v in wire.items() if v is not None})
                more = self.follow_up(data, ChatCompletionMessage.model_validate(wire), turn)
                if not more:
                    break
                messages += more
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _chat(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> dict[str, Any]:
    """The assistant message of one chat call, as the wire has it (orjson both ways, a few
    times cheaper than the stdlib codec aiohttp uses by default)."""
    async with http.post(url, data=orjson.dumps(body), headers=headers) as response:
        if response.status >= 400:
            text = await response.text()
            raise ChatCallError(f"chat call answered HTTP {response.status}: {text[:1000]}")
        reply = orjson.loads(await response.read())
    return reply["choices"][0]["message"]
