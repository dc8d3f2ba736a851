"""The verifiers path keeps the event loop turning: nothing of the project's own blocks it.

The README's taskset, as the README writes it, runs its rollouts through ``envs.vf`` on the loop
the train command runs a stage on (``run.ending.run_coroutine``) beside the run's own loop
watchdog, its threshold lowered from the run's 2 s: no report may name a file of the project,
and the rollouts import nothing but the standard library on the loop (a first import reads and
compiles modules while every rollout waits). The engine answers at once, so the loop's own work
is all there is to see.
"""

from __future__ import annotations

import asyncio
import gc
import re
import sys
from pathlib import Path

import pytest
from support.vf_fixtures import ScriptedClient

from jaxrl_orch.orchestrator.faults import LoopWatchdog
from jaxrl_orch.run.ending import YOUNG_GC_EVERY, run_coroutine
from jaxrl_orch.types import SamplingParams

README = Path(__file__).resolve().parents[2] / "README.md"
WARN_S = 1.0
ROLLOUTS = 64


class LoopImports:
    """Records each module first imported on a thread while it runs an event loop (an import
    finder that finds nothing: it only looks)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if asyncio._get_running_loop() is not None and name not in sys.modules:
            self.names.append(name)
        return None


def readme_taskset() -> str:
    """The README's ``my_tasks.py`` block, as written."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith("# my_tasks.py")]
    return block


@pytest.fixture
def my_tasks_env(tmp_path, monkeypatch):
    from jaxrl_orch.envs.vf.env import VerifiersEnv, tokenizer_dir_for
    from jaxrl_orch.models.tokenizer import load_tokenizer

    (tmp_path / "my_tasks.py").write_text(readme_taskset())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_tasks", raising=False)
    tokenizer = load_tokenizer("byte")
    tok_dir = tokenizer_dir_for("byte", tmp_path / "tok")
    return tokenizer, VerifiersEnv(
        tokenizer, env={"taskset": {"id": "my_tasks"}}, tokenizer_dir=tok_dir
    )


def test_the_readme_taskset_never_blocks_the_loop_in_project_code(my_tasks_env):
    tokenizer, env = my_tasks_env
    client = ScriptedClient(tokenizer, ["2 + 2 = 4"], [1])
    sampling = SamplingParams(temperature=1.0, max_tokens=16)
    examples = env.examples("train")[:ROLLOUTS]
    reports: list[str] = []

    async def stage():
        watchdog = asyncio.create_task(LoopWatchdog(WARN_S, report=reports.append).run())
        try:
            for _ in range(2):  # the first round opens the serving; the second is a warm step
                rollouts = await asyncio.gather(
                    *(
                        env.run(client, ex, group_id=0, episode_id=i, sampling=sampling)
                        for i, ex in enumerate(examples)
                    )
                )
                assert all(not r.errors and r.num_model_tokens for r in rollouts)
        finally:
            await env.aclose()
            watchdog.cancel()
        return rollouts

    watch = LoopImports()
    sys.meta_path.insert(0, watch)
    try:
        rollouts = run_coroutine(stage())
    finally:
        sys.meta_path.remove(watch)

    assert len(rollouts) == ROLLOUTS and len(client.prompts) == 2 * ROLLOUTS
    ours = [r for r in reports if "jaxrl_orch/" in r or "jaxrl_orch\\" in r]
    assert not ours, ours
    imported = [m for m in watch.names if m in sys.modules]  # not the lookups that found none
    assert [m for m in imported if m.split(".")[0] not in sys.stdlib_module_names] == []


def test_a_stage_loop_starts_with_the_heap_frozen_and_young_collections_spaced_out():
    async def frozen_count() -> tuple[int, int]:
        return gc.get_freeze_count(), gc.get_threshold()[0]

    count_before = gc.get_freeze_count()
    frozen, young_every = run_coroutine(frozen_count())
    assert frozen > count_before
    assert young_every == YOUNG_GC_EVERY  # the young passes the stage's rollouts pay for
