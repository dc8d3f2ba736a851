"""A tool-calling verifiers 0.4 taskset (id ``jaxrl-tool-call``): add two numbers with a tool.

Each task asks for ``a + b`` and offers one function tool, ``add(a, b)``. The harness
(``vf_chat``) runs the model's tool calls and answers each with a ``tool`` message, then the
model answers; the reward is 1 when the last message holds the sum. Tool calls are parsed by the
model's renderer, so this taskset needs a chat template with tools (``Verifiers.renderer =
"qwen3"`` for a Qwen3-shaped checkpoint).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.types import content_text

from jaxrl_orch.examples.vf_chat import ChatHarness

ADD_SPEC = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def add(a: Any, b: Any) -> str:
    return str(int(a) + int(b))


class SumData(vf.TaskData):
    a: int
    b: int


class SumConfig(vf.TasksetConfig):
    count: int = 64
    seed: int = 0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(str(self.data.a + self.data.b) in content_text(trace.last_message.content))


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        rng = random.Random(self.config.seed)
        for i in range(self.config.count):
            a = rng.randrange(100)
            b = rng.randrange(100)
            prompt = f"What is {a} + {b}? Use the add tool."
            yield SumTask(SumData(name=f"sum-{i}", prompt=prompt, a=a, b=b), self.config.task)


class ToolHarness(ChatHarness):
    TOOLS = {"add": add}
    TOOL_SPECS = [ADD_SPEC]


__all__ = ["SumTaskset", "ToolHarness"]
