"""TrainSink with fake rollouts: grouping, scoring, filtering, batching, window vs batch."""

import asyncio
import math
import threading

import numpy as np
import pytest

from jaxrl_orch.orchestrator import train_sink as ts
from jaxrl_orch.orchestrator.samples import trace_to_sample
from jaxrl_orch.orchestrator.train_sink import TrainSink, TrainSinkConfig
from jaxrl_orch.types import NO_VERSION, Rollout

_EPISODE = iter(range(10**9))


def make(gid, reward, *, completion=(40, 41, 42), error=None, temp=1.0, env="t", version=3):
    prompt = [1, 2]
    toks = prompt + list(completion)
    n_c = len(completion)
    r = Rollout(
        env=env,
        group_id=gid,
        episode_id=next(_EPISODE),
        example={},
        token_ids=toks,
        loss_mask=[False] * 2 + [True] * n_c,
        logprobs=[0.0] * 2 + [-0.5] * n_c,
        versions=[NO_VERSION] * 2 + [version] * n_c,
        reward=reward,
        temperature=temp,
        num_turns=1,
    )
    if error:
        r.capture_error(RuntimeError(error))
    return r


def group(gid, rewards, **kw):
    return [make(gid, x, **kw) for x in rewards]


def sink_for(group_size, batch_size, algorithm="grpo", *, on_discard=None, **settings):
    config = TrainSinkConfig(group_size=group_size, batch_size=batch_size, **settings)
    return TrainSink(config, algorithm, on_discard=on_discard)


def feed(sink, rollouts, per_rollout=True):
    """Add rollouts one per episode (or all as one episode), taking a batch after each as the
    loop does once enough are ready; return the batches taken."""

    async def go():
        eps = [[r] for r in rollouts] if per_rollout else [rollouts]
        out = []
        for ep in eps:
            await sink.add(ep)
            b = sink.take_batch()
            if b is not None:
                out.append(b)
        return out

    return asyncio.run(go())


def test_trace_to_sample_multi_turn_values():
    # prompt | model turn | env reply | model turn
    r = Rollout(
        env="t",
        group_id=0,
        episode_id=0,
        example={},
        token_ids=[1, 2, 10, 11, 5, 6, 12],
        loss_mask=[False, False, True, True, False, False, True],
        logprobs=[9.0, 9.0, -0.1, -0.2, 9.0, 9.0, -0.3],
        versions=[7, 7, 4, 5, 7, 7, 6],
        temperature=0.7,
    )
    s = trace_to_sample(r)
    np.testing.assert_array_equal(s.token_ids, r.token_ids)
    assert s.token_ids.dtype == np.int32 and s.loss_mask.dtype == bool
    np.testing.assert_allclose(s.logprobs, [0, 0, -0.1, -0.2, 0, 0, -0.3], rtol=1e-6)
    np.testing.assert_array_equal(s.versions, [NO_VERSION] * 2 + [4, 5] + [NO_VERSION] * 2 + [6])
    np.testing.assert_allclose(s.temperatures, np.full(7, 0.7, np.float32))
    np.testing.assert_array_equal(s.advantages, np.zeros(7))


def test_groups_held_until_complete_then_scored_and_batched():
    sink = sink_for(group_size=4, batch_size=8, algorithm="grpo")
    g0, g1 = group(0, [1.0, 0.0, 0.5, 0.5]), group(1, [0.2, 0.4, 0.6, 0.8])
    assert feed(sink, g0[:3] + g1[:3]) == []
    assert sink.gauges()["train_sink/pending_groups"] == 2
    assert sink.gauges()["train_sink/pending_group_rollouts"] == 6
    assert all(r.advantage is None for r in g0[:3])
    assert feed(sink, [g0[3]]) == []  # group 0 complete, only 4 ready of 8
    [batch] = feed(sink, [g1[3]])
    assert batch.step == 1 and len(batch.samples) == 8 and len(batch.rollouts) == 8
    for g in (g0, g1):
        ref = np.array([r.reward for r in g]) - np.mean([r.reward for r in g])
        np.testing.assert_allclose([r.advantage for r in g], ref, atol=1e-6)
        for r in g:
            s = r.samples[0]
            np.testing.assert_allclose(s.advantages[s.loss_mask], r.advantage)
            assert (s.advantages[~s.loss_mask] == 0).all()
    assert batch.samples[0] is g0[0].samples[0]
    assert batch.metrics["train/effective_group_rate"] == 1.0
    assert batch.metrics["train/tokens"] == 8 * 5 and batch.metrics["train/loss_tokens"] == 24
    assert batch.trained == g0 + g1
    assert sink.step == 2


