"""build_orchestrator: the orchestrator's components, built and wired in one place.

What it owns: constructing the gate, dispatcher, train and eval sinks, weight watcher, rollout
store and periodic logger from the loop's settings (``config.orchestrator.OrchestratorConfig``)
and the parts the caller built, grouped by what they are: ``Backend`` (the inference pool, the
trainer and the weight path between them), ``Workload`` (environments, sources, sampling, eval
plan), ``SinkSettings`` (the advantage algorithm and the sink's filters) and ``Telemetry``
(writers, gauges, rollout store). It wires them together by constructor arguments and
callbacks, and hands them to the loop as one ``LoopComponents`` with the caller's ``LoopHooks``:

- gate <- dispatcher: ``GateHooks(capacity, on_admit, on_finish)`` (train rollouts only); a
  resumed run's gate is recovered by its rule (``gate.resume``) and checks the first step;
- gate, dispatcher <- train sink: ``on_discard`` (slots of rollouts the sink drops later are
  freed, and the dispatcher is woken to use them);
- gate <- weight watcher: an observer of the shared ``PolicyHandle``;
- logger <- every component: it pulls ``gauges()``, stamped with the policy version (the last
  trained step);
- fault log (error rollouts to ``<store_dir>/errors.jsonl``) and loop watchdog -> the loop;
- rollout journal (``<store_dir>/journal``, with ``keep_pending``) <- the dispatcher (``on_open``),
  the train sink (``on_scored``) and the loop (what lands, what ships).

The caller creates the ``PolicyHandle`` (its version is the trainer's: a resumed run starts at
``version + 1``) and passes the same handle to anything else that reads it (a simulated engine
stamping versions). It never imports JAX, so the simulator and the benchmarks build exactly
what the product builds.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopComponents, LoopHooks
from jaxrl_orch.orchestrator.dispatcher.dispatch import (
    DispatchConfig,
    EvalPlan,
    GateHooks,
    RolloutDispatcher,
)
from jaxrl_orch.orchestrator.eval_sink import EvalSink
from jaxrl_orch.orchestrator.faults import FaultLog, LoopWatchdog
from jaxrl_orch.orchestrator.gate import StalenessGate
from jaxrl_orch.orchestrator.journal import RolloutJournal
from jaxrl_orch.orchestrator.logger import PeriodicLogger
from jaxrl_orch.orchestrator.loop import Orchestrator
from jaxrl_orch.orchestrator.store import RolloutStore
from jaxrl_orch.orchestrator.train_sink import TrainSink, TrainSinkConfig
from jaxrl_orch.orchestrator.watcher import VersionSource, WeightWatcher
from jaxrl_orch.types import (
    Algorithm,
    BatchTrainer,
    Environment,
    InferencePool,
    MetricsWriter,
    PolicyHandle,
    SamplingParams,
    Source,
)


@dataclasses.dataclass(frozen=True)
class Backend:
    """The compute the loop drives but does not own: the ``pool`` rollouts sample from, the
    ``trainer`` batches are shipped to, and the weight path between them: ``version_source``,
    where the trainer's published versions appear, and ``reload_fn(version, params)``, which
    loads one into the pool (awaited if async, else run on a worker thread)."""

    pool: InferencePool
    trainer: BatchTrainer
    version_source: VersionSource
    reload_fn: Callable[[int, Any], Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the rollouts are: the train ``envs`` by name, their prompts (``source``: one, or
    one per env), the train ``sampling`` (one, or one per env) and what every eval pass runs
    (``eval_plan``; its default has no sources: no eval)."""

    envs: Mapping[str, Environment]
    source: Source | Mapping[str, Source]
    sampling: SamplingParams | Mapping[str, SamplingParams]
    eval_plan: EvalPlan = dataclasses.field(default_factory=EvalPlan)


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    """The train sink's settings the caller chooses (the loop's config sets the rest): the
    advantage ``algorithm`` (a name or an ``Algorithm``), ``dynamic_sampling`` (drop groups
    without reward variance) and ``engine_logprobs`` (the engine reports behavior
    log-probs, so a non-finite one flags its rollout)."""

    algorithm: Algorithm | str = "grpo"
    dynamic_sampling: bool = True
    engine_logprobs: bool = True


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """Where the run's numbers go: step and eval rows (``writers``), periodic gauges
    (``gauge_writers``, pulled every ``log_interval_s`` from the components and
    ``gauge_sources``), trained rollouts (``store_dir``)."""

    writers: Sequence[MetricsWriter] = ()
    gauge_writers: Sequence[MetricsWriter] = ()
    gauge_sources: Sequence[Any] = ()
    log_interval_s: float = 10.0
    store_dir: str | None = None


