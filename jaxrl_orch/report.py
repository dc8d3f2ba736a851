"""Run report: turn a finished (or running) workdir into PNG plots and a short ``report.md``.

What it owns: reading ``WORKDIR/metrics.jsonl`` (one JSON object per line, as written by the
JSONL metrics writer) and, if present, ``WORKDIR/summary.json`` (end-of-run facts:
``eval_reward_before_rl``, ``eval_reward_final``, ``rl_steps``, ``wall_seconds``,
``age_histogram`` as ``{age (str): count}``, ``max_staleness``), and writing next to them:

- ``reward.png``: ``train/reward_mean`` per step, plus every ``eval/<env>/reward_mean``
  (greedy, solid) and ``eval/<env>/sampled_reward_mean`` or ``eval/<env>@t<T>/reward_mean``
  (sampled, dashed) curve;
- ``age_hist.png``: the observed off-policy head-age histogram from the summary, with the
  configured bound ``max_staleness`` drawn as a vertical line;
- ``timeline.png``: one stacked bar per training step of ``time/generate_s``,
  ``time/train_s``, ``time/transfer_s``, ``time/idle_s``;
- ``sft_loss.png``: ``sft/loss`` against ``sft/step`` when the run had an SFT phase;
- ``report.md``: before/after eval reward, steps, wall time, age max/p99 against the bound,
  and links to the plots.

Invariants: a line is classified by its ``"kind"`` (``train``/``eval``/``sft``) when it has
one, otherwise by the keys it carries (``sft/loss``; ``eval/<env>/...``; ``train/``,
``orch/``, ``time/``), so writers that omit ``kind`` still report. A plot whose
inputs are absent is skipped and the skip, with its reason, is written into ``report.md``
and the returned dict; it never raises. A missing ``metrics.jsonl`` raises
``FileNotFoundError`` naming the path; a line that is not a JSON object raises
``ValueError`` naming the file and line number. Age figures are exact when the summary
carries the histogram; otherwise they fall back to the per-step ``orch/age_*`` gauges and
say so.

Who drives it: the training entry point after a run, or a person via
``python -m jaxrl_orch.report WORKDIR``. It draws on ``matplotlib.figure.Figure`` objects
directly (rendered by the Agg canvas), never through ``pyplot``, so it opens no window,
needs no display and does not change the process-wide matplotlib backend.

What it must never do: import the training stack (it reads files only, so it runs on a
laptop against a copied workdir) or recompute facts the run owns (ages, rewards).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

TIMELINE_KEYS = ("time/generate_s", "time/train_s", "time/transfer_s", "time/idle_s")
TRAIN_REWARD_KEY = "train/reward_mean"
_TRAIN_PREFIXES = ("train/", "orch/", "time/")
_DPI = 100


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a metrics JSONL file; blank lines are ignored, anything else must be an object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    records: list[dict[str, Any]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(rec, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}"
                )
            records.append(rec)
    return records


def _read_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    return summary


def _num(v: Any) -> float | None:
    """A finite-or-NaN float for numeric values; None for anything else (bools included)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _series(records: Sequence[dict], key: str, x_key: str = "step") -> tuple[list, list]:
    xs, ys = [], []
    for rec in records:
        x, y = _num(rec.get(x_key)), _num(rec.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _is_sft(rec: dict) -> bool:
    return rec.get("kind") == "sft" or "sft/loss" in rec


def _is_eval(rec: dict) -> bool:
    kind = rec.get("kind")
    return kind == "eval" if kind is not None else bool(_eval_keys([rec]))


def _is_train(rec: dict) -> bool:
    kind = rec.get("kind")
    if kind is not None:
        return kind == "train"
    # Without a kind, one line may carry both a step's training gauges and its eval results.
    return any(k.startswith(_TRAIN_PREFIXES) for k in rec)


def _eval_keys(records: Sequence[dict]) -> list[str]:
    keys = {
        k
        for rec in records
        for k in rec
        if k.startswith("eval/")
        and (k.endswith("/reward_mean") or k.endswith("/sampled_reward_mean"))
    }
    return sorted(keys)


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI)


def _plot_reward(records: Sequence[dict], path: Path) -> str | None:
    train_x, train_y = _series(records, TRAIN_REWARD_KEY)
    eval_keys = _eval_keys(records)
    if not train_y and not eval_keys:
        return f"no `{TRAIN_REWARD_KEY}` or `eval/<env>/reward_mean` values"
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    if train_y:
        ax.plot(train_x, train_y, color="0.6", lw=1, label="train reward (sampled)")
    for key in eval_keys:
        xs, ys = _series(records, key)
        sampled = key.endswith("/sampled_reward_mean") or "@t" in key  # env@t<T>: sampled view
        style = "--" if sampled else "-"
        ax.plot(xs, ys, style, marker="o", ms=3, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)
    return None


def _age_histogram(summary: dict) -> dict[int, int] | None:
    raw = summary.get("age_histogram")
    if not isinstance(raw, dict) or not raw:
        return None
    hist: dict[int, int] = {}
    for age, count in raw.items():
        try:
            hist[int(age)] = int(count)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"summary.json age_histogram must map integer ages to counts, got {age!r}: "
                f"{count!r}"
            ) from e
    return hist


def _bound(summary: dict) -> float | None:
    b = _num(summary.get("max_staleness"))
    if b is None and isinstance(summary.get("config"), dict):
        b = _num(summary["config"].get("max_staleness"))
    return b


