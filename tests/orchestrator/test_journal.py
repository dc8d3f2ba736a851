"""The rollout journal: a run stopped at any point and restarted from its checkpoint trains
every prompt it drew exactly once, keeping the rollouts that had finished.

What it must show: over the simulator's engine (virtual time), a run that crashes some steps
after its checkpoint and restarts from it trains no rollout twice and skips no prompt it had
drawn; the finished rollouts a restart finds are kept (with their own versions), the others
sent again; without the journal (``keep_pending = False``, the earlier behaviour) the same crash
loses prompts, which is what the first test counts. The journal's own rules: a torn or bad
line, versions from a lost future, a group that cannot be completed, an expired rollout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json

import numpy as np
import pytest

from jaxrl_orch.compose.orchestrator import Backend, Telemetry, Workload, build_orchestrator
from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.orchestrator.components import LoopHooks
from jaxrl_orch.orchestrator.journal import Replay, RolloutJournal
from jaxrl_orch.orchestrator.recovery import plan
from jaxrl_orch.orchestrator.vclock import run_virtual
from jaxrl_orch.orchestrator.watcher import InProcessPublisher
from jaxrl_orch.tools.simulate import SimEngine, SimEnv, SimSource, SimTrainer
from jaxrl_orch.types import PolicyHandle, Rollout, SamplingParams

GROUP = 4
BATCH = 8


class Crash(Exception):
    pass


class Recorder(SimTrainer):
    def __init__(self, publisher, train_time):
        super().__init__(publisher, train_time)
        self.batches = {}

    def submit(self, batch):
        self.batches[batch.step] = list(batch.trained)
        super().submit(batch)


def _attempt(store, start_version, state, *, steps, crash_at=None, checkpoint_at=None, **kw):
    """One start of the run: from ``state`` (a checkpoint at ``start_version``) until
    ``crash_at`` is shipped (raising ``Crash``) or ``steps`` are done. Returns the batches the
    trainer trained, the checkpoint taken at version ``checkpoint_at`` and the orchestrator."""
    out = {"checkpoint": None}

    async def main():
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(start_version)
        policy = PolicyHandle(start_version)
        publisher = InProcessPublisher()
        trainer = out["trainer"] = Recorder(publisher, 1.0)
        cfg = OrchestratorConfig(
            max_steps=steps,
            batch_size=BATCH,
            group_size=GROUP,
            max_staleness=2,
            eval_at_start=False,
            **kw,
        )

        def on_step(step, _state):
            due = checkpoint_at is not None and policy.version >= checkpoint_at
            if out["checkpoint"] is None and due:
                out["checkpoint"] = (policy.version, orch.checkpoint_state())
            if step == crash_at:
                raise Crash(step)

        async def reload(version, params):
            return None

        orch = out["orch"] = build_orchestrator(
            cfg,
            policy,
            backend=Backend(SimEngine("uniform:0.5:4", policy, rng), trainer, publisher, reload),
            workload=Workload({"sim": SimEnv(rng)}, SimSource(), SamplingParams(max_tokens=6)),
            clock=loop.time,
            hooks=LoopHooks(on_step=on_step),
            telemetry=Telemetry(log_interval_s=1e9, store_dir=str(store)),
        )
        if state is not None:
            orch.restore(state)
        try:
            await orch.run()
        finally:
            trainer.close()

    with contextlib.suppress(Crash):  # the crash: nothing after it runs
        run_virtual(main)
    trained_upto = start_version + out["trainer"].steps
    batches = {s: b for s, b in out["trainer"].batches.items() if s <= trained_upto}
    return batches, out["checkpoint"], out["orch"]


def _crash_and_resume(tmp_path, **kw):
    """Crash at step 7 with a checkpoint at version 4; resume to step 12. Returns every trained
    rollout's slot with how often it trained, the ordinals the first start drew, the restart."""
    first, ckpt, orch1 = _attempt(tmp_path, 0, None, steps=12, crash_at=7, checkpoint_at=4, **kw)
    version, state = ckpt
    # The checkpoint holds steps 1..4; what trained after it is lost with the crash.
    trained = [r for s, b in first.items() if s <= version for r in b]
    again, _, orch2 = _attempt(tmp_path, version, state, steps=12, **kw)
    trained += [r for b in again.values() for r in b]
    drawn = orch1.dispatcher.admission.train_groups
    return collections.Counter(r.slot for r in trained), drawn, orch2


def _unfinished(counts, drawn):
    """Ordinals drawn by the first start that no member of trained (a group whose members were
    all flat or failed trains none; the simulator's random rewards make that rare)."""
    ordinals = {o for o, _ in counts}
    return [o for o in range(drawn) if o not in ordinals]


def test_without_the_journal_a_crash_loses_the_prompts_in_flight(tmp_path):
    counts, drawn, _ = _crash_and_resume(tmp_path, keep_pending=False)
    assert max(counts.values()) == 1
    # The baseline: the groups in flight or waiting at the checkpoint are never trained.
    assert len(_unfinished(counts, drawn)) >= 2


def test_with_the_journal_no_prompt_is_skipped_and_none_trained_twice(tmp_path):
    counts, drawn, orch = _crash_and_resume(tmp_path)
    assert max(counts.values()) == 1, [s for s, n in counts.items() if n > 1]
    assert _unfinished(counts, drawn) == []
    # Every group trained whole: all its members, once.
    per_group = collections.Counter(o for o, _ in counts)
    assert all(n == GROUP for o, n in per_group.items() if o < drawn), per_group
    got = orch.recovery.summary()
    assert got["kept"] > 0 and got["reissued"] > 0 and got["future"] > 0, got


