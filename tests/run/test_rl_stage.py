"""The RL stage's wiring, in this process: three steps of the toy run through the stages the train
command runs (``support.runs`` -> ``jaxrl_orch.run.stages``), then the same workdir resumed to
step 5. Fast (the toy model, one device each for engine and trainer), so a dropped hop fails the
default suite, not only the slow end-to-end tests of ``test_train_e2e.py``.

Each check is the trace of one hop: the weight path's step times merged into the orchestrator's
step row (``StepTimes.record`` -> ``step_metrics``), the periodic checkpoint written on the
trainer's thread before the version is published, the final one after the drain, the evals on
their schedule, the rollout store, the telemetry, the overlap decision of the engine side, the
staleness bound at the gate, and the resume's trim (every step once across both attempts).
"""

from __future__ import annotations

import json
from pathlib import Path

from support.runs import prepare, run
from support.toy_rl import LowercaseEnv, toy_config
from support.train_cmd import all_rows, checkpoints

from jaxrl_orch.run import rl, warmup

STALENESS = 1
STEP_KEYS = ("trainer/loss", "time/train_s", "time/transfer_s", "time/generate_s")
EVAL_KEY = f"eval/{LowercaseEnv.name}/reward_mean"


def _config(steps: int):
    return toy_config(_overrides(steps))


def _overrides(steps: int) -> dict:
    return {
        "RL.steps": steps,
        "Orchestrator.max_staleness": STALENESS,
        "Outputs.checkpoint_every": 2,
        "RL.eval_every": 2,
        "Outputs.export_hf": False,
        # Each program compiles when first used, not all of them up front (~14 s here).
        "Engine.warmup": False,
    }


def _step_rows(wd: Path) -> list[dict]:
    return [r for r in all_rows(wd) if "train/reward_mean" in r]


def _eval_steps(wd: Path) -> list[int]:
    return [r["step"] for r in all_rows(wd) if EVAL_KEY in r]


def _rollout_steps(wd: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (wd / "rollouts").glob("step_*.jsonl"))


def test_rl_stage_writes_each_step_with_its_times_evals_and_checkpoints_and_resumes(
    tmp_path, monkeypatch
):
    wd = tmp_path
    rows_at_save: dict[int, list[int]] = {}
    save = rl.save_trainer

    def spying_save(ckpt, trainer, version, *args, **kwargs):
        rows_at_save[version] = [r["step"] for r in _step_rows(wd)]
        return save(ckpt, trainer, version, *args, **kwargs)

    monkeypatch.setattr(rl, "save_trainer", spying_save)
    summary = run(prepare(_config(3), wd))

    assert summary["rl_steps"] == 3 and summary["resumed_from_step"] is None
    rows = _step_rows(wd)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the trainer's row of that same step, merged by the orchestrator
        assert all(k in r for k in STEP_KEYS), (r["step"], sorted(r))
        assert r["trainer/version"] == r["step"]
    # Only the step rows carry the trainer's numbers: none went out as a row of its own.
    assert sum("trainer/loss" in r for r in all_rows(wd)) == 3
    assert _eval_steps(wd) == [0, 2, 3]  # before RL, every 2 steps, the last one
    # Step 2: the weight path's periodic checkpoint (trainer thread); step 3: the final one.
    assert checkpoints(wd) == [2, 3]
    # Each checkpoint is written after its step's row: a kill between the two loses no row.
    assert rows_at_save == {2: [1, 2], 3: [1, 2, 3]}
    assert _rollout_steps(wd) == [1, 2, 3]
    gauges = [json.loads(x) for x in (wd / "gauges.jsonl").read_text().splitlines()]
    assert gauges and all(isinstance(g["step"], int) for g in gauges)
    # The in-process engine side's summary. Engine.overlap is ``auto`` and the backend is the
    # CPU, so the schedule measures before it decides: it lets 1 step period settle, times 2
    # overlapped ones, skips the one that straddles the switch and times 2 sliced ones, so it
    # decides on its 6th step period, when step 7 starts. 3 steps make 2 periods: no decision.
    assert "overlap" in summary and summary["overlap"] is None
    # Every trained rollout within the staleness bound, and some were trained.
    ages = {int(a): n for a, n in summary["age_histogram"].items()}
    assert ages and max(ages) <= STALENESS and sum(ages.values()) > 0

    built = []
    build = warmup.build_trainer
    monkeypatch.setattr(
        warmup,
        "build_trainer",
        lambda p, kind, *a, **k: built.append(kind) or build(p, kind, *a, **k),
    )
    again = run(prepare(_config(5), wd))  # the same workdir, two more steps

    # A resumed full fine-tune takes every weight from its RL checkpoint: the warm-up stage
    # builds no trainer of its own (its weights would only be overwritten).
    assert built == []

    assert again["resumed_from_step"] == 3 and again["rl_steps"] == 5
    assert again["rl_steps_this_run"] == 2
    assert [r["step"] for r in _step_rows(wd)] == [1, 2, 3, 4, 5]  # appended, none repeated
    assert all(all(k in r for k in STEP_KEYS) for r in _step_rows(wd))
    assert _eval_steps(wd) == [0, 2, 3, 4, 5]
    assert checkpoints(wd) == [4, 5]  # max_to_keep = 2
    assert _rollout_steps(wd) == [1, 2, 3, 4, 5]
    ages = {int(a): n for a, n in again["age_histogram"].items()}
    assert ages and max(ages) <= STALENESS
    assert again["overlap"] is None  # a new schedule: 2 steps, 1 period, as above


def test_the_warm_up_weights_are_skipped_only_where_the_rl_checkpoint_replaces_them(tmp_path):
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)  # a resumed run
    assert warmup.rl_restores_every_weight(prepare(_config(5), tmp_path))
    # The warm-up's weights are the KL reference or the LoRA base there.
    for setting in ({"Loss.kl_beta": 0.1}, {"Lora.rank": 4}):
        cfg = toy_config({**_overrides(5), **setting})
        assert not warmup.rl_restores_every_weight(prepare(cfg, tmp_path)), setting
    assert not warmup.rl_restores_every_weight(prepare(_config(5), tmp_path / "fresh"))