def test_errored_rollouts_dropped_but_in_window():
    sink = sink_for(group_size=4, batch_size=3)
    g = group(0, [1.0, 0.0, 0.5]) + [make(0, 0.0, error="env crashed")]
    [batch] = feed(sink, g)
    assert len(batch.samples) == 3 and len(batch.rollouts) == 4
    assert g[3].samples == [] and g[3].advantage is None
    # Baseline is the mean of the three survivors only.
    np.testing.assert_allclose([r.advantage for r in g[:3]], [0.5, -0.5, 0.0], atol=1e-6)
    assert batch.metrics["train/errors"] == 1
    assert batch.metrics["train/reward_mean"] == pytest.approx(0.5)


def test_zero_variance_groups_dropped_and_replaced():
    sink = sink_for(group_size=4, batch_size=8)
    signal_a = group(0, [1, 0, 0, 1])
    flat = group(1, [1, 1, 1, 1])
    signal_b = group(2, [0, 0, 0, 1])
    assert feed(sink, signal_a + flat) == []  # 4 clean, flat group does not count
    [batch] = feed(sink, signal_b)
    assert len(batch.samples) == 8
    trained = batch.trained
    assert {r.group_id for r in trained} == {0, 2}
    assert all(r.filter_reasons == ["zero_variance"] for r in flat)
    assert len(batch.rollouts) == 12  # window keeps the flat group for metrics
    assert batch.metrics["train/filtered/zero_variance"] == 4
    assert batch.metrics["train/groups_seen"] == 3
    assert batch.metrics["train/effective_group_rate"] == pytest.approx(2 / 3)
    assert all(abs(r.advantage) > 0 for r in trained)


def test_without_dynamic_sampling_flat_groups_are_trained_with_zero_advantage():
    sink = sink_for(group_size=2, batch_size=4, dynamic_sampling=False)
    [batch] = feed(sink, group(0, [1, 1]) + group(1, [0, 1]))
    assert len(batch.samples) == 4
    assert batch.metrics["train/effective_group_rate"] == 0.5
    assert not batch.samples[0].advantages.any()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_counted_filtered_never_trained(bad):
    sink = sink_for(group_size=4, batch_size=3)
    g = group(0, [bad, 1.0, 0.0, 0.5])
    [batch] = feed(sink, g)
    assert g[0].filtered and g[0].filter_reasons == ["non_finite_reward"]
    assert g[0].advantage is None
    assert all(s is not g[0].samples[0] for s in batch.samples)
    np.testing.assert_allclose([r.advantage for r in g[1:]], [0.5, -0.5, 0.0], atol=1e-6)
    assert batch.metrics["train/filtered/non_finite_reward"] == 1
    assert all(np.isfinite(s.advantages).all() for s in batch.samples)
    assert batch.metrics["train/reward_mean"] == pytest.approx(0.5)


def test_non_finite_logprob_is_filtered():
    sink = sink_for(group_size=3, batch_size=2)
    g = group(0, [1.0, 0.0, 0.5])
    g[2].logprobs[3] = math.nan
    [batch] = feed(sink, g)
    assert g[2].filter_reasons == ["non_finite_logprob"]
    assert len(batch.samples) == 2


def test_misaligned_trace_becomes_error_rollout():
    sink = sink_for(group_size=3, batch_size=2)
    g = group(0, [1.0, 0.0, 0.5])
    g[1].logprobs.pop()
    [batch] = feed(sink, g)
    assert g[1].has_error and "misaligned" in g[1].errors[0]
    assert batch.metrics["train/errors"] == 1


