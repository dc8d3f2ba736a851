"""The weight path's trainer-thread hops (``compose.weights``): ``WeightPath.on_publish`` in its
order of safety with recording stand-ins, and ``StepTimes``' row of a step from numbers chosen
here (every expected value is worked out by hand in the test, not by the code)."""

from __future__ import annotations

import pytest

from jaxrl_orch.compose import weights
from jaxrl_orch.compose.weights import StepTimes, WeightPath


class Clock:
    """``time.perf_counter`` for ``compose.weights``: moves only when a stand-in says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class RecordingSide:
    """The engine side's ``move``: takes ``move_s`` on the clock and sets ``bytes_moved`` to
    1000 times the version it moved."""

    def __init__(self, log: list, clock: Clock, move_s: float) -> None:
        self.log, self.clock, self.move_s = log, clock, move_s
        self.bytes_moved = 0

    def move(self, params):
        self.log.append(("move", params["version"]))
        self.clock.t += self.move_s
        self.bytes_moved = 1000 * params["version"]
        return {"moved": params["version"]}


class RecordingTimes:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, version, metrics, transfer_s, nbytes=0):
        self.log.append(("record", version, metrics, transfer_s, nbytes))


class RecordingPublisher:
    def __init__(self, log: list) -> None:
        self.log = log

    def publish(self, version, params):
        self.log.append(("publish", version, params))


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(weights.time, "perf_counter", c)
    return c


def test_on_publish_moves_records_checkpoints_when_due_then_publishes(clock):
    log: list = []
    path = WeightPath(
        RecordingSide(log, clock, move_s=0.25),
        RecordingTimes(log),
        RecordingPublisher(log),
        lambda v: log.append(("checkpoint", v)),
        checkpoint_every=2,
        last_step=4,
        on_trained=lambda: log.append(("trained",)),
    )
    for v in (1, 2, 3, 4):
        path.on_publish(v, {"version": v}, {"loss": float(v)})

    def step(v: int, checkpoint: bool) -> list:
        # the move's bytes and its 0.25 s reach the step's numbers, before anyone sees v
        hops = [("trained",), ("move", v), ("record", v, {"loss": float(v)}, 0.25, 1000 * v)]
        return hops + [("checkpoint", v)] * checkpoint + [("publish", v, {"moved": v})]

    # Version 2 is due (2 % 2 == 0, before the last step); version 4 is due too but is the last
    # step, which the stage saves after its drain, with the final state: not here.
    assert log == step(1, False) + step(2, True) + step(3, False) + step(4, False)


def test_a_checkpoint_every_step_still_skips_the_last_one(clock):
    log: list = []
    path = WeightPath(
        RecordingSide(log, clock, move_s=0.0),
        RecordingTimes(log),
        RecordingPublisher(log),
        lambda v: log.append(("checkpoint", v)),
        checkpoint_every=1,
        last_step=3,
    )
    for v in (1, 2, 3):
        path.on_publish(v, {"version": v}, {})
    assert [e[1] for e in log if e[0] == "checkpoint"] == [1, 2]


@pytest.mark.parametrize(
    ("synchronous", "idle_1", "idle_2"),
    [
        # Synchronous: generation and training take turns, so busy = generate + train.
        # step 1: 8.0 - (3.0 + 2.0) - 0.25 = 2.75; step 2: 8.0 - (4.5 + 1.0) - 0.5 = 2.0
        (True, 2.75, 2.0),
        # Overlapped: assumed to run at once, so busy = max(generate, train).
        # step 1: 8.0 - max(3.0, 2.0) - 0.25 = 4.75; step 2: 8.0 - max(4.5, 1.0) - 0.5 = 3.0
        (False, 4.75, 3.0),
    ],
)
def test_step_metrics_carry_the_trainers_numbers_and_the_phase_times(synchronous, idle_1, idle_2):
    engine = iter([3.0, 7.5])
    times = StepTimes(lambda: next(engine), synchronous=synchronous)
    times.on_ship(1, {})
    times.on_ship(2, {})
    assert times.step_metrics(1, {"orch/step_s": 8.0}) is None  # shipped, not trained yet
    times.record(1, {"step_s": 2.0, "loss": 0.5}, transfer_s=0.25, nbytes=4096)
    times.record(2, {"step_s": 1.0, "loss": 0.25}, transfer_s=0.5, nbytes=2048)

    assert times.step_metrics(1, {"orch/step_s": 8.0}) == {
        "trainer/step_s": 2.0,
        "trainer/loss": 0.5,
        "time/train_s": 2.0,
        "time/transfer_s": 0.25,
        "transfer/bytes": 4096.0,
        "time/generate_s": 3.0,  # the engine's 3.0 s before ship 1
        "time/idle_s": idle_1,
    }
    assert times.step_metrics(2, {"orch/step_s": 8.0}) == {
        "trainer/step_s": 1.0,
        "trainer/loss": 0.25,
        "time/train_s": 1.0,
        "time/transfer_s": 0.5,
        "transfer/bytes": 2048.0,
        "time/generate_s": 4.5,  # 7.5 - 3.0: only what it did between ship 1 and ship 2
        "time/idle_s": idle_2,
    }
    # Each step's numbers go out once: the row of step 1 is not written twice.
    assert times.step_metrics(1, {"orch/step_s": 8.0}) is None


def test_idle_time_is_never_negative():
    times = StepTimes(lambda: 6.0, synchronous=True)
    times.on_ship(1, {})
    times.record(1, {"step_s": 3.0}, transfer_s=0.5)
    # 6.0 generating + 3.0 training + 0.5 moving in a 4.0 s step: they overlapped after all.
    assert times.step_metrics(1, {"orch/step_s": 4.0})["time/idle_s"] == 0.0
