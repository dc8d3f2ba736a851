"""The dispatcher's settings: three frozen dataclasses, validated where they enter.

What it owns
    ``DispatchConfig`` (permits, each env's group size and sampling, the poll and stop
    timings), ``GateHooks`` (the admission bound as callables; the defaults bound nothing) and
    ``EvalPlan`` (what every eval pass runs), and their resolution against the env names:
    a per-env setting is one value for every env or a mapping whose keys are exactly the env
    names. Scalar settings are checked when a dataclass is built, per-env ones when it is
    resolved; every message names the bad value and what would be accepted.

Who uses it: ``dispatch.RolloutDispatcher`` (which re-exports the three dataclasses), its
parts (``evals``, ``launch``) and whoever constructs one. A helper of the dispatcher, not a
component: it holds no state.

Never: import another orchestrator module (gate, sinks, watcher, logger, store, loop).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_orch.types import Environment, SamplingParams, Source


def per_env(name: str, value: Any, envs: Mapping[str, Any], kind: type) -> dict[str, Any]:
    """Expand a scalar setting to every env, or check a mapping covers exactly the envs."""
    if isinstance(value, Mapping):
        if set(value) != set(envs):
            raise ValueError(f"{name} keys {sorted(value)} must equal the env names {sorted(envs)}")
        out = dict(value)
    else:
        out = {e: value for e in envs}
    for env, v in out.items():
        if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 1)):
            want = "an int >= 1" if kind is int else f"a {kind.__name__}"
            raise ValueError(f"{name} for env {env!r} must be {want}, got {v!r}")
    return out


def _int_at_least_1(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """``max_inflight`` permits (train and eval together); each env's ``group_size`` and
        ``sampling`` (one value for every env, or a mapping by env name); how long a pass may sleep
        with nothing waking it; how long ``stop()`` waits for cancelled rollouts to unwind; how long
    one rollout may run before it is cancelled as an ``EnvTimeout`` error (None: unbounded);
    ``request_seed``: the run's seed, from which every rollout gets its own sampling seed
    (``rollout_seed``; None: the engine's own RNG), so its samples do not depend on which
    engine, replica or slot serves it."""

    max_inflight: int
    group_size: int | Mapping[str, int]
    sampling: SamplingParams | Mapping[str, SamplingParams]
    poll_interval_s: float = 0.5
    stop_timeout_s: float = 30.0
    env_timeout_s: float | None = None
    request_seed: int | None = None

    def __post_init__(self) -> None:
        _int_at_least_1("max_inflight", self.max_inflight)
        if not (isinstance(self.poll_interval_s, int | float) and self.poll_interval_s > 0):
            raise ValueError(f"poll_interval_s must be > 0 seconds, got {self.poll_interval_s!r}")
        if not (isinstance(self.stop_timeout_s, int | float) and self.stop_timeout_s >= 0):
            raise ValueError(f"stop_timeout_s must be >= 0 seconds, got {self.stop_timeout_s!r}")
        t = self.env_timeout_s
        if t is not None and not (isinstance(t, int | float) and t > 0):
            raise ValueError(f"env_timeout_s must be > 0 seconds or None, got {t!r}")

    def resolve(
        self, envs: Mapping[str, Environment], source: Source | Mapping[str, Source]
    ) -> tuple[dict[str, int], dict[str, SamplingParams], dict[str, Source]]:
        """Group size, sampling and source of every train env."""
        if not envs:
            raise ValueError("envs must name at least one training environment, got none")
        group_size = per_env("group_size", self.group_size, envs, int)
        sampling = per_env("sampling", self.sampling, envs, SamplingParams)
        if not isinstance(source, Mapping):
            if len(envs) > 1:
                raise ValueError(
                    f"several envs {sorted(envs)} need a source per env (a mapping), "
                    f"got one {type(source).__name__}"
                )
            source = {e: source for e in envs}
        return group_size, sampling, per_env("source", source, envs, object)


@dataclasses.dataclass(frozen=True)
class GateHooks:
    """The admission bound as callables (the loop takes them from its gate): free train slots
    now; ``n`` train rollouts admitted; ``n`` finished, accepted or not. Defaults bound nothing."""

    capacity_fn: Callable[[], int] = lambda: 1 << 62
    on_admit: Callable[[int], None] = lambda n: None
    on_finish: Callable[[int, bool], None] = lambda n, accepted: None


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """Every eval pass: ``num_examples`` examples from each of ``sources`` (by env name; none
    means no eval), one rollout each, on ``envs`` (default: the train envs), sampled with
    ``sampling`` (default: that env's train sampling)."""

    envs: Mapping[str, Environment] | None = None
    sources: Mapping[str, Source] = dataclasses.field(default_factory=dict)
    num_examples: int = 8
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        _int_at_least_1("eval num_examples", self.num_examples)

    def resolve(
        self, train_envs: Mapping[str, Environment], train_sampling: Mapping[str, SamplingParams]
    ) -> tuple[dict[str, Environment], dict[str, Source]]:
        """The eval envs and sources, checked against each other and against the sampling."""
        envs = dict(self.envs if self.envs is not None else train_envs)
        sources = dict(self.sources)
        for env in sources:
            if env not in envs:
                raise ValueError(f"eval source {env!r} has no env; envs: {sorted(envs)}")
        missing = [e for e in sources if e not in train_sampling]
        if missing and self.sampling is None:
            raise ValueError(
                f"eval envs {missing} have no train sampling params: pass EvalPlan.sampling"
            )
        return envs, sources


def rollout_seed(run_seed: int, *position: Any) -> int:
    """A rollout's sampling seed: a hash of the run's seed and where the rollout sits (train:
    the group's ordinal and the index in it; eval: the step and the example's index), the same
    in every process and every run of the same config."""
    text = ":".join(str(x) for x in (run_seed, *position)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little") & 0x7FFFFFFF
