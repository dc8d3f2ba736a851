"""The records that cross a component boundary: what a dispatcher emits (``Rollout``, its
``Completion`` turns and ``Branch`` paths), what a train sink builds (``Sample``), what the trainer
and the eval sink consume (``TrainBatch``, ``EvalBatch``), the sampling a request carries
(``SamplingParams``), and every way a completion can end (``FINISH_REASONS``).

Facts and their single owners (docs/design.md section 3):
- ``token_ids`` are the engine's sampled ids, kept as ids end to end (never re-tokenized).
- ``logprobs`` are the behavior log-probabilities recorded by the engine at sampling time, per
  token, at the sampling temperature.
- ``versions`` are the params version of the decode step that produced each token. A rollout's
  head version is the oldest version among its model tokens; staleness is bounded and reported
  on the head.
- ``reward`` is computed by the environment; advantages by the algorithm in the train sink.
- ``off_policy_steps`` = ``(step - 1) - head_version``, stamped at ship time, only for rollouts
  sampled from the live policy (``live_policy``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

# Sentinel version for tokens the model did not produce (prompt, environment replies).
NO_VERSION = -1


class NonFiniteReward(ValueError):
    """An environment produced a NaN / inf reward. Its rollout becomes an error rollout whose
    error text starts with the class name, so sinks count it apart from other failures."""


class EnvTimeout(TimeoutError):
    """A rollout ran past ``env_timeout_s`` and was cancelled (an error rollout)."""


def has_nonfinite_reward(rollout: Rollout) -> bool:
    """The rollout's reward was NaN / inf: rejected by the env's check (``NonFiniteReward``),
    by the advantage estimator (``NonFiniteRewardError``), or still on the rollout."""
    if rollout.errors:
        return any(e.startswith(NonFiniteReward.__name__) for e in rollout.errors)
    return not math.isfinite(rollout.reward)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the engine samples one completion. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    # Per-request seed: token i is drawn from a key of (seed, prompt length, i) only, whatever
    # engine, replica or slot serves it. None: the engine's own RNG stream.
    seed: int | None = None
    # The most likely alternatives to report with each sampled token (0: none). Asking costs a
    # top-k per decode step for the whole batch, so the engine computes it only while some
    # running request asks (its most is ``inference.limits.MAX_TOP_LOGPROBS``).
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite value >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (
            isinstance(self.seed, int | np.integer)
            and not isinstance(self.seed, bool)
            and 0 <= self.seed < 2**31
        ):
            raise ValueError(f"seed must be None or an int in [0, 2**31), got {self.seed!r}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0 (0: none), got {self.top_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Every way a completion can end (``Completion.finish_reason``), and whether it is a whole
# sample. A completion cut short was scored on partial text, so its rollout is never trained.
FINISH_REASONS = {
    "stop": True,  # a stop id was sampled (the last of ``token_ids``)
    "length": True,  # ``max_tokens``, or the engine's cache, ran out
    "abort": False,  # the engine ended it early with what it had (``pause("abort")``)
    "cancelled": False,  # its caller went away first (a client gone, a deadline passed)
    # The chat API's name for a reply that ended in tool calls it parsed (a stop id, or
    # max_tokens after whole calls): the engine never gives it, a response may.
    "tool_calls": True,
}


def finish_trainable(reason: str) -> bool:
    """Whether a completion that ended with ``reason`` is whole (``FINISH_REASONS``); a reason
    not declared there raises ``ValueError`` naming it and the known ones."""
    whole = FINISH_REASONS.get(reason)
    if whole is None:
        known = ", ".join(FINISH_REASONS)
        raise ValueError(f"unknown finish_reason {reason!r}: a completion ends with one of {known}")
    return whole


@dataclasses.dataclass
class Completion:
    """One engine generation: per generated token its id, behavior log-prob and params version,
    and how it ended (one of ``FINISH_REASONS``, checked). ``top_logprobs``, only when its
    sampling asked for alternatives: per token the most likely ``(id, logprob)`` pairs, most
    likely first, from the distribution its log-prob was taken from."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        finish_trainable(self.finish_reason)
        tops = len(self.token_ids) if self.top_logprobs is None else len(self.top_logprobs)
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions) == tops:
            raise ValueError(
                "Completion fields must have equal lengths, got "
                f"token_ids={len(self.token_ids)} logprobs={len(self.logprobs)} "
                f"versions={len(self.versions)} top_logprobs={tops}"
            )


