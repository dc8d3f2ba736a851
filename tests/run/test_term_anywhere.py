"""SIGTERM at random moments of one run, the same command after each: the state a stop saves is
lossless and saved within the bound the run states; a second SIGTERM during the save still
leaves a workdir the same command resumes.

What it must show: each SIGTERM exits 0 with ``summary.json["stop"]`` saying the checkpoint was
committed within its bound (the drain, at most ``drain_timeout_s``, then
``SAVE_AFTER_DRAIN_S``); a second signal exits 128 + 15 at once (or 0 if the save was done
first); after the last start, every step's row once, no rollout trained twice, every group
trained whole or still owed by the journal (``support.interrupts.check_nothing_lost``).
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
from support.interrupts import check_nothing_lost, interrupt, journal_counts
from support.train_cmd import run_train

pytestmark = pytest.mark.slow

STEPS = 10
PARAMS = [f"RL.steps = {STEPS}"]
TERM = (signal.SIGTERM,)
TWICE = (signal.SIGTERM, signal.SIGTERM)
SCHEDULE = [("rl", TERM), ("checkpoint", TERM), ("eval", TWICE), ("rl", TERM), ("rl", TWICE)]


def test_sigterm_anywhere_saves_losslessly_within_its_bound(tmp_path):
    wd = tmp_path / "run"
    rng = random.Random(int(os.environ.get("KILL_SEED", "0")))
    logs = []
    for k, (moment, signals) in enumerate(SCHEDULE):
        logs.append(tmp_path / f"attempt_{k}.log")
        rc = interrupt(wd, moment, rng, logs[-1], PARAMS, signals)
        if rc is None:
            break
        if signals == TERM or rc == 0:
            assert rc == 0, logs[-1].read_text()[-3000:]
            stop = json.loads((wd / "summary.json").read_text())["stop"]
            assert stop["within_bound"], stop
        else:
            assert rc == 128 + signal.SIGTERM, logs[-1].read_text()[-3000:]
    res = run_train(wd, *PARAMS)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (tmp_path / "final.log").write_text(res.stdout)
    check_nothing_lost(wd, STEPS)
    assert journal_counts([*logs, tmp_path / "final.log"])["kept"] > 0
