"""Group-relative advantage estimators (critic-free): one scalar per rollout of a group.

What this owns: turning the rewards of one prompt group (the ``G`` rollouts sampled for the
same example) into one advantage per rollout. Each estimator is an object satisfying
``types.Algorithm`` (``name``, ``advantages(rewards) -> np.ndarray``); ``get_algorithm(name)``
builds one from its config name so gin and the command line can swap them.

Estimators (``r`` = the group's rewards, ``G`` = ``len(r)``):

- ``grpo``       mean-centred: ``r - mean(r)``.
- ``grpo_std``   std-normalised (the original GRPO z-score): ``(r - mean(r)) / (std(r) + eps)``,
                 ``eps = 1e-4``; ``std`` uses ``ddof=1`` (the unbiased estimate, as the common
                 recipes compute it) by default.
- ``dr_grpo``    Dr.GRPO: mean-centred, no std division. Its other half, summing token losses
                 and normalising by a constant instead of per-sequence length, lives in the
                 loss (``losses.py``); ``token_sum_normalization`` tells the trainer so.
- ``rloo``       leave-one-out baseline: ``r_i - mean_{j != i} r_j`` = ``G/(G-1) (r_i - mean)``.
- ``permuted:<name>``  the null control: estimator ``<name>``'s advantages, shuffled among the
                 group's rollouts (seeded). Same magnitudes, same zero-signal groups, but the
                 pairing of a rollout with its own reward is destroyed, so what training does
                 under it is what the update noise alone does. Run it next to the real
                 estimator to see how far the reward signal rises above that noise.

Invariants:
- Pure NumPy on the host; no state, no I/O, input never mutated; output float32, shape ``[G]``.
- A group with identical rewards gets exactly zero advantage from every estimator (the train
  sink relies on this to spot groups without signal).
- A group of one rollout has no baseline to compare against: every estimator returns 0.
- Non-finite rewards (NaN/inf) are never turned into advantages: ``advantages`` raises
  ``NonFiniteRewardError`` naming the offending indices and values. The train sink catches
  exactly this error on purpose, counts the rollouts as filtered (reason
  ``non_finite_reward``), drops them, and recomputes the group's advantages on the rest.

Who drives it: the train sink, once per complete group. What it must never do: import
orchestration, engine or trainer code, or see tokens (advantages are per rollout here; the
sink fans them out to the loss-masked tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_orch.types import Algorithm

STD_EPS = 1e-4


class NonFiniteRewardError(ValueError):
    """A group's rewards contain NaN or inf. ``indices`` are the offending positions."""

    def __init__(self, indices: list[int], values: list[float], group: str = "") -> None:
        self.indices = list(indices)
        self.values = list(values)
        where = f" in group {group}" if group else ""
        pairs = ", ".join(f"[{i}]={v!r}" for i, v in zip(self.indices, self.values, strict=True))
        super().__init__(
            f"non-finite rewards{where}: {pairs}; rewards must be finite floats "
            "(the train sink filters such rollouts out with reason 'non_finite_reward')"
        )


def _as_rewards(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a 1-D array of one group's rewards, got shape {r.shape}")
    finite = np.isfinite(r)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise NonFiniteRewardError(bad.tolist(), r[bad].tolist())
    return r


@dataclasses.dataclass(frozen=True)
class GRPO:
    """Mean-centred group advantage ``r - mean(r)`` (optionally divided by ``std + eps``)."""

    normalize_std: bool = False
    eps: float = STD_EPS
    ddof: int = 1
    name: str = "grpo"
    token_sum_normalization: bool = False

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        r = _as_rewards(rewards)
        if r.size <= 1:
            return np.zeros(r.shape, np.float32)
        adv = r - r.sum() / r.size  # np.mean's arithmetic without its Python overhead
        if self.normalize_std:
            adv = adv / (r.std(ddof=self.ddof) + self.eps)
        return adv.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RLOO:
    """Leave-one-out baseline: each rollout is compared with the mean of the others."""

    name: str = "rloo"
    token_sum_normalization: bool = False

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        r = _as_rewards(rewards)
        g = r.size
        if g <= 1:
            return np.zeros(r.shape, np.float32)
        baseline = (r.sum() - r) / (g - 1)
        return (r - baseline).astype(np.float32)


class Permuted:
    """``base``'s advantages in a random order within each group (see module docstring)."""

    def __init__(self, base: Algorithm, seed: int = 0) -> None:
        self.base = base
        self.name = f"{PERMUTED_PREFIX}{base.name}"
        self.token_sum_normalization = bool(getattr(base, "token_sum_normalization", False))
        self._rng = np.random.default_rng(seed)

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        return self._rng.permutation(self.base.advantages(rewards)).astype(np.float32)


PERMUTED_PREFIX = "permuted:"

_REGISTRY: dict[str, Callable[[], Algorithm]] = {
    "grpo": lambda: GRPO(),
    "grpo_std": lambda: GRPO(normalize_std=True, name="grpo_std"),
    "dr_grpo": lambda: GRPO(name="dr_grpo", token_sum_normalization=True),
    "rloo": lambda: RLOO(),
}

ALGORITHM_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_algorithm(name: str) -> Algorithm:
    """Build the estimator registered under ``name`` (one of ``ALGORITHM_NAMES``, or
    ``permuted:`` followed by one of them)."""
    if name.startswith(PERMUTED_PREFIX):
        return Permuted(get_algorithm(name[len(PERMUTED_PREFIX) :]))
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage algorithm {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None
    return factory()
