"""lm-evaluation-harness scoring the live policy while the train command trains
(``HarnessEval``): real lm-eval (the ``evals`` extra), run by the stage against the run's own
live server (``Engine.serve_port = 0``) on task files and data written here, offline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from support.train_cmd import all_rows, train_cmd, train_env

pytestmark = pytest.mark.slow  # the train command plus up to three lm-eval runs: ~2 min

MC = [
    {"question": "the cat sat on the", "choices": [" mat", " moon"], "answer": 0},
    {"question": "Reverse: abc", "choices": [" cba", " abc"], "answer": 0},
]
GEN = [{"prompt": "Reverse: stop", "target": "pots"}, {"prompt": "Reverse: ab", "target": "ba"}]


def _task(directory, name, rows, **spec) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}
    task = {"task": name, **files, "test_split": "test", **spec}
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(task))


def _tasks(directory) -> None:
    directory.mkdir()
    _task(
        directory,
        "jaxrl_mc",
        MC,
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_choice="choices",
        doc_to_target="answer",
        target_delimiter="",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    _task(
        directory,
        "jaxrl_gen",
        GEN,
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{target}}",
        generation_kwargs={"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )


def test_harness_tasks_score_the_live_policy_into_the_runs_metrics(tmp_path):
    _tasks(tmp_path / "tasks")
    wd = tmp_path / "run"
    params = [
        "RL.steps = 3",
        "Engine.serve_port = 0",
        "HarnessEval.tasks = ('jaxrl_mc', 'jaxrl_gen')",
        "HarnessEval.every = 1",
        f"HarnessEval.include_path = '{tmp_path / 'tasks'}'",
        "HarnessEval.concurrent = 2",
    ]
    env = dict(train_env(1), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["HF_HOME"] = str(tmp_path / "hf")  # the json datasets' cache, not the user's
    cmd = train_cmd(wd, *params)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((wd / "summary.json").read_text())["harness_eval"]
    # Every due step either ran or, while the one before still ran, was skipped: none failed.
    assert summary["failed"] == 0 and summary["runs"] >= 1
    assert summary["runs"] + summary["skipped"] == 3, summary
    rows = [r for r in all_rows(wd) if "harness/version_first" in r]
    assert len(rows) == summary["runs"]
    for row in rows:
        assert 0.0 <= row["harness/jaxrl_mc/acc"] <= 1.0
        assert 0.0 <= row["harness/jaxrl_gen/exact_match"] <= 1.0
        # the versions the run had reached while the harness scored: at most the step's own
        assert 0 <= row["harness/version_first"] <= row["harness/version_last"] <= 3
        log = wd / "harness" / f"step_{row['step']}" / "lm_eval.log"
        assert "jaxrl_mc" in log.read_text()
    said = [line for line in res.stdout.splitlines() if line.startswith("== harness eval: step")]
    assert len(said) == summary["runs"] + summary["skipped"], said
    assert all(
        "jaxrl_mc/acc " in line and "version_last " in line for line in said if "skip" not in line
    )


def test_harness_tasks_without_lm_eval_are_refused_before_the_first_rollout(tmp_path):
    # lm-eval hidden from the run's import system: what a host without the extra sees
    hide = "import sys; sys.modules['lm_eval'] = None; from jaxrl_orch.train import cli; "
    hide += "sys.exit(cli(sys.argv[1:]))"
    wd = tmp_path / "run"
    args = train_cmd(wd, "RL.steps = 2", "Engine.serve_port = 0", "HarnessEval.tasks = ('x',)")
    res = subprocess.run(
        [sys.executable, "-c", hide, *args[3:]],
        env=train_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode != 0
    assert "lm-evaluation-harness, which is not installed: pip install 'jaxrl-orch[evals]'" in (
        res.stderr
    )
    assert (
        not (wd / "metrics.jsonl").exists()
        or "train/reward_mean" not in (wd / "metrics.jsonl").read_text()
    )
