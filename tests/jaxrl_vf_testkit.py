"""A verifiers 0.4 taskset for the adapter's tests (taskset id ``jaxrl-vf-testkit``).

A top-level module because verifiers imports a taskset by the module name its id gives
(``tests/`` is on the path of the tests and of the train commands they start). Each task has a
``mode`` and a number of model ``turns`` (the environment says "Again." between them):

- ``ok``: plays its turns; the reward is the length of the last answer modulo 3 (a spread);
- ``raise_reward``: the reward function raises;
- ``nan``: the reward is NaN;
- ``exit_1``: the harness exits 1 before any model call;
- ``hang``: the harness waits forever (until cancelled or timed out).

``MarkedEnv`` is the environment class (exported, so verifiers picks it for this taskset): its
``stop`` writes ``closed`` to the file named by ``JAXRL_VF_STOP_MARKER``, which is how a test sees
that the serving context was closed in another process.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from pathlib import Path

import verifiers.v1 as vf
from verifiers.v1.types import content_text

from jaxrl_orch.examples.vf_chat import ChatHarness

MODES = ("ok", "raise_reward", "nan", "exit_1", "hang")


class KitData(vf.TaskData):
    mode: str = "ok"
    turns: int = 1


class KitConfig(vf.TasksetConfig):
    modes: list[str] = ["ok"]
    turns: int = 1
    repeat: int = 8


class KitTask(vf.Task[KitData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def answer_length(self, trace) -> float:
        if self.data.mode == "raise_reward":
            raise RuntimeError("reward function crashed on purpose")
        if self.data.mode == "nan":
            return math.nan
        return float(len(content_text(trace.last_message.content)) % 3)

    @vf.metric
    async def turns_played(self, trace) -> float:
        return float(len(trace.calls))


class KitTaskset(vf.Taskset[KitTask, KitConfig]):
    def load(self) -> Iterator[KitTask]:
        cfg = self.config
        for r in range(cfg.repeat):
            for mode in cfg.modes:
                data = KitData(
                    name=f"{mode}-{r}", prompt=f"Say something, {r}.", mode=mode, turns=cfg.turns
                )
                yield KitTask(data, cfg.task)


class KitHarness(ChatHarness):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
        if data.mode == "exit_1":
            return vf.ProgramResult(exit_code=1, stdout="", stderr="harness crashed on purpose")
        if data.mode == "hang":
            await asyncio.Event().wait()
        return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw)

    def follow_up(self, data, reply, turn):
        return [{"role": "user", "content": "Again."}] if turn + 1 < data.turns else []


class MarkedEnv(vf.SingleAgentEnv):
    async def stop(self) -> None:
        marker = os.environ.get("JAXRL_VF_STOP_MARKER")
        if marker:
            Path(marker).write_text("closed")
        await super().stop()


__all__ = ["KitHarness", "KitTaskset", "MarkedEnv"]
