"""Reverse-text environment: reverse a short sentence character by character.

The RL demo's task. The prompt asks for the reversal inside
``<answer>...</answer>``; the reward is partial credit, ``difflib.SequenceMatcher(None,
extracted, truth).ratio()`` between the text inside the first complete answer-tag pair
(surrounding whitespace stripped) and the true reversal. Missing tags score 0. On the
sentence "In 1891 the community inaugurated its own cemetery": a perfect reversal scores 1.0,
one dropped letter ~0.99, an unreversed year 0.98, the words in reverse order but spelled
forwards 0.40.

Prompts are kept short on purpose: the bundled model is a tiny byte-level model that pays for
every prompt byte in each train and decode step. The default instruction is 29 bytes and corpus
sentences are 20-47 characters, so with the byte chat template every bundled prompt is at most
80 tokens (59 with the embedded config's ``instruction="Reverse:"``, where the SFT warm-up
teaches the answer tags instead).

Worse behaviours for a mixed-quality warm-up (``envs/demonstrator.py``; the reward never
changes): ``word_order`` (the words in reverse order, each spelled forwards: reward ~0.3-0.4)
and ``no_tags`` (the right reversal without its answer tags: reward 0).

Behaviour accounting: ``score`` labels each answer ``behaviour/full`` (nearest to the full
reversal), ``behaviour/word_order`` (nearest to the word-order reversal), ``behaviour/no_tags``
(no complete answer-tag pair) or ``behaviour/other`` (tagged, but within a similarity ratio of
``BEHAVIOUR_MIN_RATIO`` of neither), one-hot, so the eval's mean of each is that behaviour's
share of the answers.

Example schema: ``{"text": str}`` (the sentence to reverse). Driven by the dispatcher through
``SingleTurnEnv.run``; never raises on a malformed completion.
"""

from __future__ import annotations

import difflib
from typing import Any

from jaxrl_orch.envs.base import SingleTurnEnv, extract_answer

DEFAULT_INSTRUCTION = "Reverse in <answer></answer>:"
BEHAVIOURS = ("full", "word_order", "no_tags", "other")
# An answer counts as a behaviour when it is closer to that behaviour's target than to the
# other's and at least this similar to it (the two targets of one sentence are ~0.3-0.5 apart).
BEHAVIOUR_MIN_RATIO = 0.7


def word_order_reversal(text: str) -> str:
    """The words of ``text`` in reverse order, each spelled forwards."""
    return " ".join(reversed(text.split()))


def classify_answer(answer: str | None, text: str) -> str:
    """Which behaviour an extracted answer shows (see the module docstring)."""
    if answer is None:
        return "no_tags"
    full = difflib.SequenceMatcher(None, answer, text[::-1]).ratio()
    words = difflib.SequenceMatcher(None, answer, word_order_reversal(text)).ratio()
    if max(full, words) < BEHAVIOUR_MIN_RATIO:
        return "other"
    return "full" if full >= words else "word_order"


def reverse_text_reward(answer: str | None, text: str) -> float:
    """Similarity ratio of ``answer`` to ``text`` reversed; 0.0 when there is no answer."""
    if answer is None:
        return 0.0
    return difflib.SequenceMatcher(None, answer, text[::-1]).ratio()


class ReverseTextEnv(SingleTurnEnv):
    name = "reverse_text"
    default_instruction = DEFAULT_INSTRUCTION

    def build_messages(self, example: dict[str, Any]) -> list[dict[str, str]]:
        text = example.get("text")
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"reverse_text example needs a non-empty str 'text' field, got {example!r}"
            )
        return [{"role": "user", "content": f"{self.instruction}\n{text}"}]

    def reference_completion(self, example: dict[str, Any]) -> str:
        """The perfect answer, for SFT warm-up (the reward of this text is 1.0)."""
        return f"<answer>{example['text'][::-1]}</answer>"

    demo_behaviours = ("word_order", "no_tags")

    def demonstration(self, example: dict[str, Any], behaviour: str) -> str:
        """A worse behaviour's completion, for a mixed-quality warm-up (never for the reward)."""
        text = example["text"]
        if behaviour == "word_order":
            return f"<answer>{word_order_reversal(text)}</answer>"
        if behaviour == "no_tags":
            return text[::-1]
        raise ValueError(f"unknown behaviour {behaviour!r}; known: {self.demo_behaviours}")

    def score(self, text: str, example: dict[str, Any]) -> tuple[float, dict[str, float]]:
        answer = extract_answer(text)
        reward = reverse_text_reward(answer, example["text"])
        kind = classify_answer(answer, example["text"])
        metrics = {f"behaviour/{b}": float(b == kind) for b in BEHAVIOURS}
        return reward, {"format_ok": float(answer is not None), **metrics}
