"""RolloutStore: the rollouts each optimizer step actually trained on, persisted as JSONL.

What it owns: one file per train step, ``<path>/step_<step:08d>.jsonl``, one JSON object per
rollout with exactly the facts the trainer consumed: ids (``env``, ``group_id``,
``episode_id``), the token trace (``token_ids``, ``loss_mask``, ``logprobs``, ``versions``),
``temperature``, ``reward``, ``advantage``, ``off_policy_steps``, ``head_version``,
``live_policy``, ``slot`` (the group's ordinal in the data order and the index in it), and
``branches`` (each further path's token trace) when the trace branches. Enough to audit or
replay a step without re-tokenizing anything.

Who drives it: the loop's shipper (``shipping.BatchShipper``, when it ships): after the batch's
off-policy ages are stamped and *before* the batch ships, ``write(step, rollouts)`` with the
cohort the train sink trained on. ``write`` blocks on ``fsync``; from the event loop use
``await write_async(...)`` (a worker thread).

Invariants:
- Durable and atomic per step (``paths.write_atomic``): locally the file is written to a
  temporary name, fsynced, renamed into place and the directory fsynced; on ``gs://`` it is one
  object write. A crash leaves either the old file or the new one, never a torn one.
  Rewriting a step (a resumed run re-training it) replaces the file.
- Nothing non-finite is written (``allow_nan=False``): a NaN here means a bug upstream, and the
  write raises naming the step and rollout rather than persisting an unreadable value. The
  one exception is a behaviour log-prob an engine did not report (NaN by contract, the
  trainer recomputes it): it is written as ``null``.
- ``read(step)`` returns exactly what was written, in order.

It never imports another orchestrator component and never writes metrics itself.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from etils import epath

from jaxrl_orch.paths import as_path, write_atomic
from jaxrl_orch.types import Branch, Rollout

_STEP_FILE = re.compile(r"^step_(\d{8,})\.jsonl$")


def rollout_record(rollout: Rollout) -> dict[str, Any]:
    """The persisted form of one trained rollout (plain JSON types only)."""
    rollout.validate_trace()
    record = {
        "env": rollout.env,
        "group_id": int(rollout.group_id),
        "episode_id": int(rollout.episode_id),
        **_path_record(rollout),
        "temperature": float(rollout.temperature),
        "reward": float(rollout.reward),
        "advantage": None if rollout.advantage is None else float(rollout.advantage),
        "off_policy_steps": rollout.off_policy_steps,
        "head_version": int(rollout.head_version),
        "live_policy": bool(rollout.live_policy),
        # (group ordinal in the data order, index in the group): the same across restarts
        "slot": None if rollout.slot is None else [int(x) for x in rollout.slot],
    }
    if rollout.branches:
        record["branches"] = [_path_record(b) for b in rollout.branches]
    return record


def _path_record(path: Rollout | Branch) -> dict[str, Any]:
    return {
        "token_ids": [int(t) for t in path.token_ids],
        "loss_mask": [bool(m) for m in path.loss_mask],
        # null where the engine reported no log-prob (the trainer recomputed it)
        "logprobs": [float(x) if math.isfinite(x) else None for x in path.logprobs],
        "versions": [int(v) for v in path.versions],
    }


class RolloutStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = as_path(path)  # a local directory or a gs:// prefix
        self.path.mkdir(parents=True, exist_ok=True)
        self._steps = 0
        self._rollouts = 0
        self._bytes = 0

    def start(self) -> None:
        """No background work; writes are synchronous. Kept for the component contract."""

    def stop(self) -> None:
        """Nothing buffered: every ``write`` is durable when it returns."""

    def file_for(self, step: int) -> epath.Path:
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step!r}")
        return self.path / f"step_{int(step):08d}.jsonl"

    def write(self, step: int, rollouts: Sequence[Rollout]) -> epath.Path:
        """Persist the rollouts trained on at ``step``; durable when this returns."""
        lines = []
        for i, r in enumerate(rollouts):
            try:
                lines.append(json.dumps(rollout_record(r), allow_nan=False, separators=(",", ":")))
            except ValueError as exc:
                raise ValueError(
                    f"cannot persist rollout {i} (env={r.env!r}, group_id={r.group_id}, "
                    f"episode_id={r.episode_id}) of step {step}: {exc}"
                ) from exc
        data = ("\n".join(lines) + "\n" if lines else "").encode()
        final = self.file_for(step)
        write_atomic(final, data)
        self._steps += 1
        self._rollouts += len(lines)
        self._bytes += len(data)
        return final

    async def write_async(self, step: int, rollouts: Sequence[Rollout]) -> epath.Path:
        """``write`` on a worker thread, so the fsync does not stall the event loop."""
        return await asyncio.to_thread(self.write, step, list(rollouts))

    def read(self, step: int) -> list[dict[str, Any]]:
        """The records written for ``step``, in write order."""
        f = self.file_for(step)
        if not f.exists():
            raise ValueError(
                f"no rollouts stored for step {step} in {self.path}; stored steps: {self.steps()}"
            )
        return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]

    def steps(self) -> list[int]:
        """Steps with a stored file, ascending."""
        found = (_STEP_FILE.match(p.name) for p in self.path.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def gauges(self) -> dict[str, float]:
        return {
            "store/steps_written": float(self._steps),
            "store/rollouts_written": float(self._rollouts),
            "store/bytes_written": float(self._bytes),
        }
