"""The end-of-stage summary as pure functions of what the run measured (no I/O, no JAX).

What it owns: turning eval batches and step records into the ``summary.json`` keys that the
report, ``jaxrl-lift`` and users read: the greedy and sampled eval curves, their
first and last values, the behaviour shares per eval (``{"greedy"|"sampled": {step: {behaviour:
share}}}``), train-reward endpoints and the age histogram; and the one-line console summary of
an eval. The RL stage (``rl.py``) and the imitation control (``control.py``) both summarise
through here, so their keys mean the same thing.

``before`` is the warm-up's eval as first measured (``eval_before_rl.json``: reward, sampled,
behaviour): a resumed run no longer holds its step-0 eval batch, but still reports it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_REWARD_KEY = re.compile(r"^eval/(.+)/reward_mean$")


def eval_curve(evals: Mapping[int, Mapping[str, float]], env: str) -> dict[int, float]:
    """``{step: eval/<env>/reward_mean}`` over the evals that scored something."""
    key = f"eval/{env}/reward_mean"
    return {s: m[key] for s, m in sorted(evals.items()) if key in m}


def behaviour_shares(
    evals: Mapping[int, Mapping[str, float]], env: str, label: str = "behaviour/"
) -> dict[str, dict[str, float]]:
    """``{str(step): {behaviour: share}}`` from the ``eval/<env>/behaviour/*`` keys (or another
    ``label``'s)."""
    p = f"eval/{env}/{label}"
    out = {}
    for step, m in sorted(evals.items()):
        shares = {k[len(p) :]: v for k, v in m.items() if k.startswith(p)}
        if shares:
            out[str(step)] = shares
    return out


def env_scores(evals: Mapping[int, Mapping[str, float]], env: str) -> dict[str, dict[str, float]]:
    """``{str(step): {"reward/x" | "metric/y": mean}}``: a verifiers environment's named rewards
    and metrics at each greedy eval."""
    out: dict[str, dict[str, float]] = {}
    for label in ("reward/", "metric/"):
        for step, means in behaviour_shares(evals, env, label).items():
            out.setdefault(step, {}).update({label + k: v for k, v in means.items()})
    return out


def merge_evals(batches: Iterable[Any]) -> dict[int, dict[str, float]]:
    """Eval batches (``EvalBatch``: step, metrics) -> one metrics dict per eval step."""
    out: dict[int, dict[str, float]] = {}
    for b in batches:
        out.setdefault(int(b.step), {}).update(b.metrics)
    return out


def first_eval(
    evals: Mapping[int, Mapping[str, float]], env: str, sampled_env: str
) -> dict[str, Any] | None:
    """What ``eval_before_rl.json`` records (None when this run did not evaluate step 0)."""
    if 0 not in eval_curve(evals, env):
        return None
    first = {k: v["0"] for k, v in shares_both(evals, env, sampled_env).items() if "0" in v}
    return {
        "reward": eval_curve(evals, env)[0],
        "sampled": eval_curve(evals, sampled_env).get(0),
        "behaviour": first,
    }


def shares_both(evals: Mapping[int, Mapping[str, float]], env: str, sampled_env: str) -> dict:
    return {"greedy": behaviour_shares(evals, env), "sampled": behaviour_shares(evals, sampled_env)}


def eval_summary(
    evals: Mapping[int, Mapping[str, float]],
    env: str,
    sampled_env: str,
    before: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The eval keys of ``summary.json`` (see the module docstring)."""
    before = before or {}
    greedy = eval_curve(evals, env)
    sampled = eval_curve(evals, sampled_env)
    behaviour = shares_both(evals, env, sampled_env)
    for kind, shares in before.get("behaviour", {}).items():
        behaviour[kind] = {"0": shares, **behaviour[kind]}
    return {
        "eval_reward_before_rl": before.get("reward", greedy.get(0)),
        "eval_reward_final": greedy[max(greedy)] if greedy else None,
        "eval_rewards": {str(k): v for k, v in greedy.items()},
        "eval_sampled_reward_before_rl": before.get("sampled", sampled.get(0)),
        "eval_sampled_reward_final": sampled[max(sampled)] if sampled else None,
        "behaviour": behaviour,
        "env_scores": env_scores(evals, env),
    }


def train_reward_ends(step_metrics: Iterable[Mapping[str, float]]) -> dict[str, float | None]:
    rewards = [m["train/reward_mean"] for m in step_metrics if "train/reward_mean" in m]
    return {
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
    }


def eval_line(metrics: Mapping[str, float]) -> str:
    """``env reward (behaviour share ...)`` for each env of one eval's metrics, for the console."""
    parts = []
    for key, value in sorted(metrics.items()):
        match = _REWARD_KEY.match(key)
        if match:
            p = f"eval/{match.group(1)}/behaviour/"
            shares = {k[len(p) :]: v for k, v in metrics.items() if k.startswith(p)}
            text = " ".join(f"{b} {v:.0%}" for b, v in shares.items() if v)
            parts.append(f"{match.group(1)} {value:.3f}" + (f" ({text})" if text else ""))
    return "; ".join(parts) or "no eval landed"