def _plot_age_hist(summary: dict, path: Path) -> str | None:
    hist = _age_histogram(summary)
    if hist is None:
        return "summary.json has no `age_histogram`"
    ages = sorted(hist)
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.bar(ages, [hist[a] for a in ages], width=0.8, color="tab:blue", label="rollouts")
    bound = _bound(summary)
    if bound is not None:
        # Drawn between bars: ages up to the bound are allowed, anything right of it is not.
        ax.axvline(bound + 0.5, color="tab:red", ls="--", label=f"bound: max_staleness = {bound:g}")
        ax.set_xlim(min(ages[0], bound) - 0.6, max(ages[-1], bound + 0.5) + 0.6)
    ax.set_xlabel("off-policy age of rollout head (policy versions)")
    ax.set_ylabel("trained rollouts")
    ax.set_title("Observed off-policy age")
    ax.set_xticks(ages)
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)
    return None


def _plot_timeline(train: Sequence[dict], path: Path) -> str | None:
    present = [k for k in TIMELINE_KEYS if any(_num(r.get(k)) is not None for r in train)]
    if not present:
        return "no `time/*_s` keys (" + ", ".join(TIMELINE_KEYS) + ") in the training lines"
    rows = [r for r in train if _num(r.get("step")) is not None]
    steps = np.array([float(r["step"]) for r in rows])
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    bottom = np.zeros(len(rows))
    for key in present:
        # A step that did not report a phase spent no measured time in it.
        secs = np.array([_num(r.get(key)) or 0.0 for r in rows])
        secs = np.where(np.isfinite(secs), secs, 0.0)
        ax.bar(steps, secs, bottom=bottom, width=0.8, label=key.removeprefix("time/"))
        bottom += secs
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Where each step's time went")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    _save(fig, path)
    return None


def _plot_sft(sft: Sequence[dict], path: Path) -> str | None:
    x_key = "sft/step" if any(_num(r.get("sft/step")) is not None for r in sft) else "step"
    xs, ys = _series(sft, "sft/loss", x_key)
    if not ys:
        return "no SFT lines with `sft/loss`"
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(xs, ys, color="tab:purple")
    ax.set_xlabel("SFT step")
    ax.set_ylabel("loss")
    ax.set_title("SFT loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    return None


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
        maxes = [y for y in _series(train, "orch/age_max")[1] if math.isfinite(y)]
        p99s = [y for y in _series(train, "orch/age_p99")[1] if math.isfinite(y)]
        if not maxes:
            return ["- off-policy age: not reported (no `age_histogram`, no `orch/age_max`)"]
        age_max = max(maxes)
        age_p99 = max(p99s) if p99s else float("nan")
        source = "from per-step gauges; p99 is the worst step's p99"
    verdict = ""
    if bound is not None:
        verdict = " (within bound)" if age_max <= bound else " (**exceeds bound**)"
    return [
        f"- off-policy age: max {age_max:g}, p99 {age_p99:g} vs bound max_staleness = "
        f"{_fmt(bound)}{verdict}; {source}"
    ]


def _markdown(
    workdir: Path,
    summary: dict,
    train: Sequence[dict],
    evals: Sequence[dict],
    written: dict[str, Path],
    skipped: dict[str, str],
) -> str:
    steps = summary.get("rl_steps")
    if steps is None:
        steps = len({r["step"] for r in train if _num(r.get("step")) is not None})
        steps_note = " (counted from metrics.jsonl)"
    else:
        steps_note = ""
    out = [f"# Run report: `{workdir}`", "", "## Results", ""]
    out += _eval_before_after(summary, evals)
    out += [
        f"- RL steps: {_fmt(steps)}{steps_note}",
        f"- wall time: {_fmt(summary.get('wall_seconds'), ' s')}",
    ]
    out += _age_lines(summary, train)
    out += ["", "## Plots", ""]
    for name, path in written.items():
        if path.suffix == ".png":
            out += [f"![{name}]({path.name})", ""]
    for name, reason in skipped.items():
        out.append(f"- `{name}` skipped: {reason}")
    return "\n".join(out) + "\n"


def write_report(workdir: str | Path) -> dict[str, dict]:
    """Write the plots and ``report.md`` into ``workdir``.

    Returns ``{"written": {filename: Path}, "skipped": {filename: reason}}``.
    """
    workdir = Path(workdir)
    records = read_metrics(workdir / "metrics.jsonl")
    summary = _read_summary(workdir / "summary.json")
    sft = [r for r in records if _is_sft(r)]
    rest = [r for r in records if not _is_sft(r)]
    evals = [r for r in rest if _is_eval(r)]
    train = [r for r in rest if _is_train(r)]

    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    plots = [
        ("reward.png", lambda p: _plot_reward(rest, p)),
        ("age_hist.png", lambda p: _plot_age_hist(summary, p)),
        ("timeline.png", lambda p: _plot_timeline(train, p)),
    ]
    if sft:  # an RL-only run is not missing anything; no SFT plot, no skip note
        plots.append(("sft_loss.png", lambda p: _plot_sft(sft, p)))
    for name, draw in plots:
        reason = draw(workdir / name)
        if reason is None:
            written[name] = workdir / name
        else:
            skipped[name] = reason
    report = workdir / "report.md"
    report.write_text(_markdown(workdir, summary, train, evals, written, skipped))
    written["report.md"] = report
    return {"written": written, "skipped": skipped}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.report",
        description="Plot metrics.jsonl/summary.json of a run directory and write report.md.",
    )
    p.add_argument("workdir", help="run directory holding metrics.jsonl (and summary.json)")
    args = p.parse_args(argv)
    result = write_report(args.workdir)
    for path in result["written"].values():
        print(f"wrote {path}")
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}")


if __name__ == "__main__":
    main()
