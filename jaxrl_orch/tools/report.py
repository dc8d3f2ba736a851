"""Run report: turn a run's workdir into PNG plots and a short ``report.md``.

What it owns: reading ``WORKDIR/metrics.jsonl`` (one JSON object per line, as the JSONL metrics
writer appends them) and ``WORKDIR/summary.json`` (end-of-run facts: ``eval_reward_before_rl``,
``eval_reward_final``, ``rl_steps``, ``wall_seconds``, ``age_histogram`` as ``{age: count}``,
``max_staleness``, ``behaviour`` as ``{mode: {eval step: {behaviour: share}}}``), and writing
next to them ``reward.png``, ``age_hist.png``, ``timeline.png``, ``behaviour.png`` (two or more
eval steps), ``sft_loss.png`` (if the run had SFT) and ``report.md`` (eval reward before/after,
steps, wall time, age max/p99 against the bound, behaviour table, plots). Legends are words, not
metric keys; greedy eval ``eval/<env>/...`` is solid, sampled ``eval/<env>@t<T>/...`` dashed.

The timeline draws, per RL step, ``time/generate_s``, ``time/train_s`` and ``time/transfer_s``
as bars in separate lanes from the step's start and the real step time ``orch/step_s`` as a line;
never stacked: an asynchronous run generates while it trains, so phases sum to more than the
step; bars longer together than the line ran in parallel. Durations are logged, start times not.

Invariants: a line is classified by its ``"kind"`` (``train``/``eval``/``sft``), else by its
keys (``sft/loss``; ``eval/<env>/...``; ``train/``, ``orch/``, ``time/``); the timeline merges
a step's lines (its timing line follows its ``orch/`` line). A plot whose inputs are absent is
skipped, with the reason in ``report.md`` and the returned dict. Malformed input raises
``ReportInputError`` (a ``ValueError``) naming the file (and line), a missing ``metrics.jsonl``
``FileNotFoundError``. ``write_report`` also takes a running workdir (ages then come from the
``orch/age_*`` gauges); the CLI wants a finished run, else one line on stderr, exit 2. Figures
render in memory (Agg, never ``pyplot``) and go through ``paths`` (``gs://`` too). It reads
files only (it runs on a laptop) and never recomputes facts the run owns (ages, rewards).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxrl_orch.paths import as_path

# key -> (legend, lane bottom and height within the step's row): disjoint lanes, no stacking.
TIMELINE_LANES = {
    "time/generate_s": ("generation", -0.40, 0.36),
    "time/train_s": ("training", -0.02, 0.30),
    "time/transfer_s": ("weight transfer", 0.30, 0.10),
}
# behaviour -> (legend words, meaning in the report); unknown behaviours are shown by name.
BEHAVIOURS = {
    "full": ("full reversal", "the full character reversal (the rewarded behaviour)"),
    "word_order": ("word order reversed", "words in reverse order spelled forwards"),
    "no_tags": ("no answer tags", "no answer tags (scores 0)"),
    "other": ("other", "anything else"),
}
_TRAIN_PREFIXES = ("train/", "orch/", "time/")
_DPI = 100


class ReportInputError(ValueError):
    """A metrics or summary file that is not shaped as this module expects."""


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{where}: not valid JSON ({e.msg})") from e
    if not isinstance(obj, dict):
        raise ReportInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a metrics JSONL file; blank lines are ignored, anything else must be an object."""
    path = as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    with path.open() as f:
        return [_json_object(line, f"{path}:{i}") for i, line in enumerate(f, 1) if line.strip()]


