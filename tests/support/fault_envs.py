"""``python -m support.fault_envs <train args>`` (``tests/`` on ``PYTHONPATH``): the train command
with a faulty user environment.

The environment is the bundled reverse-text task with faults scheduled by episode id (so every
run meets them at the same points), chosen by ``JAXRL_TEST_FAULTS``:

- ``mixed``: every 23rd rollout hangs forever (an unanswered tool call), every 17th raises, one
  ``score`` call in 19 returns NaN, and the 10th ``score`` call blocks the event loop for 1.5 s
  (``time.sleep``) once;
- ``hang``: every 11th rollout hangs forever, nothing else;
- ``thread_hang``: every 13th rollout's grader blocks forever in a worker thread
  (``asyncio.to_thread``: a blocking tool call that never returns), nothing else.

It is registered under ``Data.env = 'faulty_reverse_text'`` the way a user registers
theirs (``register_env``), then ``jaxrl_orch.train.cli`` runs as ``python -m jaxrl_orch.train``
does.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

from jaxrl_orch.envs.base import register_env
from jaxrl_orch.envs.reverse_text import ReverseTextEnv

MODE = os.environ.get("JAXRL_TEST_FAULTS", "mixed")


class FaultyReverseText(ReverseTextEnv):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scored = 0

    async def run(self, client, example, *, episode_id, **kw):
        if MODE == "thread_hang" and episode_id % 13 == 4:
            await asyncio.to_thread(threading.Event().wait)
        hang_every = 11 if MODE == "hang" else 23
        if episode_id % hang_every == 4:
            await asyncio.Event().wait()
        if MODE == "mixed" and episode_id % 17 == 5:
            raise RuntimeError(f"grader crashed on episode {episode_id}")
        return await super().run(client, example, episode_id=episode_id, **kw)

    def score(self, text, example):
        self.scored += 1
        if MODE == "mixed" and self.scored == 10:
            time.sleep(1.5)  # blocking code on the event loop
        if MODE == "mixed" and self.scored % 19 == 3:
            return float("nan"), {}
        return super().score(text, example)


register_env("faulty_reverse_text", lambda **kw: FaultyReverseText(**kw))

if __name__ == "__main__":
    from jaxrl_orch.train import cli

    sys.exit(cli(sys.argv[1:]))
