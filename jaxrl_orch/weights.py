"""WeightPath: how a trained version gets from the trainer into the engine, and onto disk.

What it owns, per trained version ``v``: the reshard of the trainer's params onto the decode
mesh, the publish that the orchestrator's weight watcher observes, the swap into the engine
between two decode steps, the periodic checkpoint, and the step's row of trainer diagnostics
and phase times (``step_metrics``) that the orchestrator merges into step ``v``'s one
``metrics.jsonl`` row.

Thread contract
    ``on_publish(v, params)`` runs on the trainer's worker thread, right after step ``v`` and
    before step ``v + 1``: the params it receives are donated by the next step, so the reshard
    (a device-to-device copy onto the decode mesh's shardings) finishes before it returns, and
    so does a due checkpoint (the trainer is idle between two steps; the orchestrator's state is
    fetched from the event loop with ``run_coroutine_threadsafe``). The row of ``v`` is
    recorded before ``v`` is published, so it is complete once the loop sees the version.
    ``swap(v, params)`` runs on the event loop (the watcher's reload): it hands the params to
    the inference driver, whose thread switches between two ``generate`` calls, and awaits
    that. ``on_ship(step)`` and ``step_metrics(step, row)`` run on the event loop (the
    orchestrator's callbacks).

Never: reshards on the event loop, or lets a step's row carry another step's numbers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_orch.orchestrator.watcher import InProcessPublisher
from sharding.reshard import reshard


class WeightPath:
    def __init__(
        self,
        trainer: Any,
        driver: Any,
        shardings: Any,
        *,
        dtype: Any = None,
        checkpoint_every: int,
        last_step: int,
        checkpoint: Callable[[int], None],
        synchronous: bool,
    ) -> None:
        self.trainer, self.driver, self.shardings = trainer, driver, shardings
        self.dtype = dtype  # the engine's weight dtype: cast on the trainer's devices, then move
        self.publisher = InProcessPublisher()
        self.checkpoint_every, self.last_step = checkpoint_every, last_step
        self._checkpoint = checkpoint
        self._synchronous = synchronous  # S = 0: generation and training never overlap
        self._trained: dict[int, dict[str, float]] = {}
        self._generated: dict[int, float] = {}
        self._gen_total = 0.0
        trainer.add_publisher(self.on_publish)

    # ------------------------------------------------------------------ trainer thread

    def on_publish(self, version: int, params: Any) -> None:
        t0 = time.perf_counter()
        moved = jax.block_until_ready(reshard(params, self.shardings, dtype=self.dtype))
        row = {f"trainer/{k}": v for k, v in self.trainer.last_step_metrics.items()}
        row["time/train_s"] = row.get("trainer/step_s", 0.0)
        row["time/transfer_s"] = time.perf_counter() - t0
        self._trained[version] = row
        self.publisher.publish(version, moved)
        # The final version is saved after the drain, with the orchestrator's final state.
        if version % self.checkpoint_every == 0 and version < self.last_step:
            self._checkpoint(version)

    # ------------------------------------------------------------------ event loop

    async def swap(self, version: int, params: Any) -> None:
        await asyncio.wrap_future(self.driver.swap_params(params, version))

    def on_ship(self, step: int, _state: dict[str, Any]) -> None:
        """Engine time since the previous ship: the generation behind batch ``step``."""
        g = self.driver.gauges()
        total = g["inference/prefill_s"] + g["inference/decode_s"]
        self._generated[step] = total - self._gen_total
        self._gen_total = total

    def step_metrics(self, step: int, row: dict[str, float]) -> dict[str, float] | None:
        """Step ``step``'s trainer diagnostics and phase times, once it is trained."""
        if step not in self._trained:
            return None
        m = self._trained.pop(step)
        m["time/generate_s"] = gen_s = self._generated.pop(step, 0.0)
        train_s, xfer_s = m["time/train_s"], m["time/transfer_s"]
        # Only totals are known, not their overlap: synchronous runs never overlap generation
        # and training, asynchronous ones are assumed to overlap fully.
        busy = gen_s + train_s if self._synchronous else max(gen_s, train_s)
        m["time/idle_s"] = max(0.0, row.get("orch/step_s", 0.0) - busy - xfer_s)
        return m
