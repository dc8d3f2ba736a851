"""End-to-end: ``python -m jaxrl_orch.train`` as a user runs it, on small fast configs.

Each test runs the real command in a subprocess (real engine, trainer, orchestrator, data,
checkpoints) with a tiny scenario: a few SFT steps, a few RL steps, short completions. The model
does not learn anything in that time; these tests check the plumbing, the faults and resume.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from support.train_cmd import all_rows, checkpoints, rl_rows, run_train, train_cmd, train_env

pytestmark = pytest.mark.slow

DIAGNOSTICS = (
    "trainer/loss",
    "trainer/entropy",
    "trainer/approx_kl",  # KL of the updated policy to the behaviour (old) policy
    "trainer/mismatch_kl",  # trainer vs engine log-probs of the same tokens
    "trainer/clip_low",
    "trainer/clip_high",
    "trainer/grad_norm",
    "trainer/lr",
    "trainer/tis_capped",
)


def test_split_placement_run_writes_metrics_checkpoints_and_report(tmp_path):
    wd = tmp_path / "run"
    # Time-sliced: the engine pauses during every train step and still serves every rollout.
    res = run_train(wd, "RL.steps = 3", "Engine.overlap = 'sliced'", devices=2)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["overlap"] == {"mode": "sliced"}
    for key in ("eval_reward_before_rl", "eval_reward_final", "rl_steps", "wall_seconds"):
        assert key in summary, key
    assert summary["rl_steps"] == 3 and summary["resumed_from_step"] is None
    assert [r["step"] for r in rl_rows(wd)] == [1, 2, 3]
    # Exactly one row per RL step (plus eval and warm-up rows), carrying what the loop saw at
    # ship time and the trainer's diagnostics of that same step.
    rl = [r for r in all_rows(wd) if not any(k.startswith(("eval/", "sft/")) for k in r)]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in DIAGNOSTICS:
        assert all(key in r for r in rl), key
    assert all(r["trainer/version"] == r["step"] for r in rl)
    # The timeline's phases per step, and the behaviour shares of every eval.
    assert all(r["time/train_s"] == r["trainer/step_s"] for r in rl)
    evals = [r for r in all_rows(wd) if "eval/reverse_text/reward_mean" in r]
    shares = [sum(v for k, v in r.items() if "/behaviour/" in k and "@" not in k) for r in evals]
    assert shares == pytest.approx([1.0] * len(evals))
    assert set(summary["behaviour"]["greedy"]) == {"0", "2", "3"}
    assert set(summary["behaviour"]["sampled"]["0"]) >= {"full", "word_order", "no_tags", "other"}
    # TensorBoard gets the step and eval rows (rewards, evals, ages, diagnostics), not only
    # the periodic gauges.
    assert any(p.name.startswith("events.") for p in (wd / "tb" / "steps").iterdir())
    for header in ("== data:", "== warm-up:", "== RL:", "== final eval:", "== export:"):
        assert header in res.stdout, header
    assert set(summary["eval_rewards"]) == {"0", "2", "3"}
    # The same held-out set is also sampled at the training temperature, on the same schedule.
    sampled = [r for r in all_rows(wd) if "eval/reverse_text@t1/reward_mean" in r]
    assert [r["step"] for r in sampled] == [0, 2, 3]
    assert summary["eval_sampled_reward_final"] == sampled[-1]["eval/reverse_text@t1/reward_mean"]
    assert checkpoints(wd)[-1] == 3
    assert sorted(p.name for p in (wd / "rollouts").glob("step_*"))[:1] == ["step_00000001.jsonl"]
    assert [p.name for p in (wd / "rollouts" / "journal").iterdir()] == ["epoch_000001.jsonl"]
    for name in ("report.md", "reward.png", "age_hist.png", "timeline.png", "config.gin"):
        assert (wd / name).stat().st_size > 0, name
    # The final policy, as an HF checkpoint of the trainer's last version.
    assert summary["export_dir"] == str(wd / "export")
    assert json.loads((wd / "export" / "config.json").read_text())["hidden_size"] == 128
    assert (wd / "export" / "model.safetensors").stat().st_size > 0
    assert (wd / "export" / "tokenizer.json").is_file()  # the byte tokenizer, for transformers
    assert "RL.steps = 3" in (wd / "config.gin").read_text()
    assert max(int(a) for a in summary["age_histogram"]) <= 1  # the default bound S = 1


@pytest.mark.parametrize(
    "param, needle",
    [
        ("TrainConfig.no_such_setting = 1", "no_such_setting"),
        ("Trainer.mesh = (('fsdp', 16),)", "need"),
        ("Data.dataset = 'no_such_dataset'", "no_such_dataset"),
        ("Data.dataset = 'text:/no/such/corpus.txt'", "corpus.txt"),
        ("Model.name = '/no/such/model_dir'", "model_dir"),
        ("Orchestrator.age_policy = 'yolo'", "yolo"),
        ("Trainer.row_len = 96", "a warm-up sample (prompt + demonstration + EOS) has"),
    ],
)
def test_bad_config_fails_before_any_work_naming_the_value(tmp_path, param, needle):
    wd = tmp_path / "bad"
    res = run_train(wd, param, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert needle in res.stderr
    assert not (wd / "metrics.jsonl").exists()


def test_sigterm_drains_checkpoints_and_exits_zero(tmp_path):
    wd = tmp_path / "term"
    proc = subprocess.Popen(
        train_cmd(wd, "RL.steps = 200"),
        env=train_env(1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not ((wd / "metrics.jsonl").exists() and rl_rows(wd)):
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)  # bounded drain
    finally:
        proc.kill()
    assert rc == 0, proc.stderr.read()[-2000:]
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["stopped_by_signal"] == signal.SIGTERM
    assert 1 <= summary["rl_steps"] < 200
    assert checkpoints(wd)[-1] == summary["rl_steps"]  # the drain ended on a checkpoint


def _kill9_past_a_checkpoint(wd, *params: str) -> int:
    """Run the command, kill -9 it once a step past its newest checkpoint is on record (rows
    the resume must trim); returns the step it will resume from."""
    proc = subprocess.Popen(
        train_cmd(wd, *params),
        env=train_env(1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not (checkpoints(wd) and rl_rows(wd)[-1:]) or (
            rl_rows(wd)[-1]["step"] <= checkpoints(wd)[-1]
        ):
            assert proc.poll() is None, "run ended before its first checkpoint"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return checkpoints(wd)[-1]


def test_kill9_then_resume_continues_without_repeating_or_skipping(tmp_path):
    wd = tmp_path / "crash"
    steps = ["RL.steps = 8"]
    resumed_at = _kill9_past_a_checkpoint(wd, *steps)
    assert resumed_at < 8, "the run finished before it could be killed"
    assert max(r["step"] for r in rl_rows(wd)) > resumed_at  # rows the resume must trim

    res = run_train(wd, *steps)  # the same command again
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["resumed_from_step"] == resumed_at
    assert summary["rl_steps"] == 8 and summary["rl_steps_this_run"] == 8 - resumed_at
    # The engine held the restored weights before its first rollout: every model token of the
    # first batch after the resume was sampled from version >= the restored one, except those
    # of rollouts that had finished before the kill (the journal keeps them, with their own
    # versions, within the bound S = 1).
    first = wd / "rollouts" / f"step_{resumed_at + 1:08d}.jsonl"
    kept = summary["restart"]["rollouts"]
    for line in first.read_text().splitlines():
        rec = json.loads(line)
        versions = [v for v, m in zip(rec["versions"], rec["loss_mask"], strict=True) if m]
        assert versions and min(versions) >= resumed_at - 1
        assert min(versions) >= resumed_at or kept["kept"] + kept["trained_before"] > 0
    # No rollout trained twice across the attempts (slot: group ordinal, index in the group).
    slots = [
        tuple(json.loads(line)["slot"])
        for f in sorted((wd / "rollouts").glob("step_*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert len(slots) == len(set(slots)) == 8 * 8
    assert checkpoints(wd)[-1] == 8
    # Every RL step and every eval exactly once across both attempts; the pre-RL eval kept.
    assert [r["step"] for r in rl_rows(wd)] == list(range(1, 9))
    evals = [
        (r["step"], k)
        for r in all_rows(wd)
        for k in r
        if k.endswith("/reward_mean") and "eval/" in k
    ]
    assert len(evals) == len(set(evals)) and {s for s, _ in evals} == {0, 2, 4, 6, 8}
    assert summary["eval_reward_before_rl"] is not None
    assert summary["train_reward_first"] == rl_rows(wd)[0]["train/reward_mean"]  # from step 1

    # The same command once more, on the finished run: nothing runs, and every file (metrics,
    # gauges, rollouts, TensorBoard, summary, report, export) stays as it was, so each step
    # and eval is still in the history once. Only the owner record names the new claim.
    files = {p: p.read_bytes() for p in sorted(wd.rglob("*")) if p.is_file()}
    res = run_train(wd, *steps)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"== finished: workdir {wd} holds a complete run of 8 RL steps" in res.stdout
    after = {p: p.read_bytes() for p in sorted(wd.rglob("*")) if p.is_file()}
    assert after.pop(wd / "run.lock") != files.pop(wd / "run.lock")
    assert after == files


def test_a_lora_run_moves_adapters_only_resumes_after_kill9_and_exports_peft(tmp_path):
    wd = tmp_path / "lora"
    params = ["RL.steps = 6", "Lora.rank = 2", "Lora.targets = ('q', 'v', 'down')"]
    resumed_at = _kill9_past_a_checkpoint(wd, *params)
    assert resumed_at < 6
    res = run_train(wd, *params)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "== weights: LoRA rank 2 on q, v, down:" in res.stdout
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["resumed_from_step"] == resumed_at
    assert [r["step"] for r in rl_rows(wd)] == list(range(1, 7))  # every step once
    # tiny-byte's rank-2 adapters per layer: q 128x2 + 2x128, v 128x2 + 2x64, down 512x2 +
    # 2x128 = 2,176 float32 params; 4 layers.
    assert {r["transfer/bytes"] for r in rl_rows(wd)} == {2176 * 4 * 4}
    export = wd / "export"
    assert (export / "model.safetensors").stat().st_size > 0  # merged, every weight
    config = json.loads((export / "lora" / "adapter_config.json").read_text())
    assert config["r"] == 2 and sorted(config["target_modules"]) == [
        "down_proj",
        "q_proj",
        "v_proj",
    ]
    assert config["base_model_name_or_path"] == str((export / "lora" / "base").resolve())
    assert (export / "lora" / "base" / "config.json").is_file()


def test_sigterm_in_the_warm_up_keeps_its_progress_and_resumes_there(tmp_path):
    wd = tmp_path / "warm"
    params = ["Warmup.steps = 60", "Warmup.checkpoint_every = 5"]
    params += ["RL.steps = 1"]
    proc = subprocess.Popen(
        train_cmd(wd, *params),
        env=train_env(1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (wd / "metrics.jsonl").exists() or len(all_rows(wd)) < 12:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert rc == 0, proc.stderr.read()[-2000:]
    stopped = json.loads((wd / "summary.json").read_text())
    ran = int(stopped["sft_steps"])
    assert 12 <= ran < 60  # the steps that ran, not the setting
    saved = sorted(int(p.name) for p in (wd / "sft").iterdir() if p.name.isdigit())
    assert saved == [ran]  # the stop itself was checkpointed, not only the last multiple of 5

    res = run_train(wd, *params)  # the same command continues the warm-up where it stopped
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["sft_resumed_from_step"] == ran
    sft_steps = [r["step"] for r in all_rows(wd) if "sft/loss" in r]
    assert sft_steps == list(range(1, 61))  # each warm-up step exactly once across both runs


def test_imitation_control_from_a_saved_warm_up(tmp_path):
    """after_warmup='sft' spends the RL stage's updates on SFT and reports like an RL run."""
    base = tmp_path / "base"
    assert run_train(base, "RL.steps = 1").returncode == 0
    wd = tmp_path / "imitation"
    res = run_train(
        wd,
        f"Warmup.from_workdir = '{base}'",
        "RL.after_warmup = 'sft'",
        "RL.steps = 4",
        "RL.minibatches = 2",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["control_updates"] == 8  # rl_steps * minibatches optimizer updates
    assert set(summary["eval_rewards"]) == {"0", "2", "4"}
    assert set(summary["behaviour"]["greedy"]) == {"0", "2", "4"}
    # Warm-up restored from the base run: its eval before the control is the same policy's.
    before = json.loads((base / "summary.json").read_text())["eval_reward_before_rl"]
    assert summary["eval_reward_before_rl"] == pytest.approx(before)
    updates = [r["sft/update"] for r in all_rows(wd) if "sft/update" in r]
    assert updates == list(range(1, 9))
    assert not (wd / "checkpoints").exists()  # no RL stage ran
