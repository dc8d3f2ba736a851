"""A trainer group's peer (``compose.peer.follow``) in this process: the leader's commands come
from a scripted channel, the trainer and staging are stand-ins (``support.group_standins``), and
the checkpoint writer and the final gather are recorded. What is under test is the command loop:
what the peer does for TRAIN, CHECKPOINT, STOP and ABORT, and in which order. (The same loop
between two real processes: ``tests/distributed/test_group.py``, slow.)"""

from __future__ import annotations

import types

import numpy as np
import pytest
from support.group_standins import StandinStaging, StandinTrainer

from jaxrl_orch.compose import peer
from jaxrl_orch.distributed.group import ABORT, CHECKPOINT, STOP, TRAIN, GroupAborted

NAMES = {TRAIN: "TRAIN", CHECKPOINT: "CHECKPOINT", STOP: "STOP", ABORT: "ABORT"}


class ScriptedChannel:
    """The peer's end of the group's channel: ``receive`` hands out the leader's commands in
    order; reading past them fails the test instead of waiting in a collective."""

    def __init__(self, script: list, log: list) -> None:
        self.script, self.log = list(script), log

    def receive(self):
        if not self.script:
            raise AssertionError("the peer read past the leader's last command")
        cmd, body, arrays = self.script.pop(0)
        self.log.append(("receive", NAMES[cmd]))
        return cmd, body, arrays


class RecordingCheckpointer:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append(("checkpoint written",))


def _follow_script(monkeypatch, script: list, trainer: StandinTrainer, log: list):
    """Run ``follow`` against ``script``; returns its result and the channels it opened."""
    opened = []

    def channel(leader: bool) -> ScriptedChannel:
        opened.append(leader)
        return ScriptedChannel(script, log)

    def save_trainer(ckpt, trainer, step, state, **kwargs):
        log.append(("save", step, state, trainer.version))

    def process_allgather(tree, tiled=False):
        log.append(("gather", tree, tiled))
        return tree

    monkeypatch.setattr(peer, "Channel", channel)
    monkeypatch.setattr(peer, "save_trainer", save_trainer)
    monkeypatch.setattr(peer, "final_policy", lambda t: {"policy of version": t.version})
    monkeypatch.setattr(
        peer, "multihost_utils", types.SimpleNamespace(process_allgather=process_allgather)
    )
    result = peer.follow(trainer, RecordingCheckpointer(log), StandinStaging(log))
    return result, opened


def _batch(first: int) -> dict:
    return {"tokens": np.arange(first, first + 4, dtype=np.int32)}


def test_a_peer_follows_two_steps_checkpoints_at_the_leaders_step_and_gathers_on_stop(
    monkeypatch,
):
    log: list = []
    # A resumed run: the peer restored version 5, so its version is not the steps it takes
    # here. The leader names step 9 (in a real group the two agree; here they differ, so a
    # checkpoint at the peer's own count would show).
    trainer = StandinTrainer(version=5, log=log)
    state = {"cursor": [3, 1], "name": "é"}
    script = [
        (TRAIN, {}, _batch(0)),
        (TRAIN, {}, _batch(10)),
        (CHECKPOINT, {"step": 9, "state": state}, {}),
        (STOP, {}, {}),
    ]
    result, opened = _follow_script(monkeypatch, script, trainer, log)

    assert opened == [False]  # a peer's end of the channel: it never sends
    assert trainer.batches == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert log == [
        ("stage first", 5),  # what the replicas load first, before any command
        ("receive", "TRAIN"),
        ("train", 6),
        ("stage", 6),  # every process stages each version, in lockstep with the leader
        ("receive", "TRAIN"),
        ("train", 7),
        ("stage", 7),
        ("receive", "CHECKPOINT"),
        ("save", 9, state, 7),  # the leader's step and state, written before the next command
        ("checkpoint written",),
        ("receive", "STOP"),
        ("gather", {"policy of version": 7}, True),  # the final policy, a collective
    ]
    assert result == {"role": "trainer process 0", "steps": 2}  # steps taken here, not version


def test_abort_raises_with_the_leaders_reason_after_the_steps_before_it(monkeypatch):
    log: list = []
    trainer = StandinTrainer(log=log)
    reason = "EmptyBatchError: 81 groups in a row contributed nothing trainable"
    script = [(TRAIN, {}, _batch(0)), (ABORT, {"reason": reason}, {})]
    with pytest.raises(GroupAborted) as err:
        _follow_script(monkeypatch, script, trainer, log)
    assert str(err.value) == f"trainer process 0 stopped the run: {reason}"
    assert trainer.batches == [[0, 1, 2, 3]]
    # Nothing after the ABORT: no checkpoint, no gather (the leader is gone).
    assert log[-1] == ("receive", "ABORT") and not any(e[0] in ("save", "gather") for e in log)
