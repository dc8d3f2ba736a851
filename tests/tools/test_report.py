"""jaxrl_orch.tools.report (reading in report_data, figures in plots): plots and report.md from a
synthetic workdir."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from jaxrl_orch.tools import plots
from jaxrl_orch.tools.report import main, start_cost_text, write_report
from jaxrl_orch.tools.report_data import read_metrics, split_records

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
                    "restart": {"cold": False, "first_rollout_s": 9.5, "first_step_s": 15.06},
                    "compile_cache": {"dir": "/c", "hits": 38, "misses": 0},
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
    assert (
        "- warm start: first rollout 9.5 s, first train step 15.06 s after the command started; "
        "compile cache /c: 38 hits, 0 misses (100%)\n" in md
    )
    for name in names - {"report.md"}:
        assert f"]({name})" in md
    # Exact ages from the histogram: 35 rollouts, max 2, p99 2; bound 2 is respected.
    assert "max 2, p99 2 vs bound max_staleness = 2 (within bound)" in md
    assert "over 35 trained rollouts" in md
    # Per-env eval curve endpoints, including the kind-less lines.
    assert "`eval/arithmetic/reward_mean`: 0.25 at step 0 -> 0.5 at step 8" in md
    assert "`eval/reverse_text/reward_mean`: 0.2 at step 4 -> 0.4 at step 8" in md
    # No behaviour accounting in the summary: no section, no plot, no skip note.
    assert "Behaviour accounting" not in md and "behaviour.png" not in md


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
        [sys.executable, "-m", "jaxrl_orch.tools.report", str(workdir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {workdir / 'report.md'}" in proc.stdout
    assert "skipped timeline.png" in proc.stdout
    _assert_png(workdir / "reward.png")


def _legend(fig) -> list[str]:
    return fig.axes[0].get_legend_handles_labels()[1]


def _bars(fig, label: str) -> list:
    (container,) = [c for c in fig.axes[0].containers if c.get_label() == label]
    return list(container)


# A metric key leaking into a legend: a slash-path or a gauge/config name.
_KEY_LIKE = re.compile(r"/|_s\b|_mean\b|max_staleness|word_order|no_tags")


def test_timeline_draws_generate_and_train_as_parallel_lanes_not_stacked():
    # Lines without a kind: the step's orch line, then a timing line for that step.
    train = [
        {"step": 1, "orch/step_s": 2.0, "train/reward_mean": 0.1},
        {"step": 1, "time/generate_s": 1.5, "time/train_s": 1.25, "time/transfer_s": 0.25},
        {"step": 2, "orch/step_s": 1.75},
        {"step": 2, "time/generate_s": 1.0, "time/train_s": 1.5, "time/idle_s": 0.0},
        # A step without timing keys: no bars, no crash.
        {"step": 3, "orch/step_s": 3.0},
    ]
    fig = plots.timeline(train)
    gen, trn, xfer = (_bars(fig, w) for w in ("generation", "training", "weight transfer"))
    assert [r.get_width() for r in gen] == [1.5, 1.0]
    assert [r.get_width() for r in trn] == [1.25, 1.5]
    assert [r.get_width() for r in xfer] == [0.25]  # step 2 did not report a transfer
    for g, t in zip(gen, trn, strict=True):
        # Both start at the step's origin (stacking would start training where generation ends)
        # and sit in disjoint lanes of the same step's row.
        assert g.get_x() == t.get_x() == 0.0
        assert g.get_y() + g.get_height() <= t.get_y() and t.get_y() - g.get_y() < 1.0
    assert xfer[0].get_x() == 0.0 and xfer[0].get_y() >= trn[0].get_y() + trn[0].get_height()
    # The real step time is its own line across all steps; overlap shows as bars past it.
    (line,) = fig.axes[0].lines
    assert list(line.get_xdata()) == [2.0, 1.75, 3.0]
    assert list(line.get_ydata()) == [1.0, 2.0, 3.0]
    assert gen[0].get_width() + trn[0].get_width() > line.get_xdata()[0]
    labels = _legend(fig)
    assert {"generation", "training", "weight transfer"} < set(labels) and len(labels) == 4
    assert any(label.startswith("real step time") for label in labels)
    # idle_s is derived from an assumed overlap: it is not drawn as a phase.
    assert not any("idle" in label or _KEY_LIKE.search(label) for label in labels)
    assert fig.axes[0].get_ylabel() == "RL step" and "seconds" in fig.axes[0].get_xlabel()


def test_reward_legend_names_greedy_and_temperature_in_words():
    evals = {
        "eval/reverse_text/reward_mean": 0.2,
        "eval/reverse_text@t1/reward_mean": 0.1,
        "eval/reverse_text@t0.7/reward_mean": 0.15,
    }
    records = [
        {"step": 1, "kind": "train", "train/reward_mean": 0.1},
        {"step": 0, "kind": "eval", **evals},
    ]
    fig = plots.reward(records, {})
    labels = ["eval T=0.7", "eval T=1", "eval greedy", "train reward (sampled)"]
    assert sorted(_legend(fig)) == labels
    styles = {ln.get_label(): ln.get_linestyle() for ln in fig.axes[0].lines}
    assert styles["eval greedy"] == "-" and styles["eval T=1"] == "--"
    # Several envs: each curve also names its env; a sampled key without T takes the summary's.
    records[1] = {
        "step": 0,
        "eval/arithmetic/reward_mean": 0.3,
        "eval/reverse_text/reward_mean": 0.2,
        "eval/reverse_text/sampled_reward_mean": 0.1,
    }
    assert sorted(_legend(plots.reward(records, {"eval_temperature": 1.0}))) == [
        "eval T=1, reverse_text",
        "eval greedy, arithmetic",
        "eval greedy, reverse_text",
        "train reward (sampled)",
    ]
    no_t = [{"step": 0, "eval/reverse_text/sampled_reward_mean": 0.1}]
    assert _legend(plots.reward(no_t, {})) == ["eval sampled"]


def test_no_plot_legend_shows_a_metric_key(tmp_path):
    workdir = _write_workdir(tmp_path)
    summary = json.loads((workdir / "summary.json").read_text())
    summary["behaviour"] = _BEHAVIOUR
    records = read_metrics(workdir / "metrics.jsonl")
    _, rest, _, train = split_records(records)
    figs = [
        plots.reward(rest, summary),
        plots.age_hist(summary),
        plots.timeline(train),
        plots.behaviour(summary),
    ]
    for fig in figs:
        labels = _legend(fig)
        assert labels, fig.axes[0].get_title()
        for label in labels:
            assert not _KEY_LIKE.search(label), label
        assert fig.axes[0].get_xlabel() and fig.axes[0].get_ylabel()


_BEHAVIOUR = {
    "greedy": {
        "0": {"full": 0.2, "word_order": 0.7, "no_tags": 0.0, "other": 0.1},
        "10": {"full": 0.9, "word_order": 0.05, "no_tags": 0.0, "other": 0.05},
        "5": {"full": 0.5, "word_order": 0.4, "no_tags": 0.05, "other": 0.05},
    },
    "sampled": {
        "0": {"full": 0.15, "word_order": 0.6, "no_tags": 0.125, "other": 0.125},
        "5": {"full": 0.4, "word_order": 0.4, "no_tags": 0.1, "other": 0.1},
        "10": {"full": 0.8, "word_order": 0.1, "no_tags": 0.05, "other": 0.05},
    },
}


def _write_behaviour_run(workdir: Path, behaviour: dict | None) -> Path:
    workdir.mkdir(exist_ok=True)
    lines = [{"step": s, "kind": "train", "train/reward_mean": 0.1 * s} for s in range(1, 11)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"rl_steps": 10, "eval_temperature": 1.0}
    if behaviour is not None:
        summary["behaviour"] = behaviour
    (workdir / "summary.json").write_text(json.dumps(summary))
    return workdir


def test_behaviour_table_and_plot(tmp_path):
    workdir = _write_behaviour_run(tmp_path, _BEHAVIOUR)
    result = write_report(workdir)
    assert result["written"]["behaviour.png"] == workdir / "behaviour.png"
    _assert_png(workdir / "behaviour.png")
    md = (workdir / "report.md").read_text()
    assert "## Behaviour accounting" in md and "](behaviour.png)" in md
    assert '"full" = the full character reversal (the rewarded behaviour)' in md
    assert '"word_order" = words in reverse order spelled forwards' in md
    assert '"no_tags" = no answer tags (scores 0)' in md and '"other" = anything else' in md
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table[0] == (
        "| eval step | full (greedy) | full (sampled T=1) | word_order (greedy) | "
        "word_order (sampled T=1) | no_tags (greedy) | no_tags (sampled T=1) | other (greedy) | "
        "other (sampled T=1) |"
    )
    # One row per eval step, in numeric (not string) order, greedy then sampled per behaviour.
    assert table[2:] == [
        "| 0 (before RL) | 20.0% | 15.0% | 70.0% | 60.0% | 0.0% | 12.5% | 10.0% | 12.5% |",
        "| 5 | 50.0% | 40.0% | 40.0% | 40.0% | 5.0% | 10.0% | 5.0% | 10.0% |",
        "| 10 (final) | 90.0% | 80.0% | 5.0% | 10.0% | 0.0% | 5.0% | 5.0% | 5.0% |",
    ]
    fig = plots.behaviour(json.loads((workdir / "summary.json").read_text()))
    lines = {ln.get_label(): ln for ln in fig.axes[0].lines}
    assert len(lines) == 8
    full_g, full_s = lines["full reversal, greedy"], lines["full reversal, sampled T=1"]
    assert full_g.get_linestyle() == "-" and full_s.get_linestyle() == "--"
    assert full_g.get_color() == full_s.get_color()
    assert list(full_g.get_xdata()) == [0, 5, 10]
    assert list(full_g.get_ydata()) == pytest.approx([20.0, 50.0, 90.0])
    assert list(full_s.get_ydata()) == pytest.approx([15.0, 40.0, 80.0])


def test_behaviour_absent_single_eval_or_malformed(tmp_path):
    workdir = _write_behaviour_run(tmp_path / "absent", None)
    result = write_report(workdir)
    assert "behaviour.png" not in result["written"] and "behaviour.png" not in result["skipped"]
    assert "Behaviour" not in (workdir / "report.md").read_text()

    # Only greedy, only the eval before RL: a table row, no plot (no curve to draw).
    one = {"greedy": {"0": {"full": 0.25, "other": 0.75}}}
    workdir = _write_behaviour_run(tmp_path / "one", one)
    result = write_report(workdir)
    assert "two eval steps" in result["skipped"]["behaviour.png"]
    assert not (workdir / "behaviour.png").exists()
    md = (workdir / "report.md").read_text()
    assert "| eval step | full (greedy) | other (greedy) |" in md
    assert "| 0 (before RL) | 25.0% | 75.0% |" in md

    workdir = _write_behaviour_run(tmp_path / "bad", {"greedy": {"final": {"full": 1.0}}})
    with pytest.raises(ValueError, match="summary.json behaviour"):
        write_report(workdir)


@pytest.mark.parametrize("case", ["no_dir", "no_summary", "bad_metrics"])
def test_cli_bad_workdir_is_one_line_exit_2(tmp_path, capsys, case):
    workdir = tmp_path / "run"
    named = f"{workdir}: no such directory"
    if case != "no_dir":
        workdir.mkdir()
        (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
        named = f"{workdir / 'summary.json'}: not found"
    if case == "bad_metrics":
        (workdir / "summary.json").write_text("{}")
        (workdir / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
        named = f"{workdir / 'metrics.jsonl'}:2: not valid JSON"
    with pytest.raises(SystemExit) as exc:
        main([str(workdir)])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("python -m jaxrl_orch.tools.report: error: ") and named in err
    assert "expected a finished run directory holding summary.json and metrics.jsonl" in err
    assert not (workdir / "report.md").exists()


def test_the_reports_line_names_the_cache_and_its_hit_rate():
    summary = {
        "restart": {"cold": True, "first_rollout_s": 23.3, "first_step_s": None},
        "compile_cache": {"dir": "/c", "hits": 1, "misses": 3},
    }
    assert start_cost_text(summary) == (
        "cold start: first rollout 23.3 s, first train step n/a after the command started; "
        "compile cache /c: 1 hits, 3 misses (25%)"
    )
    assert start_cost_text({}) is None
    summary["compile_cache"]["executables"] = {"loaded": 17, "stored": 0, "compiled": 0}
    assert start_cost_text(summary).endswith(
        "compile cache /c: 1 hits, 3 misses (25%); programs kept whole: 17 loaded, 0 stored"
    )
