"""The process layout (``group.resolve_role``), and a real 2-process trainer group: the
leader's commands reach the peer intact, every process stages the params in a replica's
layout on its own devices (``group.EngineStager``), and a leader that fails takes its peer
out of the command loop with its error (``Channel.abort``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.checkout import helper_cmd, subprocess_env

from jaxrl_orch.distributed.group import resolve_role
from jaxrl_orch.distributed.launch_local import free_ports


def test_layout_gives_each_index_its_role():
    assert resolve_role(1, 0, None).kind == "single"
    roles = [resolve_role(2, 2, k) for k in range(4)]
    assert [r.kind for r in roles] == ["trainer", "trainer", "engine", "engine"]
    assert [r.leader for r in roles] == [True, False, False, False]
    assert [r.replica for r in roles[2:]] == [0, 1]
    assert "leader" in roles[0].describe() and "replica 1 of 2" in roles[3].describe()
    # A trainer on a TPU slice may leave its index to jax.distributed.
    assert resolve_role(4, 1, None).kind == "trainer"


@pytest.mark.parametrize(
    ("p", "r", "k", "match"),
    [
        (1, 0, 3, r"--process_index=3, but the config runs one process"),
        (2, 0, 0, r"trainer_processes=2 with engine_replicas=0"),
        (1, 2, None, r"give each its --process_index \(0: the trainer, 1..2"),
        (2, 2, 4, r"--process_index=4 is outside the layout: 0..1 train, 2..3 serve"),
        (2, 2, -2, r"outside the layout"),
    ],
)
def test_layout_errors_name_the_index_and_the_layout(p, r, k, match):
    with pytest.raises(ValueError, match=match):
        resolve_role(p, r, k)


def _run_group(worker: str, out: Path) -> None:
    """Both processes of a 2-process group running ``support.<worker>``; both must exit 0."""
    port = free_ports(1)[0]
    procs = [
        subprocess.Popen(
            helper_cmd(worker, str(k), str(port), str(out)),
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in range(2)
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=100)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the group's processes did not finish")
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_process_group_channel_and_stage(tmp_path: Path):
    _run_group("group_worker", tmp_path)
    lead, peer = (np.load(tmp_path / f"{k}.npz") for k in range(2))
    # jax.distributed's coordinator binds the address it was given (loopback), not 0.0.0.0.
    assert json.loads(str(lead["coordinator"])) == ["127.0.0.1"]
    np.testing.assert_array_equal(peer["tokens"], np.arange(24).reshape(4, 6))
    assert peer["tokens"].dtype == np.int32
    np.testing.assert_array_equal(peer["adv"], np.full((4, 6), 0.5))
    assert json.loads(str(peer["body"])) == {"step": 3, "state": {"cursor": [1, 2], "name": "é"}}
    # Each process holds the whole tree (in bf16, exact for these small integers) on its own
    # devices, in the layout a replica pulls.
    for out in (lead, peer):
        np.testing.assert_array_equal(out["w"], np.arange(48, dtype=np.float32).reshape(8, 6))
        np.testing.assert_array_equal(out["b"], np.arange(6, dtype=np.float32))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failed_leader_takes_its_peer_out_of_the_command_loop(tmp_path: Path):
    # Without ABORT the peer waits in a collective for a leader that left; jax.distributed's
    # shutdown barrier then holds the leader for minutes and the peer ends on SIGABRT.
    _run_group("group_abort_worker", tmp_path)
    lead, peer = (json.loads((tmp_path / f"{k}.json").read_text()) for k in range(2))
    assert lead == {"taken": True}
    assert peer["batches"] == [[0, 1, 2, 3, 4, 5]]  # the step before the failure was followed
    assert peer["error"] == (
        "trainer process 0 stopped the run: "
        "EmptyBatchError: 81 groups in a row contributed nothing trainable"
    )