@dataclasses.dataclass
class Sample:
    """One training sequence: a rollout's token trace with per-token training targets.

    All arrays have the same length ``len(token_ids)``. Non-model tokens have
    ``loss_mask == False``, ``logprobs == 0``, ``advantages == 0`` and ``versions == NO_VERSION``.
    """

    token_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # bool
    logprobs: np.ndarray  # float32, behavior log-probs at the sampling temperature
    advantages: np.ndarray  # float32
    temperatures: np.ndarray  # float32, the sampling temperature fanned out to tokens
    versions: np.ndarray  # int32
    off_policy_steps: int | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclasses.dataclass
class Branch:
    """Another root-to-leaf path of a rollout whose trace branches (a verifiers trace whose
    re-rendered turn did not extend the sampled ids). Aligned like the rollout's own trace;
    tokens it shares with an earlier path carry ``loss_mask == False``, so a token trains once.
    """

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    versions: list[int]


@dataclasses.dataclass
class Rollout:
    """One episode of one environment on one example, whatever its fate.

    The token trace (``token_ids``) is the whole conversation as the model saw it: prompt,
    model turns and environment replies, in order. ``loss_mask`` marks the model's tokens,
    the only ones trained on; ``logprobs`` and ``versions`` are aligned with ``token_ids``.
    """

    env: str
    group_id: int
    episode_id: int
    example: dict[str, Any]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    num_turns: int = 0
    temperature: float = 1.0
    trainable: bool = True
    cut: str | None = None  # the finish reason of a completion ended short (not trainable)
    filtered: bool = False
    filter_reasons: list[str] = dataclasses.field(default_factory=list)
    is_eval: bool = False
    eval_step: int | None = None  # the train step an eval rollout was scheduled for
    # False for replayed / externally supplied rollouts: they carry no meaningful version.
    live_policy: bool = True
    policy_version_at_start: int = 0
    off_policy_steps: int | None = None
    advantage: float | None = None
    samples: list[Sample] = dataclasses.field(default_factory=list)
    # The trace's further paths when it branches: one more ``Sample`` each (same advantage).
    branches: list[Branch] = dataclasses.field(default_factory=list)
    # Timestamps on the orchestrator's clock (monotonic seconds, or virtual time in simulation).
    admitted_at: float = 0.0
    finished_at: float = 0.0
    shipped_at: float = 0.0
    # A train rollout's place in the data order: (its group's ordinal, its index in the group);
    # the same across restarts, so the rollout journal can tell what a restart still owes.
    slot: tuple[int, int] | None = None

    @property
    def has_error(self) -> bool:
        return bool(self.errors)

    def capture_error(self, exc: BaseException) -> None:
        self.errors.append(f"{type(exc).__name__}: {exc}")
        self.trainable = False

    def flag(self, reason: str) -> None:
        """Keep this rollout out of every batch, for ``reason`` (reasons accumulate, once each)."""
        self.filtered = True
        if reason not in self.filter_reasons:
            self.filter_reasons.append(reason)

    @property
    def num_model_tokens(self) -> int:
        return int(sum(self.loss_mask)) + sum(int(sum(b.loss_mask)) for b in self.branches)

    def _model_versions(self) -> list[int]:
        paths = [self, *self.branches]
        return [
            v for p in paths for v, m in zip(p.versions, p.loss_mask, strict=True) if m and v >= 0
        ]

    @property
    def head_version(self) -> int:
        """Oldest params version among the model's tokens (the one staleness is bounded on);
        the version at group start when no model token carries one."""
        vs = self._model_versions()
        return min(vs) if vs else self.policy_version_at_start

    @property
    def tail_version(self) -> int:
        vs = self._model_versions()
        return max(vs) if vs else self.policy_version_at_start

    def validate_trace(self) -> None:
        for i, path in enumerate([self, *self.branches]):
            n = len(path.token_ids)
            lens = {
                "loss_mask": len(path.loss_mask),
                "logprobs": len(path.logprobs),
                "versions": len(path.versions),
            }
            bad = {k: v for k, v in lens.items() if v != n}
            if bad:
                where = "rollout trace" if i == 0 else f"rollout branch {i}"
                raise ValueError(f"{where} misaligned: token_ids has {n} entries but {bad}")


# An episode is what one dispatched unit of work yields: one rollout (per-rollout env) or a
# whole group (per-group env). The main loop stamps and routes it as a unit.
Episode = list[Rollout]


@dataclasses.dataclass
class TrainBatch:
    """What the trainer consumes for one optimizer step.

    ``samples`` is the training payload (clean rollouts only); ``rollouts`` is the observation
    window since the previous batch (every rollout seen, errored and filtered too, for metrics).
    """

    step: int
    samples: list[Sample]
    rollouts: list[Rollout]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # The clean rollouts whose samples are in ``samples`` (surplus rollouts carry over between
    # batches, so the window does not say which ones a batch trains on).
    trained: list[Rollout] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


@dataclasses.dataclass
class EvalBatch:
    step: int
    env: str
    rollouts: list[Rollout]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
