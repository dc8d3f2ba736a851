"""A user environment plugged by name (``Data.env = 'support.dense_env:make'``) for runs that must
see learning signal from an untrained model: the bundled reverse-text task, scored by the share
of lowercase letters and spaces in the completion (in [0, 1], different for almost every
sample), so every group has non-zero advantages from the first step.

Importable from every process of a multi-process run (``PYTHONPATH`` holds ``tests/``:
``support.checkout.subprocess_env``)."""

from __future__ import annotations

from typing import Any

from jaxrl_orch.envs.reverse_text import ReverseTextEnv


class DenseReverseText(ReverseTextEnv):
    name = "dense_reverse_text"

    def score(self, text: str, example: dict[str, Any]) -> tuple[float, dict[str, float]]:
        _, metrics = super().score(text, example)
        share = sum(c.islower() or c == " " for c in text) / max(len(text), 1)
        return share, metrics


def make(**kwargs: Any) -> DenseReverseText:
    return DenseReverseText(**kwargs)
