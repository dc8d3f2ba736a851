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

import numpy as np
import pytest
from support.runs import prepare, run
from support.toy_rl import toy_config

pytestmark = pytest.mark.slow


def test_grpo_raises_a_learnable_reward_from_scratch(tmp_path):
    # Random init (Warmup.steps = 0): everything the policy gains here comes from RL.
    cfg = toy_config({"RL.steps": 20, "RL.learning_rate": 3e-3})
    summary = run(prepare(cfg, tmp_path))
    assert summary["rl_steps"] == 20
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reward = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert len(reward) == 20
    first, last = float(np.mean(reward[:4])), float(np.mean(reward[-4:]))
    # Measured: 0.07 -> 0.70 over 20 steps. With each group's advantages permuted before they
    # are fanned out to tokens (a pairing bug), it stays at 0.06-0.11 and this test fails.
    assert first < 0.25, reward
    assert last > first + 0.15, reward
