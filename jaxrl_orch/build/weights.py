"""WeightPath: how a trained version gets from the trainer into the engine, and onto disk.

What it owns, per trained version ``v``: the move of the trainer's params to the engine (a
reshard onto the decode mesh in one process, ``in_process``; with engine replicas, the trainer
group's stage into a replica's layout, which replicas then pull), the publish that the
orchestrator's weight watcher observes, the swap into the engine(s) between two decode steps,
the periodic checkpoint, and the step's row of trainer diagnostics and phase times
(``step_metrics``) that the orchestrator merges into step ``v``'s one ``metrics.jsonl`` row.

Thread contract
    ``on_publish(v, params)`` runs on the trainer's worker thread, right after step ``v`` and
    before step ``v + 1``: the params it receives are donated by the next step, so the reshard
    (a device-to-device copy onto the decode mesh's shardings) finishes before it returns, and
    so does a due checkpoint (the trainer is idle between two steps; the orchestrator's state is
    fetched from the event loop with ``run_coroutine_threadsafe``). The row of ``v`` is
    recorded before ``v`` is published, so it is complete once the loop sees the version.
    ``swap(v, params)`` runs on the event loop (the watcher's reload): it hands the params to
    the inference driver, whose thread switches between two ``generate`` calls (or has every
    replica pull them, ``remote.pool``), and awaits that. ``on_ship(step)`` and
    ``step_metrics(step, row)`` run on the event loop (the orchestrator's callbacks).

Never: reshards on the event loop, or lets a step's row carry another step's numbers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import jax

from jaxrl_orch.orchestrator.watcher import InProcessPublisher
from sharding.reshard import reshard


class WeightPath:
    def __init__(
        self,
        trainer: Any,
        move: Callable[[Any], Any],
        swap: Callable[[int, Any], Awaitable[None]],
        engine_seconds: Callable[[], float],
        *,
        checkpoint_every: int,
        last_step: int,
        checkpoint: Callable[[int], None],
        synchronous: bool,
    ) -> None:
        self.trainer, self._move, self._swap = trainer, move, swap
        self._engine_seconds = engine_seconds  # prefill + decode time so far, all replicas
        self.publisher = InProcessPublisher()
        self.checkpoint_every, self.last_step = checkpoint_every, last_step
        self._checkpoint = checkpoint
        self._synchronous = synchronous  # S = 0: generation and training never overlap
        self._trained: dict[int, dict[str, float]] = {}
        self._generated: dict[int, float] = {}
        self._gen_total = 0.0
        trainer.add_publisher(self.on_publish)

    @classmethod
    def in_process(cls, trainer: Any, driver: Any, shardings: Any, dtype: Any, **kw: Any):
        """The engine in this process: reshard onto its mesh (casting to ``dtype`` on the
        trainer's devices first), swap into ``driver`` between two decode steps."""

        def move(params: Any) -> Any:
            return jax.block_until_ready(reshard(params, shardings, dtype=dtype))

        async def swap(version: int, params: Any) -> None:
            await asyncio.wrap_future(driver.swap_params(params, version))

        def engine_seconds() -> float:
            g = driver.gauges()
            return g["inference/prefill_s"] + g["inference/decode_s"]

        return cls(trainer, move, swap, engine_seconds, **kw)

    # ------------------------------------------------------------------ trainer thread

    def on_publish(self, version: int, params: Any) -> None:
        t0 = time.perf_counter()
        moved = self._move(params)
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
        await self._swap(version, params)

    def on_ship(self, step: int, _state: dict[str, Any]) -> None:
        """Engine time since the previous ship: the generation behind batch ``step``."""
        total = self._engine_seconds()
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