def test_batch_takes_exactly_batch_size_and_carries_the_rest():
    sink = sink_for(group_size=4, batch_size=6)
    g0, g1, g2 = group(0, [0, 1, 0, 1]), group(1, [0, 1, 1, 1]), group(2, [1, 0, 0, 0])
    [b1] = feed(sink, g0 + g1)
    assert len(b1.samples) == 6 and b1.metrics["train/ready_carryover"] == 2
    assert len(b1.rollouts) == 8
    [b2] = feed(sink, g2)
    assert b2.step == 2 and len(b2.samples) == 6
    assert b2.trained == g1[2:] + g2
    assert b2.rollouts == g2  # the window restarts after each batch
    assert set(map(id, b1.trained)).isdisjoint(map(id, b2.trained))


def test_whole_group_episode():
    sink = sink_for(group_size=2, batch_size=4)
    assert feed(sink, group(0, [0, 1]), per_rollout=False) == []
    [batch] = feed(sink, group(1, [1, 0]), per_rollout=False)
    assert len(batch.samples) == 4


def test_swappable_algorithm_and_temperature_fanout():
    sink = sink_for(group_size=3, batch_size=3, algorithm="rloo")
    g = group(0, [1.0, 0.0, 0.0], temp=0.6)
    [batch] = feed(sink, g)
    np.testing.assert_allclose([r.advantage for r in g], [1.0, -0.5, -0.5])
    np.testing.assert_allclose(batch.samples[0].temperatures, 0.6)


def test_big_groups_tokenize_off_the_event_loop_small_ones_inline(monkeypatch):
    threads = []
    real = ts.group_to_samples

    def spy(rs):
        threads.append(threading.get_ident())
        return real(rs)

    monkeypatch.setattr(ts, "group_to_samples", spy)
    main = threading.get_ident()
    # 2 rollouts x 5 tokens = 10 tokens: at the threshold -> worker thread.
    monkeypatch.setattr(ts, "OFFLOAD_MIN_TOKENS", 10)
    feed(sink_for(group_size=2, batch_size=2), group(0, [0.0, 1.0]))
    assert len(threads) == 1 and threads[0] != main
    monkeypatch.setattr(ts, "OFFLOAD_MIN_TOKENS", 11)
    feed(sink_for(group_size=2, batch_size=2), group(0, [0.0, 1.0]))
    assert len(threads) == 2 and threads[1] == main


def test_group_conversion_matches_per_rollout_reference():
    from jaxrl_orch.orchestrator.samples import group_to_samples

    rng = np.random.default_rng(1)
    rs = []
    for i in range(5):
        n = int(rng.integers(0, 9))
        mask = rng.random(n) < 0.6
        lps = rng.normal(size=n)
        lps[~mask] = np.nan  # garbage on non-model tokens must not leak into the sample
        rs.append(
            Rollout(
                env="t",
                group_id=0,
                episode_id=i,
                example={},
                token_ids=rng.integers(0, 1000, n).tolist(),
                loss_mask=mask.tolist(),
                logprobs=lps.tolist(),
                versions=rng.integers(-1, 5, n).tolist(),
                temperature=float(i) / 4,
            )
        )
    refs = [trace_to_sample(r) for r in rs]
    arrays = group_to_samples(rs)
    for r, ref in zip(rs, refs, strict=True):
        [s] = r.samples
        for f in ("token_ids", "loss_mask", "logprobs", "advantages", "temperatures", "versions"):
            got, want = getattr(s, f), getattr(ref, f)
            assert got.dtype == want.dtype, f
            np.testing.assert_array_equal(got, want, err_msg=f)
    assert arrays.all_logprobs_finite()
    adv = np.arange(5, dtype=np.float32) - 2
    arrays.fan_out(adv)
    for r, a in zip(rs, adv, strict=True):
        s = r.samples[0]
        np.testing.assert_array_equal(s.advantages, np.where(s.loss_mask, a, 0).astype(np.float32))
    rs[3].logprobs[0] = float("inf")
    rs[3].loss_mask[0] = True
    assert not group_to_samples(rs).all_logprobs_finite()
    rs[2].versions.append(1)  # misaligned: the group declines, the per-rollout path names it
    assert group_to_samples(rs) is None


