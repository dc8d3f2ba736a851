"""What the loop is handed: the components it drives and the caller's per-step callbacks.

What it owns: two frozen dataclasses, ``LoopComponents`` (the built, wired components) and
``LoopHooks`` (the callbacks of whoever runs the loop). ``build_orchestrator``
(``compose/orchestrator.py``) fills both; the loop (``loop.Orchestrator`` and the shipper, drain
and resume functions it hands them to) only reads them.

Invariants: data only (no behaviour, no state of its own); every part is built and wired before
it lands here, so nothing is attached to a component after it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxrl_orch.orchestrator.dispatcher.dispatch import RolloutDispatcher
from jaxrl_orch.orchestrator.eval_sink import EvalSink
from jaxrl_orch.orchestrator.faults import FaultLog, LoopWatchdog
from jaxrl_orch.orchestrator.gate import StalenessGate
from jaxrl_orch.orchestrator.journal import RolloutJournal
from jaxrl_orch.orchestrator.logger import PeriodicLogger
from jaxrl_orch.orchestrator.store import RolloutStore
from jaxrl_orch.orchestrator.train_sink import TrainSink
from jaxrl_orch.orchestrator.watcher import WeightWatcher


@dataclasses.dataclass(frozen=True)
class LoopComponents:
    """The components the loop drives, built and wired by ``build_orchestrator``: the gate, the
    dispatcher, both sinks, the weight watcher and the periodic logger, the rollout store (None:
    trained rollouts are not persisted), the fault log, the loop watchdog (None: off) and the
    rollout journal (None: a restart regenerates what was not trained)."""

    gate: StalenessGate
    dispatcher: RolloutDispatcher
    train_sink: TrainSink
    eval_sink: EvalSink
    watcher: WeightWatcher
    logger: PeriodicLogger
    store: RolloutStore | None = None
    faults: FaultLog = dataclasses.field(default_factory=FaultLog)
    watchdog: LoopWatchdog | None = None
    journal: RolloutJournal | None = None


@dataclasses.dataclass(frozen=True)
class LoopHooks:
    """The caller's callbacks. ``on_step(step, state)`` runs (awaited if async) right after
    batch ``step`` is shipped, with ``state()`` for a checkpoint; ``step_metrics(step, row)``
    makes each step row wait until that step is trained and adds the trainer's numbers
    (``StepLedger``); ``engine_held()`` names what holds the engine back that the loop cannot
    see (a caller's pause), or None: a stall error leads with it; ``on_landed()`` runs for each
    episode the loop takes (train or eval), before it is routed; ``on_recovered(counts, named)``
    once the loop has planned its start from the rollout journal (``recovery.Recovery.summary``
    and the lines it could not trust); ``before_close(finished)`` (awaited if async) once the
    loop has stopped, before its writers close (``finished``: its main loop returned rather than
    raised): the caller's work that still writes rows ends there."""

    on_step: Callable[[int, dict[str, Any]], Any] | None = None
    step_metrics: Callable[[int, dict[str, float]], dict[str, float] | None] | None = None
    engine_held: Callable[[], str | None] | None = None
    on_landed: Callable[[], None] | None = None
    on_recovered: Callable[[dict[str, int], list[str]], None] | None = None
    before_close: Callable[[bool], Any] | None = None
