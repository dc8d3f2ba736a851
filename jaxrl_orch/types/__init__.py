"""The cross-component contract, the bottom layer: everything that crosses a component boundary
is defined here, and only here. ``records``: the data (rollouts, samples, batches, sampling,
finish reasons); ``policy``: the shared policy version; ``protocols``: what components are
written against. Imports nothing from the rest of the package; the names are re-exported here
so that every layer imports them from one place (``from jaxrl_orch.types import Rollout``)."""

from jaxrl_orch.types.policy import PolicyHandle
from jaxrl_orch.types.protocols import (
    Algorithm,
    BatchTrainer,
    Environment,
    InferenceClient,
    InferencePool,
    MetricsWriter,
    Source,
    VersionObserver,
)
from jaxrl_orch.types.records import (
    FINISH_REASONS,
    NO_VERSION,
    Branch,
    Completion,
    EnvTimeout,
    Episode,
    EvalBatch,
    NonFiniteReward,
    Rollout,
    Sample,
    SamplingParams,
    TrainBatch,
    finish_trainable,
    has_nonfinite_reward,
)

__all__ = [
    "FINISH_REASONS",
    "NO_VERSION",
    "Algorithm",
    "BatchTrainer",
    "Branch",
    "Completion",
    "EnvTimeout",
    "Environment",
    "Episode",
    "EvalBatch",
    "InferenceClient",
    "InferencePool",
    "MetricsWriter",
    "NonFiniteReward",
    "PolicyHandle",
    "Rollout",
    "Sample",
    "SamplingParams",
    "Source",
    "TrainBatch",
    "VersionObserver",
    "finish_trainable",
    "has_nonfinite_reward",
]
