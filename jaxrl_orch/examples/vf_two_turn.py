"""A two-turn verifiers 0.4 taskset (id ``jaxrl-two-turn``): the environment answers, the model
tries again.

The reverse-text task of ``vf_reverse_text``, played over two model turns: after the model's
first answer the environment replies with that answer's score and asks for another try; the
reward is the second answer's. The trace is one branch when the renderer extends the first
turn's ids (the byte template does), and forks when a chat template re-renders the first turn
differently (``envs.vf.traces`` trains a shared node once).
"""

from __future__ import annotations

from jaxrl_orch.envs.base import extract_answer
from jaxrl_orch.envs.reverse_text import reverse_text_reward
from jaxrl_orch.examples.vf_chat import ChatHarness
from jaxrl_orch.examples.vf_reverse_text import ReverseTextTaskset


def feedback(answer: str | None, text: str) -> str:
    score = reverse_text_reward(answer, text)
    return f"That scores {score:.2f} of 1. Try again, in <answer></answer>."


class TwoTurnTaskset(ReverseTextTaskset):
    """The reverse-text tasks; their reward reads the last model turn, the second here."""


class TwoTurnHarness(ChatHarness):
    def follow_up(self, data, reply, turn):
        if turn > 0:
            return []
        answer = extract_answer(reply.content or "")
        return [{"role": "user", "content": feedback(answer, data.text)}]


__all__ = ["TwoTurnHarness", "TwoTurnTaskset"]
