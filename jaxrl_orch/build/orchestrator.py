"""build_orchestrator: the orchestrator's components, built and wired in one place.

What it owns: constructing the gate, dispatcher, train and eval sinks, weight watcher, rollout
store and periodic logger from the loop's settings (``settings.OrchestratorConfig``) and the
parts the caller built (the inference pool, environments, sources, trainer, version source,
reload function, writers), and wiring them together by constructor arguments and callbacks:

- gate <- dispatcher: ``GateHooks(capacity, on_admit, on_finish)`` (train rollouts only); a
  resumed run's gate is recovered by its rule (``gate.resume``) and checks the first step;
- gate, dispatcher <- train sink: ``on_discard`` (slots of rollouts the sink drops later are
  freed, and the dispatcher is woken to use them);
- gate <- weight watcher: an observer of the shared ``PolicyHandle``;
- logger <- every component: it pulls ``gauges()``, stamped with the policy version (the last
  trained step);
- fault log (error rollouts to ``<store_dir>/errors.jsonl``) and loop watchdog -> the loop.

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
from jaxrl_orch.orchestrator.dispatcher.dispatch import (
    DispatchConfig,
    EvalPlan,
    GateHooks,
    RolloutDispatcher,
)
from jaxrl_orch.orchestrator.eval_sink import EvalSink
from jaxrl_orch.orchestrator.faults import FaultLog, LoopWatchdog
from jaxrl_orch.orchestrator.gate import StalenessGate
from jaxrl_orch.orchestrator.logger import PeriodicLogger
from jaxrl_orch.orchestrator.loop import Orchestrator
from jaxrl_orch.orchestrator.store import RolloutStore
from jaxrl_orch.orchestrator.train_sink import TrainSink
from jaxrl_orch.orchestrator.watcher import WeightWatcher
from jaxrl_orch.types import (
    Environment,
    InferencePool,
    MetricsWriter,
    PolicyHandle,
    SamplingParams,
    Source,
    Trainer,
)


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
    pool: InferencePool,
    envs: Mapping[str, Environment],
    source: Source | Mapping[str, Source],
    sampling: SamplingParams,
    trainer: Trainer,
    version_source: Any,
    reload_fn: Callable[..., Any],
    algorithm: Any = "grpo",
    eval_plan: EvalPlan | None = None,
    telemetry: Telemetry = Telemetry(),
    clock: Callable[[], float] = time.monotonic,
    on_step: Callable[[int, dict[str, Any]], Any] | None = None,
    step_metrics: Callable[[int, dict[str, float]], dict[str, float] | None] | None = None,
    sink_kwargs: Mapping[str, Any] | None = None,
) -> Orchestrator:
    cfg = config
    start_step = policy.version + 1
    gate = StalenessGate(cfg.max_staleness, cfg.batch_size, cfg.max_concurrent)
    if start_step > 1:
        gate.resume(policy.version, recover=cfg.recover_gate_on_resume)
    eval_plan = eval_plan or EvalPlan()
    eval_slots = eval_plan.num_examples if eval_plan.sources else 0
    dispatcher = RolloutDispatcher(
        pool,
        envs,
        source,
        policy,
        DispatchConfig(
            max_inflight=cfg.max_concurrent + eval_slots,
            group_size=cfg.group_size,
            sampling=sampling,
            env_timeout_s=cfg.env_timeout_s,
            request_seed=cfg.request_seed,
        ),
        gate=GateHooks(gate.capacity, gate.on_admit, gate.on_finish),
        eval_plan=eval_plan,
        clock=clock,
    )

    def on_discard(n: int) -> None:
        # Slots the sink gave back may be all the dispatcher is waiting for.
        gate.on_discard(n)
        dispatcher.notify()

    train_sink = TrainSink(
        cfg.group_size,
        cfg.batch_size,
        algorithm,
        first_step=start_step,
        auto_batch=False,
        batch_order="oldest" if cfg.age_policy == "pace" else "arrival",
        on_discard=on_discard,
        **dict(sink_kwargs or {}),
    )
    eval_sink = EvalSink()
    watcher = WeightWatcher(version_source, reload_fn, policy, observers=[gate], clock=clock)
    t = telemetry
    faults = FaultLog(os.path.join(t.store_dir, "errors.jsonl") if t.store_dir else None)
    watchdog = LoopWatchdog(cfg.loop_block_warn_s) if cfg.loop_block_warn_s else None
    sources = [dispatcher, gate, train_sink, eval_sink, watcher, faults, *t.gauge_sources]
    logger = PeriodicLogger(
        [*sources, *([watchdog] if watchdog else [])],
        list(t.gauge_writers),
        interval_s=t.log_interval_s,
        clock=clock,
        # Gauge rows carry the last trained step, so they line up with the step rows.
        step_fn=lambda: policy.version,
    )
    return Orchestrator(
        cfg,
        policy,
        gate=gate,
        dispatcher=dispatcher,
        train_sink=train_sink,
        eval_sink=eval_sink,
        watcher=watcher,
        logger=logger,
        trainer=trainer,
        store=RolloutStore(t.store_dir) if t.store_dir else None,
        writers=t.writers,
        clock=clock,
        on_step=on_step,
        step_metrics=step_metrics,
        faults=faults,
        watchdog=watchdog,
    )
