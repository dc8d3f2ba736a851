"""RolloutStore: JSONL round trip, atomic replace, clear errors."""

import asyncio
import json
import math

import pytest

from jaxrl_orch.orchestrator.store import RolloutStore
from jaxrl_orch.types import NO_VERSION, Rollout


def trained(gid, eid, reward, adv, age=1):
    r = Rollout(
        env="rev",
        group_id=gid,
        episode_id=eid,
        example={"text": "abc"},
        token_ids=[1, 2, 30, 31, 32],
        loss_mask=[False, False, True, True, True],
        logprobs=[0.0, 0.0, -0.25, -1.5, -0.125],
        versions=[NO_VERSION, NO_VERSION, 4, 5, 5],
        reward=reward,
        temperature=0.8,
        advantage=adv,
        off_policy_steps=age,
    )
    return r


def test_round_trip_every_field(tmp_path):
    store = RolloutStore(tmp_path / "rollouts")
    rs = [trained(0, 0, 0.99, 0.37), trained(0, 1, 0.40, -0.22, age=None)]
    path = store.write(3, rs)
    assert path.name == "step_00000003.jsonl"
    assert not list(path.parent.glob("*.tmp"))
    got = store.read(3)
    assert len(got) == 2
    for rec, r in zip(got, rs, strict=True):
        assert rec["env"] == "rev" and rec["group_id"] == r.group_id
        assert rec["episode_id"] == r.episode_id
        assert rec["token_ids"] == r.token_ids and rec["loss_mask"] == r.loss_mask
        assert rec["logprobs"] == r.logprobs and rec["versions"] == r.versions
        assert rec["reward"] == r.reward and rec["advantage"] == r.advantage
        assert rec["off_policy_steps"] == r.off_policy_steps
        assert rec["temperature"] == 0.8 and rec["head_version"] == 4
        assert rec["live_policy"] is True
    # One JSON object per line.
    lines = path.read_text().splitlines()
    assert [json.loads(x)["episode_id"] for x in lines] == [0, 1]
    assert store.steps() == [3]
    g = store.gauges()
    assert g["store/steps_written"] == 1 and g["store/rollouts_written"] == 2
    assert g["store/bytes_written"] == len(path.read_bytes())


def test_rewrite_replaces_and_steps_sorted(tmp_path):
    store = RolloutStore(tmp_path)
    store.write(2, [trained(0, 0, 1.0, 0.5)])
    store.write(1, [])
    store.write(2, [trained(1, 7, 0.0, -0.5)])
    assert store.steps() == [1, 2]
    assert [r["episode_id"] for r in store.read(2)] == [7]
    assert store.read(1) == []
    # A second store on the same directory reads what the first wrote.
    assert RolloutStore(tmp_path).read(2) == store.read(2)


def test_async_write(tmp_path):
    store = RolloutStore(tmp_path)
    asyncio.run(store.write_async(5, [trained(0, 0, 1.0, 0.5)]))
    assert store.read(5)[0]["reward"] == 1.0


def test_errors_name_the_problem(tmp_path):
    store = RolloutStore(tmp_path)
    with pytest.raises(ValueError, match="no rollouts stored for step 9"):
        store.read(9)
    bad = trained(0, 4, math.nan, 0.0)
    with pytest.raises(ValueError, match="rollout 0 .*episode_id=4.* of step 1"):
        store.write(1, [bad])
    assert 1 not in store.steps()
    misaligned = trained(0, 0, 1.0, 0.0)
    misaligned.versions.pop()
    with pytest.raises(ValueError, match="misaligned"):
        store.write(2, [misaligned])
    with pytest.raises(ValueError, match="step must be >= 0"):
        store.write(-1, [])


def test_a_log_prob_the_engine_did_not_report_is_written_as_null(tmp_path):
    store = RolloutStore(tmp_path)
    r = trained(0, 0, 1.0, 0.5)
    r.logprobs = [x if not m else math.nan for x, m in zip(r.logprobs, r.loss_mask, strict=True)]
    store.write(3, [r])
    rec = store.read(3)[0]
    assert [lp is None for lp in rec["logprobs"]] == r.loss_mask


def test_a_branching_rollout_is_stored_with_every_path(tmp_path):
    from jaxrl_orch.orchestrator.store import rollout_record
    from jaxrl_orch.types import Branch

    r = Rollout(
        env="vf",
        group_id=0,
        episode_id=0,
        example={},
        token_ids=[1, 2, 3],
        loss_mask=[False, True, True],
        logprobs=[0.0, -0.1, -0.2],
        versions=[NO_VERSION, 4, 4],
    )
    r.branches = [Branch([1, 2, 3, 5, 6], [False] * 4 + [True], [0.0] * 4 + [-0.3], [-1] * 4 + [5])]
    record = json.loads(json.dumps(rollout_record(r)))
    assert record["token_ids"] == [1, 2, 3]
    (b,) = record["branches"]
    assert b["token_ids"] == [1, 2, 3, 5, 6] and b["versions"][-1] == 5 and b["loss_mask"][-1]
    assert record["head_version"] == 4 and r.tail_version == 5 and r.num_model_tokens == 3
    r.branches[0].versions.pop()
    with pytest.raises(ValueError, match="rollout branch 1 misaligned"):
        rollout_record(r)
