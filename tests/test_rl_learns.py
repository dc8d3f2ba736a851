"""RL through the whole product learns a reward that the policy gradient can reach.

The end-to-end tests check plumbing; this one checks the direction of learning. A randomly
initialised byte model answers any prompt with 12 sampled bytes and is rewarded for the fraction
of them that are lowercase ASCII letters (about 1 in 10 of the output ids at the start). The real
engine samples, the orchestrator groups and scores, GRPO turns rewards into advantages, the train
sink fans them out to tokens, packing places them next to their log-probs, and the trainer takes
clipped policy-gradient steps; every trained version goes back to the engine. If any link
scrambled the pairing of a rollout's tokens with its advantage, flipped a sign or trained on
stale weights without reloading, the sampled reward would not climb.
"""

from __future__ import annotations

import json
import string

import numpy as np
import pytest

from jaxrl_orch.config import TrainConfig
from jaxrl_orch.envs.base import SingleTurnEnv, register_env
from jaxrl_orch.run import Experiment

pytestmark = pytest.mark.slow

_LETTERS = frozenset(string.ascii_lowercase)
_NEW_TOKENS = 12


class LowercaseEnv(SingleTurnEnv):
    """Reward = lowercase letters among the completion's characters / ``_NEW_TOKENS``."""

    name = "lowercase_toy"

    def build_messages(self, example):
        return [{"role": "user", "content": example["text"][:8]}]

    def score(self, text, example):
        return sum(ch in _LETTERS for ch in text) / _NEW_TOKENS, {}


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


def test_grpo_raises_a_learnable_reward_from_scratch(tmp_path):
    cfg = TrainConfig(
        env=LowercaseEnv.name,
        sft_steps=0,  # random init: everything the policy gains here comes from RL
        rl_steps=20,
        prompts_per_step=4,
        group_size=8,
        max_new_tokens=_NEW_TOKENS,
        rl_learning_rate=3e-3,
        rl_warmup_steps=1,
        dynamic_sampling=False,
        row_len=64,
        decode_slots=32,
        eval_every=1000,
        eval_examples=4,
        checkpoint_every=1000,
        trainer_mesh=(("fsdp", 1),),
        decode_mesh=(("tp", 1),),
        colocated=False,
    )
    exp = Experiment(cfg, tmp_path)
    exp.validate()
    summary = exp.run()
    assert summary["rl_steps"] == 20
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reward = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert len(reward) == 20
    first, last = float(np.mean(reward[:4])), float(np.mean(reward[-4:]))
    # Measured: 0.07 -> 0.70 over 20 steps. With each group's advantages permuted before they
    # are fanned out to tokens (a pairing bug), it stays at 0.06-0.11 and this test fails.
    assert first < 0.25, reward
    assert last > first + 0.15, reward