def build_orchestrator(
    config: OrchestratorConfig,
    policy: PolicyHandle,
    *,
    backend: Backend,
    workload: Workload,
    sink: SinkSettings = SinkSettings(),
    hooks: LoopHooks = LoopHooks(),
    telemetry: Telemetry = Telemetry(),
    clock: Callable[[], float] = time.monotonic,
) -> Orchestrator:
    """The orchestrator for ``config``, its components built from the caller's parts and wired
    (the module docstring lists the wiring); ``hooks`` are the caller's per-step callbacks."""
    gate = _gate(config, policy)
    t = telemetry
    journal = None
    if t.store_dir and config.keep_pending:
        journal = RolloutJournal(os.path.join(t.store_dir, "journal"))
    eval_plan = workload.eval_plan
    dispatcher = RolloutDispatcher(
        backend.pool,
        workload.envs,
        workload.source,
        policy,
        _dispatch_config(config, workload.sampling, eval_plan),
        gate=GateHooks(gate.capacity, gate.on_admit, gate.on_finish),
        eval_plan=eval_plan,
        clock=clock,
        on_open=None if journal is None else journal.opened,
    )
    train_sink = _train_sink(config, policy, sink, gate, dispatcher, journal)
    eval_sink = EvalSink()
    watcher = WeightWatcher(
        backend.version_source, backend.reload_fn, policy, observers=[gate], clock=clock
    )
    faults = FaultLog(os.path.join(t.store_dir, "errors.jsonl") if t.store_dir else None)
    watchdog = LoopWatchdog(config.loop_block_warn_s) if config.loop_block_warn_s else None
    gauged = [dispatcher, gate, train_sink, eval_sink, watcher, faults, *t.gauge_sources]
    gauged += [journal] if journal is not None else []
    parts = LoopComponents(
        gate=gate,
        dispatcher=dispatcher,
        train_sink=train_sink,
        eval_sink=eval_sink,
        watcher=watcher,
        logger=_logger(policy, t, clock, [*gauged, *([watchdog] if watchdog else [])]),
        store=RolloutStore(t.store_dir) if t.store_dir else None,
        faults=faults,
        watchdog=watchdog,
        journal=journal,
    )
    return Orchestrator(
        config,
        policy,
        parts,
        trainer=backend.trainer,
        writers=t.writers,
        clock=clock,
        hooks=hooks,
    )


def _gate(config: OrchestratorConfig, policy: PolicyHandle) -> StalenessGate:
    """The admission gate; a resumed run's is recovered by its rule and checks the first step."""
    gate = StalenessGate(config.max_staleness, config.batch_size, config.max_concurrent)
    if policy.version > 0:
        gate.resume(policy.version, recover=config.recover_gate_on_resume)
    return gate


def _dispatch_config(
    config: OrchestratorConfig,
    sampling: SamplingParams | Mapping[str, SamplingParams],
    eval_plan: EvalPlan,
) -> DispatchConfig:
    # Eval rollouts get permits of their own on top of the train ones the gate bounds.
    eval_slots = eval_plan.num_examples if eval_plan.sources else 0
    return DispatchConfig(
        max_inflight=config.max_concurrent + eval_slots,
        group_size=config.group_size,
        sampling=sampling,
        env_timeout_s=config.env_timeout_s,
        request_seed=config.request_seed,
    )


def _train_sink(
    config: OrchestratorConfig,
    policy: PolicyHandle,
    sink: SinkSettings,
    gate: StalenessGate,
    dispatcher: RolloutDispatcher,
    journal: RolloutJournal | None,
) -> TrainSink:
    def on_discard(n: int) -> None:
        # Slots the sink gave back may be all the dispatcher is waiting for.
        gate.on_discard(n)
        dispatcher.notify()

    settings = TrainSinkConfig(
        group_size=config.group_size,
        batch_size=config.batch_size,
        dynamic_sampling=sink.dynamic_sampling,
        engine_logprobs=sink.engine_logprobs,
        batch_order="oldest" if config.age_policy == "pace" else "arrival",
    )
    first_step = policy.version + 1
    return TrainSink(
        settings,
        sink.algorithm,
        first_step=first_step,
        on_discard=on_discard,
        on_scored=None if journal is None else journal.scored,
    )


def _logger(
    policy: PolicyHandle, telemetry: Telemetry, clock: Callable[[], float], sources: list[Any]
) -> PeriodicLogger:
    return PeriodicLogger(
        sources,
        list(telemetry.gauge_writers),
        interval_s=telemetry.log_interval_s,
        clock=clock,
        # Gauge rows carry the last trained step, so they line up with the step rows.
        step_fn=lambda: policy.version,
    )