def _num(v: Any) -> float | None:
    """A finite-or-NaN float for numeric values; None for anything else (bools included)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _series(records: Sequence[dict], key: str, x_key: str = "step") -> tuple[list, list]:
    pairs = [(_num(r.get(x_key)), _num(r.get(key))) for r in records]
    # NaN gauges (a step with nothing to measure) are gaps, not points.
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None and math.isfinite(y)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _split(records: Sequence[dict]) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """``(sft, rest, evals, train)``; ``rest`` is every line that is not SFT."""
    is_kind = lambda r, kind, by_keys: r["kind"] == kind if r.get("kind") is not None else by_keys
    sft, rest = [], []
    for r in records:
        (sft if r.get("kind") == "sft" or "sft/loss" in r else rest).append(r)
    # Without a kind, one line may carry both a step's training gauges and its eval results.
    evals = [r for r in rest if is_kind(r, "eval", bool(_eval_keys([r])))]
    train = [r for r in rest if is_kind(r, "train", any(k.startswith(_TRAIN_PREFIXES) for k in r))]
    return sft, rest, evals, train


def _eval_keys(records: Sequence[dict]) -> list[str]:
    ends = ("/reward_mean", "/sampled_reward_mean")
    return sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith(ends)})


def _eval_label(key: str, keys: Sequence[str], temperature: Any) -> str:
    """``eval/<env>@t1/reward_mean`` -> "eval T=1"; the env is named only if there are several."""
    env, metric = key.removeprefix("eval/").rsplit("/", 1)
    base, _, temp = env.partition("@t")
    if not temp and metric == "sampled_reward_mean":  # legacy key: the summary's temperature
        temp = "" if _num(temperature) is None else f"{temperature:g}"
    mode = f"eval T={temp}" if temp else "eval sampled" if "sampled" in metric else "eval greedy"
    bases = {k.removeprefix("eval/").rsplit("/", 1)[0].partition("@t")[0] for k in keys}
    return mode if len(bases) <= 1 else f"{mode}, {base}"


def _figure(size: tuple[float, float], xlabel: str, ylabel: str, title: str) -> tuple:
    fig = Figure(figsize=size)
    ax = fig.add_subplot(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return fig, ax


def _plot_reward(records: Sequence[dict], summary: dict) -> Figure | str:
    train_x, train_y = _series(records, "train/reward_mean")
    keys = _eval_keys(records)
    if not train_y and not keys:
        return "no `train/reward_mean` or `eval/<env>/reward_mean` values"
    fig, ax = _figure((8, 4.5), "RL step", "mean reward", "Reward")
    if train_y:
        ax.plot(train_x, train_y, color="0.6", lw=1, label="train reward (sampled)")
    for key in keys:
        style = "--" if key.endswith("/sampled_reward_mean") or "@t" in key else "-"
        label = _eval_label(key, keys, summary.get("eval_temperature"))
        ax.plot(*_series(records, key), style, marker="o", ms=3, label=label)
    ax.legend(fontsize="small")
    return fig


def _age_histogram(summary: dict) -> dict[int, int] | None:
    raw = summary.get("age_histogram")
    if not isinstance(raw, dict) or not raw:
        return None
    try:
        return {int(age): int(count) for age, count in raw.items()}
    except (TypeError, ValueError) as e:
        raise ReportInputError(f"summary.json age_histogram is not {{age: count}}: {e}") from e


def _bound(summary: dict) -> float | None:
    b = _num(summary.get("max_staleness"))
    if b is None and isinstance(summary.get("config"), dict):
        b = _num(summary["config"].get("max_staleness"))
    return b


def _plot_age_hist(summary: dict) -> Figure | str:
    hist = _age_histogram(summary)
    if hist is None:
        return "summary.json has no `age_histogram`"
    ages = sorted(hist)
    fig, ax = _figure((6, 4), "off-policy age of rollout head (policy versions)",
                      "trained rollouts", "Observed off-policy age")  # fmt: skip
    ax.bar(ages, [hist[a] for a in ages], width=0.8, color="tab:blue", label="trained rollouts")
    bound = _bound(summary)
    if bound is not None:
        # Drawn between bars: ages up to the bound are allowed, anything right of it is not.
        ax.axvline(bound + 0.5, color="tab:red", ls="--", label=f"allowed age bound ({bound:g})")
        ax.set_xlim(min(ages[0], bound) - 0.6, max(ages[-1], bound + 0.5) + 0.6)
    ax.set_xticks(ages)
    ax.legend(fontsize="small")
    return fig


def _plot_timeline(train: Sequence[dict]) -> Figure | str:
    merged: dict[float, dict] = {}
    for rec in (r for r in train if _num(r.get("step")) is not None):
        merged.setdefault(float(rec["step"]), {}).update(rec)  # later lines of a step add keys
    rows = [merged[s] for s in sorted(merged)]
    if not any(_num(r.get(k)) is not None for r in rows for k in TIMELINE_LANES):
        return "no " + ", ".join(f"`{k}`" for k in TIMELINE_LANES) + " in the training lines"
    fig, ax = _figure((9, min(12.0, 2.0 + 0.35 * len(rows))), "seconds from the start of the step",
                      "RL step", "Phase durations per step vs real step time\n"
                      "(generation + training longer than the step: they overlapped)")  # fmt: skip
    for key, (label, bottom, height) in TIMELINE_LANES.items():
        # A step without this phase's key (older runs) gets no bar in its lane.
        steps, secs = _series(rows, key)
        if secs:
            ax.barh(np.add(steps, bottom), secs, height, left=0.0, align="edge", label=label)
    steps, step_s = _series(rows, "orch/step_s")
    if step_s:
        label = "real step time (between shipped batches)"
        ax.plot(step_s, steps, color="black", marker="|", ms=14, lw=1, label=label)
    ax.invert_yaxis()  # first step on top, read like a log
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _behaviour(summary: dict) -> tuple[dict[str, dict[int, dict]], list[str]] | None:
    """``({mode words: {step: {behaviour: share}}}, behaviour names)``, greedy first."""
    if not summary.get("behaviour"):
        return None
    t = _num(summary.get("eval_temperature"))
    words = {} if t is None else {"sampled": f"sampled T={t:g}"}
    try:
        shares = {
            words.get(m, m): {int(s): {b: float(v) for b, v in by.items()} for s, by in st.items()}
            for m, st in sorted(summary["behaviour"].items(), key=lambda kv: kv[0] != "greedy")
        }
    except (AttributeError, TypeError, ValueError) as e:
        raise ReportInputError(
            f"summary.json behaviour is not {{mode: {{step: shares}}}}: {e}"
        ) from e
    seen = {b for st in shares.values() for by in st.values() for b in by}
    return shares, [b for b in BEHAVIOURS if b in seen] + sorted(seen - set(BEHAVIOURS))


def _plot_behaviour(summary: dict) -> Figure | str:
    shares, names = _behaviour(summary) or ({}, [])
    if len({s for st in shares.values() for s in st}) < 2:
        return "summary.json `behaviour` has fewer than two eval steps"
    fig, ax = _figure((9, 4.5), "RL step of the eval", "share of eval completions (%)",
                      "Behaviour per eval")  # fmt: skip
    for i, b in enumerate(names):
        for mode, st in shares.items():
            if pts := sorted((s, 100.0 * by[b]) for s, by in st.items() if b in by):
                label = f"{BEHAVIOURS.get(b, (b,))[0]}, {mode}"
                style = "-" if mode == "greedy" else "--"
                ax.plot(*zip(*pts, strict=True), style, color=f"C{i % 10}", marker="o", label=label)
    ax.set_ylim(-3, 103)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _plot_sft(sft: Sequence[dict]) -> Figure | str:
    x_key = "sft/step" if any(_num(r.get("sft/step")) is not None for r in sft) else "step"
    xs, ys = _series(sft, "sft/loss", x_key)
    if not ys:
        return "no SFT lines with `sft/loss`"
    fig, ax = _figure((6, 4), "SFT step", "loss", "SFT loss")
    ax.plot(xs, ys, color="tab:purple")
    return fig


def _fmt(v: Any, unit: str = "") -> str:
    x = _num(v)
    return "n/a" if x is None else f"{x:.4g}{unit}"


def _eval_before_after(summary: dict, evals: Sequence[dict]) -> list[str]:
    lines = [
        f"- eval reward before RL: **{_fmt(summary.get('eval_reward_before_rl'))}**",
        f"- eval reward final: **{_fmt(summary.get('eval_reward_final'))}**",
    ]
    if summary.get("eval_sampled_reward_final") is not None:
        t = _fmt(summary.get("eval_temperature"))
        lines.append(
            f"- sampled eval reward (T={t}): {_fmt(summary.get('eval_sampled_reward_before_rl'))}"
            f" before RL -> {_fmt(summary.get('eval_sampled_reward_final'))} final"
        )
    for key in _eval_keys(evals):
        xs, ys = _series(evals, key)
        if ys:
            lines.append(
                f"- `{key}`: {ys[0]:.4g} at step {xs[0]:g} -> {ys[-1]:.4g} at step {xs[-1]:g}"
            )
    return lines


def _age_lines(summary: dict, train: Sequence[dict]) -> list[str]:
    bound = _bound(summary)
    hist = _age_histogram(summary)
    if hist is not None:
        ages = np.repeat(np.array(sorted(hist), np.float64), [hist[a] for a in sorted(hist)])
        if ages.size == 0:
            return ["- off-policy age: histogram is empty (no live-policy rollouts trained)"]
        age_max, age_p99 = float(ages.max()), float(np.percentile(ages, 99))
        source = f"over {ages.size} trained rollouts (summary histogram)"
    else:
        maxes, p99s = _series(train, "orch/age_max")[1], _series(train, "orch/age_p99")[1]
        if not maxes:
            return ["- off-policy age: not reported (no `age_histogram`, no `orch/age_max`)"]
        age_max, age_p99 = max(maxes), max(p99s) if p99s else float("nan")
        source = "from per-step gauges; p99 is the worst step's p99"
    verdict = ""
    if bound is not None:
        verdict = " (within bound)" if age_max <= bound else " (**exceeds bound**)"
    return [
        f"- off-policy age: max {age_max:g}, p99 {age_p99:g} vs bound max_staleness = "
        f"{_fmt(bound)}{verdict}; {source}"
    ]


def _behaviour_lines(summary: dict) -> list[str]:
    shares, names = _behaviour(summary) or ({}, [])
    if not shares:
        return []
    steps = sorted({s for st in shares.values() for s in st})
    meaning = ", ".join(f'"{b}" = {BEHAVIOURS.get(b, (b, "not described"))[1]}' for b in names)
    cols = [(b, m) for b in names for m in shares]
    out = ["", "## Behaviour accounting", "",
           f"Share of eval completions per behaviour: {meaning}.", "",
           "| eval step | " + " | ".join(f"{b} ({m})" for b, m in cols) + " |",
           "|---|" + "---:|" * len(cols)]  # fmt: skip
    for s in steps:
        tag = " (before RL)" if s == 0 else " (final)" if s == steps[-1] else ""
        cells = [shares[m].get(s, {}).get(b) for b, m in cols]
        out.append(f"| {s}{tag} | " + " | ".join(
            "n/a" if c is None else f"{100.0 * c:.1f}%" for c in cells) + " |")  # fmt: skip
    return out


def _markdown(workdir: Path, summary: dict, train: Sequence[dict], evals: Sequence[dict],
              written: dict[str, Path], skipped: dict[str, str]) -> str:  # fmt: skip
    steps, steps_note = summary.get("rl_steps"), ""
    if steps is None:
        steps = len({r["step"] for r in train if _num(r.get("step")) is not None})
        steps_note = " (counted from metrics.jsonl)"
    out = [f"# Run report: `{workdir}`", "", "## Results", ""]
    out += _eval_before_after(summary, evals)
    out += [
        f"- RL steps: {_fmt(steps)}{steps_note}",
        f"- wall time: {_fmt(summary.get('wall_seconds'), ' s')}",
    ]
    out += _age_lines(summary, train) + _behaviour_lines(summary) + ["", "## Plots", ""]
    for name, path in written.items():
        if path.suffix == ".png":
            out += [f"![{name}]({path.name})", ""]
    out += [f"- `{name}` skipped: {reason}" for name, reason in skipped.items()]
    return "\n".join(out) + "\n"


def write_report(workdir: str | Path) -> dict[str, dict]:
    """Write the plots and ``report.md``: ``{"written": {name: Path}, "skipped": {name: why}}``."""
    workdir = as_path(workdir)  # a local directory or a gs:// prefix
    records = read_metrics(workdir / "metrics.jsonl")
    path = workdir / "summary.json"
    summary = _json_object(path.read_text(), str(path)) if path.is_file() else {}
    sft, rest, evals, train = _split(records)
    plots = {
        "reward.png": lambda: _plot_reward(rest, summary),
        "age_hist.png": lambda: _plot_age_hist(summary),
        "timeline.png": lambda: _plot_timeline(train),
    }
    # A run without these inputs is not missing anything: no plot, no skip note.
    if _behaviour(summary) is not None:
        plots["behaviour.png"] = lambda: _plot_behaviour(summary)
    if sft:
        plots["sft_loss.png"] = lambda: _plot_sft(sft)
    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for name, draw in plots.items():
        if isinstance(fig := draw(), str):
            skipped[name] = fig
            continue
        fig.tight_layout()
        FigureCanvasAgg(fig)
        png = io.BytesIO()  # rendered in memory, then one write (a file or a gs:// object)
        fig.savefig(png, format="png", dpi=_DPI)
        (workdir / name).write_bytes(png.getvalue())
        written[name] = workdir / name
    written["report.md"] = workdir / "report.md"
    written["report.md"].write_text(_markdown(workdir, summary, train, evals, written, skipped))
    return {"written": written, "skipped": skipped}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.tools.report",
        description="Plot metrics.jsonl/summary.json of a run directory and write report.md.",
    )
    p.add_argument("workdir", help="finished run directory (summary.json, metrics.jsonl)")
    workdir = as_path(p.parse_args(argv).workdir)
    try:
        if not workdir.is_dir():
            raise ReportInputError(f"{workdir}: no such directory")
        if not (workdir / "summary.json").is_file():
            raise ReportInputError(f"{workdir / 'summary.json'}: not found (a run's last write)")
        result = write_report(workdir)
    except (FileNotFoundError, ReportInputError) as e:
        expected = "expected a finished run directory holding summary.json and metrics.jsonl"
        print(f"{p.prog}: error: {e}; {expected}", file=sys.stderr)
        raise SystemExit(2) from None
    done, skipped = result["written"].values(), result["skipped"].items()
    print("\n".join([*(f"wrote {p}" for p in done), *(f"skipped {n}: {w}" for n, w in skipped)]))


if __name__ == "__main__":
    main()