def test_misaligned_trace_becomes_error_rollout_others_still_trained():
    sink = sink_for(group_size=3, batch_size=2)
    g = group(0, [0.0, 1.0, 0.5])
    g[2].logprobs.append(0.0)
    [batch] = feed(sink, g)
    assert g[2].has_error and "misaligned" in g[2].errors[0] and g[2].samples == []
    assert len(batch.samples) == 2
    np.testing.assert_allclose([g[0].advantage, g[1].advantage], [-0.5, 0.5])
    np.testing.assert_allclose(g[1].samples[0].advantages, [0, 0, 0.5, 0.5, 0.5])


def test_non_finite_model_logprob_is_flagged_and_excluded_from_baseline():
    sink = sink_for(group_size=3, batch_size=2)
    g = group(0, [0.0, 1.0, 9.0])
    g[2].logprobs[3] = float("nan")
    [batch] = feed(sink, g)
    assert g[2].filter_reasons == ["non_finite_logprob"] and g[2].advantage is None
    np.testing.assert_allclose([g[0].advantage, g[1].advantage], [-0.5, 0.5])
    assert batch.trained == g[:2]


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="batch_size"):
        sink_for(group_size=2, batch_size=0)
    with pytest.raises(ValueError, match="group_size"):
        sink_for(group_size=0, batch_size=2)
    with pytest.raises(ValueError, match="unknown advantage algorithm"):
        sink_for(group_size=2, batch_size=2, algorithm="nope")
    with pytest.raises(ValueError, match="batch_order.*'newest'"):
        sink_for(group_size=2, batch_size=2, batch_order="newest")
    sink = sink_for(group_size=2, batch_size=8)
    ev = make(0, 1.0)
    ev.is_eval = True
    with pytest.raises(ValueError, match="eval sink"):
        feed(sink, [ev])
    with pytest.raises(ValueError, match="empty"):
        feed(sink, [], per_rollout=False)
    with pytest.raises(ValueError, match="received 3 rollouts but its group_size is 2"):
        feed(sink, group(5, [0, 1, 2]), per_rollout=False)


def test_gauges_state_restore():
    sink = sink_for(group_size=2, batch_size=2)
    sink.start()
    feed(sink, group(0, [0.0, 1.0]) + group(1, [1.0, 1.0]) + [make(2, 0.0)])
    g = sink.gauges()
    assert all(k.startswith("train_sink/") for k in g)
    assert g["train_sink/batches_total"] == 1 and g["train_sink/groups_seen_total"] == 2
    assert g["train_sink/effective_group_rate"] == 0.5
    assert g["train_sink/pending_group_rollouts"] == 1 and g["train_sink/running"] == 1.0
    st = sink.state()
    other = sink_for(group_size=2, batch_size=2)
    other.restore(st)
    assert other.step == 2
    sink.stop()
    assert sink.gauges()["train_sink/running"] == 0.0
    with pytest.raises(ValueError, match="'step'"):
        other.restore({})


def test_worked_example_end_to_end():
    """8 tasks x 16 rollouts, one flat task replaced, 128 samples of 150 tokens -> 10 rows."""
    from jaxrl_orch.algorithms.packing import pack_samples

    rng = np.random.default_rng(0)
    sink = sink_for(group_size=16, batch_size=128)
    batches = []
    for gid in range(9):
        rewards = [1.0] * 16 if gid == 3 else rng.uniform(0.3, 1.0, 16).tolist()
        g = group(gid, rewards, completion=tuple(rng.integers(3, 500, 148)))
        batches += feed(sink, g, per_rollout=False)
    [batch] = batches
    assert len(batch.samples) == 128 and batch.metrics["train/groups_seen"] == 9
    assert batch.metrics["train/effective_group_rate"] == pytest.approx(8 / 9)
    assert 3 not in {r.group_id for r in batch.trained}
    packed = pack_samples(batch.samples, 2048)
    assert packed.num_tokens == batch.num_tokens == 128 * 150
    assert packed.num_rows == 10 and packed.samples_per_row().max() == 13
    assert packed.num_loss_tokens == 128 * 148


