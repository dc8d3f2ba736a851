"""Shared by the in-process RL tests: a toy environment whose reward the policy gradient can
reach from a random init, and a small single-device ``TrainConfig`` around it.

``LowercaseEnv`` rewards the fraction of lowercase letters among a completion of ``NEW_TOKENS``
bytes (about 1 in 10 of the output ids at the start), so every group has spread to learn from.
"""

from __future__ import annotations

import string
from typing import Any

from jaxrl_orch.config.load import make_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.envs.base import SingleTurnEnv, register_env

NEW_TOKENS = 12
_LETTERS = frozenset(string.ascii_lowercase)


class LowercaseEnv(SingleTurnEnv):
    """Reward = lowercase letters among the completion's characters / ``NEW_TOKENS``."""

    name = "lowercase_toy"

    def build_messages(self, example):
        return [{"role": "user", "content": example["text"][:8]}]

    def score(self, text, example):
        return sum(ch in _LETTERS for ch in text) / NEW_TOKENS, {}


class _TextOnly:
    """The run's tokenizer, except that scoring never sees control tokens: ``<|im_end|>``
    spelled out would hand the policy free letters (it finds them within a few steps)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=True)


register_env(LowercaseEnv.name, lambda tokenizer, **kw: LowercaseEnv(_TextOnly(tokenizer), **kw))


def toy_config(overrides: dict[str, Any] | None = None) -> TrainConfig:
    """RL only (no warm-up), short completions, engine and trainer on one device each.
    ``overrides``: ``{"RL.steps": 20}``-style settings on top."""
    settings: dict[str, Any] = {
        "Data.env": LowercaseEnv.name,
        "Warmup.steps": 0,
        "RL.prompts_per_step": 4,
        "RL.group_size": 8,
        "RL.max_new_tokens": NEW_TOKENS,
        "RL.lr_warmup_steps": 1,
        "RL.dynamic_sampling": False,
        "RL.eval_examples": 4,
        "RL.eval_every": 1000,
        "Trainer.row_len": 64,
        "Trainer.mesh": (("fsdp", 1),),
        "Engine.slots": 32,
        "Engine.mesh": (("tp", 1),),
        "Processes.colocated": False,
        "Outputs.checkpoint_every": 1000,
    }
    return make_config({**settings, **(overrides or {})})
