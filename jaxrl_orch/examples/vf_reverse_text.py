"""The bundled reverse-text task as a verifiers 0.4 taskset (id ``jaxrl-reverse-text``).

The same sentences, splits, prompt and reward as ``envs/reverse_text.py``: the bundled corpus'
train or held-out split (``split``), the prompt ``"<instruction>\\n<sentence>"`` as one user
turn, and the similarity of the text inside the answer tags to the true reversal. So an RL run
through verifiers and one on the bundled env can be compared row for row (README, "Bring your
own environment"). The agent is ``vf_chat``'s in-process harness, one turn.

    VERIFIERS_ENV = {'taskset': {'id': 'jaxrl-reverse-text', 'instruction': 'Reverse:'}}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.types import content_text

from jaxrl_orch.data.builders import load_split
from jaxrl_orch.envs.base import extract_answer
from jaxrl_orch.envs.reverse_text import DEFAULT_INSTRUCTION, classify_answer, reverse_text_reward
from jaxrl_orch.examples.vf_chat import ChatHarness

DATASET = "jaxrl_reverse_text"


class ReverseData(vf.TaskData):
    text: str


class ReverseTextTasksetConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    instruction: str = DEFAULT_INSTRUCTION
    data_dir: str | None = None  # where the bundled dataset is prepared (None: tfds' default)


def answer_of(trace) -> str | None:
    """The text inside the answer tags of the trace's last message (the model's last turn)."""
    return extract_answer(content_text(trace.last_message.content))


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversal(self, trace) -> float:
        return reverse_text_reward(answer_of(trace), self.data.text)

    @vf.metric
    async def full_reversal(self, trace) -> float:
        return float(classify_answer(answer_of(trace), self.data.text) == "full")


class ReverseTextTaskset(vf.Taskset[ReverseTask, ReverseTextTasksetConfig]):
    def load(self) -> Iterator[ReverseTask]:
        cfg = self.config
        source = load_split(DATASET, cfg.split, cfg.data_dir)
        for i in range(len(source)):
            text = source[i]["text"]
            text = text.decode() if isinstance(text, bytes) else str(text)
            prompt = f"{cfg.instruction}\n{text}"
            data = ReverseData(name=f"{cfg.split}-{i}", prompt=prompt, text=text)
            yield ReverseTask(data, cfg.task)


class ReverseTextHarness(ChatHarness):
    """One model turn."""

    def follow_up(self, data, reply, turn):
        return []


__all__ = ["ReverseTextHarness", "ReverseTextTaskset"]
