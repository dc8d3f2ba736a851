"""A JetStream-shaped engine plugged into the train command (``Engine.kind``): it reports
no log-probs, so the trainer recomputes the behaviour log-probs and the run trains on them."""

from __future__ import annotations

import json

import pytest
from support.train_cmd import rl_rows, run_train

pytestmark = pytest.mark.slow


def test_two_rl_steps_on_an_upstream_shaped_engine_with_recomputed_logprobs(tmp_path):
    wd = tmp_path / "upstream"
    # The engine is named like a user's (``tests/`` is on the command's PYTHONPATH).
    res = run_train(
        wd,
        "RL.steps = 2",
        "Orchestrator.max_staleness = 0",
        "Engine.kind = 'support.upstream_engines:UpstreamShapedEngine'",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reports no log-probs: the trainer recomputes them" in res.stdout
    rows = rl_rows(wd)
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    # Step 1: the recomputed old log-probs come from the very weights that sampled, and the
    # update is one pass: new == old, so every ratio is 1; the engine mismatch is 0 by design.
    assert first["trainer/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["trainer/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert first["trainer/mismatch_kl"] == 0.0 and first["trainer/tis_capped"] == 0.0
    assert all(v is not None for v in first.values())  # nothing NaN reached the step row
    # The stored rollouts keep the fact: no behaviour log-prob from this engine.
    rec = json.loads((wd / "rollouts" / "step_00000001.jsonl").read_text().splitlines()[0])
    model = [lp for lp, m in zip(rec["logprobs"], rec["loss_mask"], strict=True) if m]
    assert model and all(lp is None for lp in model)
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["rl_steps"] == 2
