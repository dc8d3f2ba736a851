"""StalenessGate against a discrete-time reference model of admission and its formula.

``drive`` is that model (admit while capacity > 0, tick latencies, consume completions in order
in batches of B, bump the version per batch) with every counter delegated to the real
``StalenessGate``; the numbers it must reproduce are the model's known results: the max age
equals S under uniform latency, overshoots it under jitter, grows with concurrency when
ungated, and a resume that skips the recovery admits a burst.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_orch.orchestrator.gate import StalenessGate


def drive(
    max_staleness,
    steps=60,
    batch=8,
    concurrent=64,
    latency=(3, 3),
    recover_at=0,
    fix_recovery=True,
    seed=0,
):
    rng = np.random.default_rng(seed)
    gate = StalenessGate(max_staleness, batch, concurrent)
    if recover_at:
        if fix_recovery:
            gate.on_version_recovered(recover_at)
        else:
            gate.on_version(recover_at)
    inflight, done, ages, admitted = [], [], [], []
    lo, hi = latency
    for _ in range(steps):
        n = 0
        while gate.capacity() > 0:
            wait = lo if hi <= lo else int(rng.integers(lo, hi))
            inflight.append((gate.version, wait))
            gate.on_admit()
            n += 1
        admitted.append(n)
        inflight = [(v, t - 1) for v, t in inflight]
        ripe = [v for v, t in inflight if t <= 0]
        inflight = [(v, t) for v, t in inflight if t > 0]
        if ripe:
            gate.on_finish(len(ripe), accepted=True)
        done.extend(ripe)
        while len(done) >= batch:
            versions, done = done[:batch], done[batch:]
            ages.extend(gate.version - v for v in versions)
            gate.on_version(gate.version + 1)
    return np.array(ages), np.array(admitted)


def test_reference_model_results_are_reproduced():
    for s in (0, 1, 2, 4):
        ages, _ = drive(s)
        assert ages.size and ages.max() == s
    jittered = [int(drive(s, latency=(1, 6))[0].max()) for s in (1, 2, 4)]
    ungated = {
        c: int(drive(10**9, steps=80, concurrent=c)[0].max()) for c in (16, 32, 64, 128, 256)
    }
    bad_ages, bad_admits = drive(2, recover_at=40, fix_recovery=False, concurrent=10**6)
    good_ages, good_admits = drive(2, recover_at=40, fix_recovery=True, concurrent=10**6)
    clipped_ages, clipped_admits = drive(2, recover_at=40, fix_recovery=False, concurrent=64)
    printed = (
        f"uniform latency: max age == S for S in 0,1,2,4 | "
        f"jittered latency S=1/2/4 -> {jittered} "
        f"| ungated max age by concurrency {ungated} | "
        f"resume burst {bad_admits[0]} vs {good_admits[0]} admissions, "
        f"max age {bad_ages.max()} vs {good_ages.max()}"
    )
    assert printed == (
        "uniform latency: max age == S for S in 0,1,2,4 | jittered latency S=1/2/4 -> [2, 4, 7] "
        "| ungated max age by concurrency {16: 1, 32: 3, 64: 7, 128: 15, 256: 31} | "
        "resume burst 344 vs 24 admissions, max age 42 vs 2"
    )
    assert clipped_admits[0] == 64 and clipped_ages.max() == 7


def test_jitter_overshoots_but_mean_tracks_bound():
    for s in (1, 2, 4):
        ages, _ = drive(s, latency=(1, 6))
        assert ages.max() > s
        assert abs(ages.mean() - s) < 1.0
    assert drive(2, latency=(1, 3))[0].max() < drive(2, latency=(1, 12))[0].max()


def test_concurrency_and_staleness_separate():
    for c in (16, 64, 256):
        assert drive(2, steps=80, concurrent=c)[0].max() == min(2, c // 8 - 1)
    for s in (0, 1, 2, 4):
        gate = StalenessGate(s, 8, 10**6)
        assert gate.pending_limit() == (s + 1) * 8 == gate.capacity()
    assert StalenessGate(4, 8, 12).capacity() == 12


def test_resume_capacity_numbers():
    gate = StalenessGate(2, 8, 10**6)
    gate.on_version(40)
    assert gate.capacity() == 344
    gate.on_version_recovered(40)
    assert gate.capacity() == 24 and gate.accepted == 320


def test_rejected_finishes_do_not_count_as_accepted():
    gate = StalenessGate(0, 4, 100)
    gate.on_admit(4)
    gate.on_finish(2, accepted=False)
    gate.on_finish(2, accepted=True)
    assert (gate.running, gate.accepted) == (0, 2)
    # The two rejected slots are open again: the batch still needs 2 more accepted rollouts.
    assert gate.capacity() == 2


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"max_staleness": -1, "batch_size": 8, "max_concurrent": 8}, "max_staleness"),
        ({"max_staleness": 1, "batch_size": 0, "max_concurrent": 8}, "batch_size"),
        ({"max_staleness": 1, "batch_size": 8, "max_concurrent": 0}, "max_concurrent"),
        ({"max_staleness": 1.5, "batch_size": 8, "max_concurrent": 8}, "max_staleness"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        StalenessGate(**kwargs)


def test_counters_cannot_go_wrong_silently():
    gate = StalenessGate(1, 2, 4)
    with pytest.raises(ValueError, match="only 0 rollouts are running"):
        gate.on_finish(1)
    gate.on_version(3)
    with pytest.raises(ValueError, match="backwards"):
        gate.on_version(2)


@settings(max_examples=150, deadline=None)
@given(
    s=st.integers(0, 4),
    b=st.integers(1, 8),
    c=st.integers(1, 64),
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "finish", "reject", "version"]), st.integers(1, 5)),
        max_size=80,
    ),
)
def test_gate_never_admits_past_its_formula(s, b, c, ops):
    """Whatever the event order, an admitter that respects capacity() never puts more than
    max_concurrent rollouts in flight, nor more than (S + version + 1) * B into the system."""
    gate = StalenessGate(s, b, c)
    for op, n in ops:
        if op == "admit":
            n = min(n, max(gate.capacity(), 0))
            gate.on_admit(n)
        elif op in ("finish", "reject"):
            gate.on_finish(min(n, gate.running), accepted=op == "finish")
        else:
            gate.on_version(gate.version + 1)
        assert gate.running <= c
        assert gate.accepted + gate.running <= (s + gate.version + 1) * b
        assert gate.capacity() == min(
            c - gate.running, (s + gate.version + 1) * b - gate.accepted - gate.running
        )


def test_discarded_rollouts_reopen_their_slots():
    """Dynamic sampling drops flat groups after they were accepted; the gate must let their
    replacements in, or a dropped group would close the gate until a version that never comes."""
    gate = StalenessGate(0, 8, 100)
    gate.on_admit(8)
    gate.on_finish(8, accepted=True)
    assert gate.capacity() == 0
    gate.on_discard(4)
    assert gate.capacity() == 4
    with pytest.raises(ValueError, match="only 4 rollouts are accepted"):
        gate.on_discard(5)
