"""jaxrl_orch.report: plots and report.md from a synthetic workdir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from jaxrl_orch.report import read_metrics, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train_line(step: int, timeline: bool = True) -> dict:
    line = {
        "step": step,
        "kind": "train",
        "train/reward_mean": 0.1 * step,
        "orch/age_max": float(step % 3),
        "orch/age_p50": 1.0,
        "orch/age_p99": float(step % 3),
        "orch/step_s": 2.5,
    }
    if timeline:
        line.update(
            {
                "time/generate_s": 1.5,
                "time/train_s": 0.75,
                "time/transfer_s": 0.125,
                "time/idle_s": 0.125,
            }
        )
    return line


def _write_workdir(
    tmp_path: Path, *, timeline: bool = True, sft: bool = True, summary: bool = True
) -> Path:
    lines = []
    if sft:
        lines += [{"kind": "sft", "sft/step": i, "sft/loss": 2.0 / (i + 1)} for i in range(5)]
    for step in range(1, 9):
        lines.append(_train_line(step, timeline))
        if step % 4 == 0:
            lines.append(
                {
                    "step": step,
                    "kind": "eval",
                    "eval/reverse_text/reward_mean": 0.05 * step,
                    "eval/reverse_text/sampled_reward_mean": 0.04 * step,
                }
            )
    # Writers without a "kind" field must still be classified by their keys.
    lines.append({"step": 0, "eval/arithmetic/reward_mean": 0.25})
    lines.append({"step": 8, "eval/arithmetic/reward_mean": 0.5})
    text = "\n".join(json.dumps(x) for x in lines) + "\n\n"  # a trailing blank line is fine
    (tmp_path / "metrics.jsonl").write_text(text)
    if summary:
        (tmp_path / "summary.json").write_text(
            json.dumps(
                {
                    "eval_reward_before_rl": 0.123,
                    "eval_reward_final": 0.8765,
                    "eval_temperature": 1.0,
                    "eval_sampled_reward_before_rl": 0.0456,
                    "eval_sampled_reward_final": 0.789,
                    "rl_steps": 8,
                    "wall_seconds": 321.5,
                    "max_staleness": 2,
                    "age_histogram": {"0": 10, "1": 20, "2": 5},
                }
            )
        )
    return tmp_path


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0


def test_full_report_writes_all_plots_and_numbers(tmp_path):
    workdir = _write_workdir(tmp_path)
    result = write_report(workdir)

    names = {"reward.png", "age_hist.png", "timeline.png", "sft_loss.png", "report.md"}
    assert set(result["written"]) == names
    assert result["skipped"] == {}
    for name in names - {"report.md"}:
        assert result["written"][name] == workdir / name
        _assert_png(workdir / name)

    md = (workdir / "report.md").read_text()
    assert "0.123" in md and "0.8765" in md
    assert "sampled eval reward (T=1): 0.0456 before RL -> 0.789 final" in md
    assert "RL steps: 8" in md
    assert "321.5 s" in md
    for name in names - {"report.md"}:
        assert f"]({name})" in md
    # Exact ages from the histogram: 35 rollouts, max 2, p99 2; bound 2 is respected.
    assert "max 2, p99 2 vs bound max_staleness = 2 (within bound)" in md
    assert "over 35 trained rollouts" in md
    # Per-env eval curve endpoints, including the kind-less lines.
    assert "`eval/arithmetic/reward_mean`: 0.25 at step 0 -> 0.5 at step 8" in md
    assert "`eval/reverse_text/reward_mean`: 0.2 at step 4 -> 0.4 at step 8" in md


def test_age_over_bound_is_flagged(tmp_path):
    workdir = _write_workdir(tmp_path)
    summary = json.loads((workdir / "summary.json").read_text())
    summary["age_histogram"] = {"0": 90, "1": 9, "4": 1}
    summary["max_staleness"] = 1
    (workdir / "summary.json").write_text(json.dumps(summary))
    write_report(workdir)
    md = (workdir / "report.md").read_text()
    assert "max 4" in md and "exceeds bound" in md


def test_without_timeline_keys_skips_timeline_and_says_so(tmp_path):
    workdir = _write_workdir(tmp_path, timeline=False, sft=False)
    result = write_report(workdir)
    assert "timeline.png" in result["skipped"]
    assert not (workdir / "timeline.png").exists()
    assert "timeline.png" not in result["written"]
    # An RL-only run has no SFT plot and nothing to apologise for.
    assert "sft_loss.png" not in result["written"] and "sft_loss.png" not in result["skipped"]
    _assert_png(workdir / "reward.png")
    md = (workdir / "report.md").read_text()
    assert "`timeline.png` skipped" in md and "time/generate_s" in md


def test_without_summary_falls_back_to_metrics(tmp_path):
    workdir = _write_workdir(tmp_path, summary=False)
    result = write_report(workdir)
    assert "age_hist.png" in result["skipped"]
    md = (workdir / "report.md").read_text()
    assert "`age_hist.png` skipped" in md
    assert "eval reward before RL: **n/a**" in md
    assert "RL steps: 8 (counted from metrics.jsonl)" in md
    # Worst per-step gauges: orch/age_max cycles 1, 2, 0, ... so the max is 2.
    assert "max 2, p99 2 vs bound max_staleness = n/a" in md
    assert "per-step gauges" in md


def test_metrics_with_no_known_keys_skips_every_plot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "other/x": 1.0}) + "\n")
    result = write_report(tmp_path)
    assert set(result["written"]) == {"report.md"}
    assert set(result["skipped"]) == {"reward.png", "age_hist.png", "timeline.png"}
    assert "off-policy age: not reported" in (tmp_path / "report.md").read_text()


def test_missing_metrics_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
        write_report(tmp_path)


def test_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: expected a JSON object"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"step": \n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
        read_metrics(path)


def test_cli_writes_report(tmp_path):
    workdir = _write_workdir(tmp_path, timeline=False)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_orch.report", str(workdir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {workdir / 'report.md'}" in proc.stdout
    assert "skipped timeline.png" in proc.stdout
    _assert_png(workdir / "reward.png")
