"""``python -m support.group_abort_worker K PORT OUT``: process K of a 2-process trainer group
in which the leader fails after one step. The leader sends one TRAIN, then ``Channel.abort``
with its error; the peer runs the real ``compose.peer.follow`` (a stand-in trainer, checkpointer
and staging: only the command loop is under test) and must leave it with ``GroupAborted``
naming the leader's error. Each writes ``OUT/K.json``; both then shut jax.distributed down."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_orch.compose.peer import follow  # noqa: E402
from jaxrl_orch.distributed.group import (  # noqa: E402
    TRAIN,
    Channel,
    GroupAborted,
    join_group,
    resolve_role,
)
from support.group_standins import StandinStaging, StandinTrainer  # noqa: E402

REASON = "EmptyBatchError: 81 groups in a row contributed nothing trainable"


k, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
role = join_group(resolve_role(2, 1, k), f"127.0.0.1:{port}")
result: dict = {}
if role.leader:
    Channel(leader=True).send(TRAIN, {}, {"tokens": np.arange(6, dtype=np.int32)})
    result["taken"] = Channel(leader=True).abort(REASON, timeout_s=60)
else:
    trainer = StandinTrainer()
    try:
        follow(trainer, None, StandinStaging())
        result["error"] = None
    except GroupAborted as exc:
        result["error"] = str(exc)
    result["batches"] = trainer.batches
with open(os.path.join(out, f"{k}.json"), "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
