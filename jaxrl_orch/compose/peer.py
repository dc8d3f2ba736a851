"""A trainer group's peer in the RL stage: trainer processes 1..P-1.

What it owns: ``follow``: take every step, stage and checkpoint the leader takes, in lockstep,
until the leader's STOP (the run ended: gather the final policy with it) or ABORT (it failed:
this process fails too, with the leader's reason). Checkpoints in a group are collective (orbax
writes each process's shards): the leader sends CHECKPOINT with the orchestrator's state, then
every process saves the same step.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import multihost_utils

from jaxrl_orch.compose.staging import GroupStaging, final_policy
from jaxrl_orch.distributed.group import ABORT, CHECKPOINT, STOP, TRAIN, Channel, GroupAborted
from jaxrl_orch.trainer.checkpoint import Checkpointer, save_trainer
from jaxrl_orch.trainer.trainer import Trainer


def follow(trainer: Trainer, ckpt: Checkpointer, staging: GroupStaging) -> dict[str, Any]:
    """A peer's RL stage: take every step, stage and checkpoint the leader takes, until STOP
    (or ABORT: the leader failed, and this process fails with its reason). ``staging``: what
    every process of the group stages for the replicas (``GroupStaging.of``)."""
    channel = Channel(leader=False)
    staging.first(trainer)  # what the replicas load first
    steps = 0
    while True:
        cmd, body, arrays = channel.receive()
        if cmd == TRAIN:
            trainer.follow(arrays)
            steps += 1
            staging.version(trainer.params)
        elif cmd == CHECKPOINT:
            save_trainer(ckpt, trainer, int(body["step"]), body["state"])
            ckpt.wait()
        elif cmd == STOP:
            multihost_utils.process_allgather(final_policy(trainer), tiled=True)
            return {"role": f"trainer process {jax.process_index()}", "steps": steps}
        elif cmd == ABORT:
            raise GroupAborted(f"trainer process 0 stopped the run: {body['reason']}")
