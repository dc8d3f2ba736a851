"""A JetStream-shaped engine plugged into the train command (``Engine.kind``): it reports
no log-probs, so the trainer recomputes the behaviour log-probs and the run trains on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_e2e import TINY, _env, _rl_rows

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent


def test_two_rl_steps_on_an_upstream_shaped_engine_with_recomputed_logprobs(tmp_path):
    wd = tmp_path / "upstream"
    params = [
        *TINY,
        "RL.steps = 2",
        "Orchestrator.max_staleness = 0",
        "Engine.kind = 'upstream_engines:UpstreamShapedEngine'",
    ]
    env = {**_env(1), "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={wd}"]
        + [f"--gin_param={p}" for p in params],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reports no log-probs: the trainer recomputes them" in res.stdout
    rows = _rl_rows(wd)
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
