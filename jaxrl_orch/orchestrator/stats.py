"""Per-step statistics the main loop computes when it ships a batch.

What it owns: two pure helpers, kept out of the loop so they can be tested against NumPy
on their own:

- ``summaries(series)``: max / mean / p50 / p95 / p99 of several equal-length series (the
  observed head age, its in-flight and in-queue parts, seconds in flight and in queue), in one
  sorted array. The values equal ``np.max``, ``np.mean`` and ``np.percentile`` (linear
  interpolation) exactly; calling those per series cost more than the rest of a step.
- ``head_versions(rollouts)``: each rollout's ``head_version`` (the oldest params version
  among its model tokens), read off the samples the train sink built, in one pass.
- ``behaviour_shares(rollouts)``: the share of rollouts an env labelled with each
  ``behaviour/<name>``, and the mean of each ``reward/<name>`` and ``metric/<name>`` (used by
  both sinks, so train and eval count them alike).
- ``window_stats(rollouts)``: the train sink's window counts (errors, of them ``nonfinite_rewards``,
  untrainable and of them ``untrainable/<reason>`` by ``untrainable_kind``, filtered) and the
  mean / std of its scored rewards (not a cut rollout's), with the behaviour shares.
- ``untrainable_kind(rollout)``: why a rollout without an error is not trainable: the finish
  reason that cut it (``Rollout.cut``), or ``other`` (an env's own verdict).

Pure host NumPy: no state, no asyncio, no imports of orchestrator components.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_orch.types import FINISH_REASONS, Rollout, has_nonfinite_reward

_QUANTILES = np.array([0.50, 0.95, 0.99])
_STATS = ("max", "mean", "p50", "p95", "p99")


@functools.lru_cache(maxsize=64)
def _ranks(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For ``n`` sorted values: the ranks each quantile falls between, its fraction ``t`` and
    ``t >= 0.5`` (a batch has the same size step after step, so this is computed once)."""
    idx = _QUANTILES * (n - 1)
    lo = np.floor(idx).astype(np.intp)
    hi = np.minimum(lo + 1, n - 1)
    t = idx - lo
    return lo, hi, t, t >= 0.5


def summaries(series: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``<name>_{max,mean,p50,p95,p99}`` of equal-length series, all in one sorted array.

    Percentiles are NumPy's default (linear interpolation between closest ranks), computed
    here directly: ``np.percentile`` costs more per call than the rest of a step."""
    names = list(series)
    if not names or not len(series[names[0]]):
        return {}
    a = np.array([series[k] for k in names], np.float64)
    n = a.shape[1]
    # Before sorting, so the sum runs in np.mean's order; np.mean is this plus Python overhead.
    mean = a.sum(axis=1, keepdims=True) / n
    a.sort(axis=1)
    lo, hi, t, upper = _ranks(n)
    below = a[:, lo]
    above = a[:, hi]
    diff = above - below
    # NumPy's lerp: interpolate from the nearer end, so a tie (below == above) is exact.
    q = np.where(upper, above - diff * (1 - t), below + diff * t)
    stats = np.concatenate((a[:, -1:], mean, q), axis=1).tolist()
    return {
        f"{name}_{stat}": stats[i][j]
        for i, name in enumerate(names)
        for j, stat in enumerate(_STATS)
    }


_NO_HEAD = np.iinfo(np.int32).max


def head_versions(rollouts: Sequence[Rollout]) -> list[int]:
    """``Rollout.head_version`` of each rollout, read off its sample's versions in one pass.

    A sample holds ``NO_VERSION`` off the model's tokens, so the oldest non-negative version of
    the sample is the trace's head. Rollouts without exactly one non-empty sample fall back to
    the property."""
    versions = []
    for r in rollouts:
        if len(r.samples) != 1:
            return [r.head_version for r in rollouts]
        versions.append(r.samples[0].versions)
    lengths = [v.shape[0] for v in versions]
    if not versions or 0 in lengths:
        return [r.head_version for r in rollouts]
    v = np.concatenate(versions)
    starts = np.cumsum(lengths) - lengths
    heads = np.minimum.reduceat(np.where(v >= 0, v, _NO_HEAD), starts).tolist()
    return [
        h if h != _NO_HEAD else r.policy_version_at_start
        for h, r in zip(heads, rollouts, strict=True)
    ]


# Rollout metrics an env labels for aggregation: behaviour one-hots (the bundled envs) and a
# verifiers trace's named rewards and metrics (``envs.vf``).
LABELS = ("behaviour/", "reward/", "metric/")


def behaviour_shares(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Mean of each labelled rollout metric (``LABELS``) over ``rollouts`` (absent keys count
    0): for behaviour one-hots, each behaviour's share."""
    keys = sorted({k for r in rollouts for k in r.metrics if k.startswith(LABELS)})
    n = len(rollouts)
    return {k: sum(r.metrics.get(k, 0.0) for r in rollouts) / n for k in keys} if n else {}


# Every way a completion ends short is counted in every window, 0 included: a step row always
# says how many cut rollouts were kept out of training.
CUT_KINDS = tuple(reason for reason, whole in FINISH_REASONS.items() if not whole)


def untrainable_kind(rollout: Rollout) -> str:
    return rollout.cut or "other"


def window_stats(window: Sequence[Rollout]) -> dict[str, float]:
    """Counts and reward statistics of the rollouts the train sink saw since its last batch."""
    # One pass in plain Python: a few dozen rollouts, so NumPy calls (~5 us each) would cost
    # more than the arithmetic.
    errors = 0
    untrainable = 0
    filtered = 0
    nonfinite = 0
    kinds = dict.fromkeys(CUT_KINDS, 0)
    scored = []
    for r in window:
        nonfinite += has_nonfinite_reward(r)  # an env's error, or a NaN the sink filtered
        if r.errors:
            errors += 1
        else:
            if not r.trainable:
                untrainable += 1
                kind = untrainable_kind(r)
                kinds[kind] = kinds.get(kind, 0) + 1
            # A cut rollout's reward scored partial text: it says nothing of the policy.
            if r.cut is None and math.isfinite(r.reward):
                scored.append(r)
        filtered += r.filtered
    m = {
        "rollouts_seen": float(len(window)),
        "errors": float(errors),
        "untrainable": float(untrainable),
        "filtered": float(filtered),
        "nonfinite_rewards": float(nonfinite),
        **{f"untrainable/{kind}": float(n) for kind, n in kinds.items()},
    }
    if scored:
        rewards = [r.reward for r in scored]
        mean = math.fsum(rewards) / len(rewards)
        m["reward_mean"] = mean
        m["reward_std"] = math.sqrt(math.fsum((x - mean) ** 2 for x in rewards) / len(rewards))
    m.update(behaviour_shares(scored))
    return m
