"""OverlapSchedule: the probe picks the faster of overlapped / time-sliced from measured step
periods, pauses the engine only during train steps when sliced, and the driver honours it."""

from __future__ import annotations

import threading

import pytest
from support.toy_engine import ToyEngine

from jaxrl_orch.compose.overlap import OverlapSchedule
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.types import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_steps(schedule: OverlapSchedule, clock: Clock, period: dict[str, float], n: int):
    """``n`` train steps; each step period lasts ``period[mode]`` of the mode it ran in.
    Returns whether the engine could run during each step."""
    allowed = []
    for _ in range(n):
        mode = schedule.mode
        with schedule.training():
            allowed.append(schedule.engine_may_run.is_set())
        assert schedule.engine_may_run.is_set()  # always released after the step
        clock.t += period[mode]
    return allowed


@pytest.mark.parametrize("over,sliced,want", [(3.0, 2.0, "sliced"), (2.0, 3.0, "overlapped")])
def test_auto_keeps_the_faster_schedule(over, sliced, want):
    clock, lines = Clock(), []
    s = OverlapSchedule("auto", probe=2, settle=1, announce=lines.append, clock=clock)
    allowed = run_steps(s, clock, {"overlapped": over, "sliced": sliced}, 12)
    assert s.decision == {
        "mode": want,
        "overlapped_step_s": over,
        "sliced_step_s": sliced,
        "steps_probed": 6,
    }
    # settle 1 + 2 overlapped periods, then sliced steps (the straddling one skipped) ...
    assert allowed[:3] == [True, True, True] and allowed[3:6] == [False, False, False]
    # ... then the decision for the rest of the run
    assert allowed[7:] == [want == "overlapped"] * 5
    assert len(lines) == 1 and ("pauses" in lines[0]) == (want == "sliced")


def test_fixed_modes_never_probe():
    clock = Clock()
    s = OverlapSchedule("sliced", clock=clock)
    assert run_steps(s, clock, {"sliced": 1.0}, 4) == [False] * 4
    o = OverlapSchedule("overlapped", clock=clock)
    assert run_steps(o, clock, {"overlapped": 1.0}, 4) == [True] * 4
    assert s.decision == {"mode": "sliced"} and o.decision == {"mode": "overlapped"}


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="overlap must be one of .*'sometimes'"):
        OverlapSchedule("sometimes")


def test_driver_decodes_only_while_the_gate_is_open():
    gate = threading.Event()
    driver = InferenceDriver(ToyEngine(), 0, 0, gate=gate)
    driver.start()
    try:
        (fut,) = driver.submit([3, 4], SamplingParams(temperature=0.0, max_tokens=5))
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.5)  # paused: a train step holds the cores
        gate.set()
        assert fut.result(timeout=10).token_ids == [5, 6, 7, 8, 9]
    finally:
        driver.stop()  # stops even if paused


def test_a_paused_driver_still_stops():
    driver = InferenceDriver(ToyEngine(), 0, 0, gate=threading.Event())
    driver.start()
    driver.submit([3, 4], SamplingParams(temperature=0.0, max_tokens=5))
    driver.stop()
    assert driver._thread is None or not driver._thread.is_alive()