def _done(o, i, versions, **kw):
    r = Rollout(
        "sim",
        0,
        0,
        {},
        token_ids=[1, 2],
        loss_mask=[False, True],
        logprobs=[0.0, -1.0],
        versions=[-1, versions],
        reward=float(i),
        num_turns=1,
        **kw,
    )
    r.slot = (o, i)
    return r


def _journal(tmp_path, version=0):
    j = RolloutJournal(tmp_path / "journal")
    j.replay()
    j.begin(version, [])
    return j


def test_replay_forgets_versions_and_steps_a_restart_lost(tmp_path):
    j = _journal(tmp_path)
    j.opened("sim", 0, {"id": 1})
    j.landed([_done(0, i, 3) for i in range(GROUP)])
    j.landed([_done(1, 0, 5)])
    j.shipped(4, [_done(0, 0, 3)], [])
    j.shipped(6, [_done(0, 1, 3)], [])
    j.close()
    # A later start's file (without the records its compaction would carry over): restarted
    # from version 4, so version 5 and step 6 never happened.
    (tmp_path / "journal" / "epoch_000002.jsonl").write_text('{"epoch": 2, "version": 4}\n')
    replay = RolloutJournal(tmp_path / "journal").replay()
    assert set(replay.done) == {(0, i) for i in range(GROUP)}
    assert replay.shipped == {(0, 0): 4}
    assert replay.problems["future"] == 1


def test_a_torn_last_line_and_a_bad_line_are_counted_and_named(tmp_path):
    replay = Replay()
    good = json.dumps({"kind": "open", "ordinal": 0, "env": "sim", "digest": "x", "example": {}})
    replay.read("epoch_000001.jsonl", f'{good}\n{{"kind": "nope"}}\n{{"kind": "do'.encode())
    assert replay.problems == {"torn_line": 1, "bad_line": 1}
    assert replay.named == ["epoch_000001.jsonl line 2: ValueError: unknown record kind 'nope'"]
    assert list(replay.opens) == [0]


def _plan(tmp_path, version, write, next_ordinal=2):
    j = _journal(tmp_path)
    write(j)
    j.close()
    replay = RolloutJournal(tmp_path / "journal").replay()
    return plan(
        replay, version=version, max_staleness=1, next_ordinal=next_ordinal, group_size=GROUP
    )


def test_plan_keeps_the_fresh_sends_the_rest_again_and_forgets_settled_groups(tmp_path):
    def write(j):
        j.opened("sim", 0, {"id": 1})
        j.opened("sim", 1, {"id": 2})
        group0 = [_done(0, i, 3) for i in range(GROUP)]
        j.landed(group0)
        j.scored(group0, group0)
        j.shipped(3, group0, [])  # settled: forgotten
        j.landed([_done(1, 0, 3), _done(1, 1, 1)])  # version 1 < 4 - 1: expired

    rec = _plan(tmp_path, 4, write)
    assert list(rec.reissue) == [("sim", 1, {"id": 2})]
    assert set(rec.kept) == {1} and set(rec.kept[1]) == {0}
    assert rec.kept[1][0].versions == [-1, 3]
    assert rec.summary() | {} == {**rec.summary(), "kept": 1, "expired": 1, "reissued": 3}


def test_a_partly_trained_group_comes_back_whole_with_its_trained_members_named(tmp_path):
    def write(j):
        j.opened("sim", 0, {"id": 1})
        group0 = [_done(0, i, 3) for i in range(GROUP)]
        j.landed(group0)
        j.scored(group0, group0)
        j.shipped(4, group0[:2], [])  # the group straddled two batches; the second was lost

    rec = _plan(tmp_path, 4, write)
    assert rec.trained_before == {(0, 0), (0, 1)}
    assert set(rec.kept[0]) == {0, 1, 2, 3}
    assert rec.summary()["kept"] == 2 and rec.summary()["reissued"] == 0


def test_a_group_whose_example_cannot_be_sent_again_is_dropped_and_counted(tmp_path):
    def write(j):
        j.opened("sim", 0, {"id": object()})  # not JSON: no copy to send again
        j.landed([_done(0, 0, 3)])

    rec = _plan(tmp_path, 4, write)
    assert not rec.kept and not rec.reissue
    assert rec.summary()["unsendable"] == GROUP


def test_a_group_drawn_again_with_another_example_does_not_take_the_kept_rollouts(tmp_path):
    def write(j):
        j.opened("sim", 5, {"id": 6})
        j.landed([_done(5, 0, 3)])

    rec = _plan(tmp_path, 4, write, next_ordinal=5)
    assert rec.take(5, "sim", {"id": 99}) == {}
    assert rec.summary()["mismatched"] == 1


@pytest.mark.parametrize("policy", ["drop", "pace"])
def test_age_policies_resume_without_training_twice(tmp_path, policy):
    counts, drawn, _ = _crash_and_resume(tmp_path, age_policy=policy)
    assert max(counts.values()) == 1
    assert _unfinished(counts, drawn) == [] or policy == "drop"


def test_a_rollout_comes_back_as_it_landed_numpy_ids_and_missing_logprobs_included(tmp_path):
    r = _done(0, 1, 3)
    r.token_ids = list(np.array([5, 6], np.int32))
    r.logprobs = [0.0, float("nan")]  # an engine that reported none: the trainer recomputes it
    j = _journal(tmp_path)
    j.opened("sim", 0, {"id": 1})
    j.landed([r])
    j.close()
    replay = RolloutJournal(tmp_path / "journal").replay()
    rec = plan(replay, version=4, max_staleness=1, next_ordinal=1, group_size=GROUP)
    back = rec.kept[0][1]
    assert back.token_ids == [5, 6] and back.loss_mask == [False, True]
    assert back.logprobs[0] == 0.0 and np.isnan(back.logprobs[1])
    assert (back.versions, back.reward, back.num_turns) == ([-1, 3], 1.0, 1)
