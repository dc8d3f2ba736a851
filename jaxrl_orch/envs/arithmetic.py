"""Arithmetic environment: small integer problems ("12+7="), exact match, binary reward.

The reward is 1.0 when the model's answer is the exact integer result and 0.0 otherwise, so
groups whose rollouts all succeed (or all fail) really occur: this env exercises the train
sink's zero-variance-group filter, unlike the partial-credit reverse-text env.

Answer extraction: the text inside the first complete ``<answer>...</answer>`` pair if there
is one, else the whole completion; surrounding whitespace is stripped and the rest must be an
optional sign followed by digits ("19", "-3"). Anything else ("19.0", "nineteen", "19 apples")
scores 0 and sets ``format_ok`` to 0. Never raises on a malformed completion.

Example schema: ``{"question": str, "answer": str | int}`` as written by the
``jaxrl_arithmetic`` dataset builder (``question`` without the trailing ``=``).
"""

from __future__ import annotations

import re
from typing import Any

from jaxrl_orch.envs.base import SingleTurnEnv, extract_answer

DEFAULT_INSTRUCTION = "Answer in <answer></answer>."
_INT_RE = re.compile(r"[+-]?\d+")


def parse_int_answer(text: str) -> int | None:
    """The integer the model answered, or None if the answer is not a plain integer."""
    tagged = extract_answer(text)
    candidate = (tagged if tagged is not None else text).strip()
    if not _INT_RE.fullmatch(candidate):
        return None
    return int(candidate)


def truth_int(example: dict[str, Any]) -> int:
    answer = example.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (int, str)):
        raise ValueError(f"arithmetic example needs an int or str 'answer', got {example!r}")
    if isinstance(answer, str) and not _INT_RE.fullmatch(answer.strip()):
        raise ValueError(f"arithmetic example answer must be an integer, got {answer!r}")
    return int(answer)


class ArithmeticEnv(SingleTurnEnv):
    name = "arithmetic"
    default_instruction = DEFAULT_INSTRUCTION

    def build_messages(self, example: dict[str, Any]) -> list[dict[str, str]]:
        question = example.get("question")
        if not isinstance(question, str) or not question:
            raise ValueError(
                f"arithmetic example needs a non-empty str 'question' field, got {example!r}"
            )
        truth_int(example)  # validate before spending a generate call on a broken example
        prefix = f"{self.instruction}\n" if self.instruction else ""
        return [{"role": "user", "content": f"{prefix}{question}="}]

    def reference_completion(self, example: dict[str, Any]) -> str:
        """The correct answer, for SFT warm-up (the reward of this text is 1.0)."""
        return f"<answer>{truth_int(example)}</answer>"

    def score(self, text: str, example: dict[str, Any]) -> tuple[float, dict[str, float]]:
        answer = parse_int_answer(text)
        reward = float(answer is not None and answer == truth_int(example))
        return reward, {"format_ok": float(answer is not None)}
