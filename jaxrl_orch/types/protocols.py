"""The Protocols components are written against: how the orchestrator reaches the engine
(``InferenceClient``, ``InferencePool``), environments, sources, the algorithm, the trainer and
the metric writers without importing any of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxrl_orch.types.records import Completion, Rollout, SamplingParams, TrainBatch


@runtime_checkable
class InferenceClient(Protocol):
    """The async interface environments call to generate. Multi-turn: pass the full history."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion: ...


@runtime_checkable
class InferencePool(Protocol):
    """Several clients (engines/replicas); ``select`` picks one to pin a group to."""

    def select(self) -> InferenceClient: ...


@runtime_checkable
class Environment(Protocol):
    """Runs and scores one rollout. Raising is allowed: the dispatcher turns it into an error
    rollout."""

    name: str

    async def run(
        self,
        client: InferenceClient,
        example: dict[str, Any],
        *,
        group_id: int,
        episode_id: int,
        sampling: SamplingParams,
    ) -> Rollout: ...


@runtime_checkable
class Source(Protocol):
    """Where prompts come from. Its state is part of the checkpoint (the data cursor)."""

    def next_example(self) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Algorithm(Protocol):
    """Turns one group's rewards into per-rollout advantages (pure, NumPy)."""

    name: str

    def advantages(self, rewards: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class VersionObserver(Protocol):
    def on_version(self, version: int) -> None: ...


@runtime_checkable
class MetricsWriter(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class BatchTrainer(Protocol):
    """What the orchestrator ships batches to. ``submit`` must not block the event loop: the
    trainer works in the background and publishes ``(version, params, metrics)`` when a step is
    done."""

    def submit(self, batch: TrainBatch) -> None: ...