def test_fully_errored_group_is_seen_without_signal():
    sink = sink_for(group_size=2, batch_size=2)
    dead = [make(0, 0.0, error="a"), make(0, 0.0, error="b")]
    [batch] = feed(sink, dead + group(1, [0.0, 1.0]))
    assert batch.metrics["train/errors"] == 2 and batch.metrics["train/groups_seen"] == 2
    assert batch.metrics["train/effective_group_rate"] == 0.5
    assert all(r.samples == [] for r in dead)


def test_discards_of_clean_arrivals_are_reported_for_the_gate():
    """Rollouts that finished cleanly but never reach a batch (flat groups, non-finite rewards)
    are reported, so the admission gate can admit replacements; dispatcher errors are not (the
    dispatcher already told the gate they were not accepted)."""
    discarded = []
    sink = sink_for(group_size=4, batch_size=8, on_discard=discarded.append)
    feed(sink, group(0, [0.5] * 4))  # zero variance: 4 dropped
    feed(sink, group(1, [0.0, 1.0, 0.0, 0.0]) + [make(2, 1.0, error="boom")] + group(2, [0, 1, 1]))
    feed(sink, group(3, [float("nan"), 1.0, 0.0, 0.0]))
    assert discarded == [4, 1]


def test_loop_controlled_batching_takes_oldest_heads_first():
    sink = sink_for(group_size=2, batch_size=2, batch_order="oldest")
    g = group(0, [0.0, 1.0], version=5) + group(1, [1.0, 0.0], version=2)

    async def add_all():
        for r in g:
            await sink.add([r])

    asyncio.run(add_all())
    assert sink.ready_count == 4
    batch = sink.take_batch()
    assert [r.group_id for r in batch.trained] == [1, 1]
    assert {int(v) for s in batch.samples for v in s.versions if v >= 0} == {2}
    assert sink.ready_count == 2


def test_consecutive_empty_groups_reset_by_a_group_with_signal():
    sink = sink_for(group_size=2, batch_size=8)
    feed(sink, group(0, [0.5, 0.5]) + group(1, [0.0, 0.0]))
    assert sink.consecutive_empty_groups == 2
    feed(sink, group(2, [0.0, 1.0]))
    assert sink.consecutive_empty_groups == 0


def test_cut_rollouts_are_never_trained_and_are_counted_by_kind():
    """A rollout cut short (``Rollout.cut``) stays out of the batch, out of the reward mean (its
    reward scored partial text) and out of the discards handed back to the gate, and is counted
    under its finish reason in the step row, the gauges and the state."""
    discards = []
    sink = sink_for(group_size=4, batch_size=2, on_discard=discards.append)
    rollouts = group(0, [0.0, 1.0, 9.0, 9.0])
    for r, reason in zip(rollouts[2:], ("abort", "cancelled"), strict=True):
        r.trainable = False
        r.cut = reason
    own = make(1, 5.0)
    own.trainable = False  # an env's own verdict, with no finish reason
    rest = group(1, [0.0, 1.0, 1.0])
    (batch,) = feed(sink, rollouts, per_rollout=False)
    assert batch.trained == rollouts[:2] and batch.metrics["train/reward_mean"] == 0.5
    m = batch.metrics
    assert (m["train/untrainable"], m["train/untrainable/abort"]) == (2, 1)
    assert m["train/untrainable/cancelled"] == 1 and "train/untrainable/other" not in m
    feed(sink, [own, *rest], per_rollout=False)
    g = sink.gauges()
    assert g["train_sink/untrainable_total"] == 3 and g["train_sink/untrainable/other_total"] == 1
    assert g["train_sink/untrainable/abort_total"] == 1
    assert g["train_sink/untrainable/cancelled_total"] == 1
    assert discards == []  # only clean arrivals the sink dropped are handed back
    assert sink.state()["totals"]["untrainable/abort"] == 1
