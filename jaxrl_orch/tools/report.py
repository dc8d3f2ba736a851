"""Run report: turn a run's workdir into PNG plots and a short ``report.md``.

What it owns: ``write_report(workdir)``, which writes next to the run's ``metrics.jsonl`` and
``summary.json`` (read by ``report_data``) the plots of ``plots`` -- ``reward.png``,
``age_hist.png``, ``timeline.png``, ``behaviour.png`` (two or more eval steps), ``sft_loss.png``
(if the run had SFT) -- and ``report.md``: eval reward before/after, steps, wall time, what the
start cost (``start_cost_text``: seconds to the first rollout and train step, the compile
cache's hits and misses), age max/p99 against the bound, the behaviour table, the plots; and the CLI
(``python -m jaxrl_orch.tools.report WORKDIR``).

Invariants: a plot whose inputs are absent is skipped, with the reason in ``report.md`` and the
returned dict. ``write_report`` also takes a running workdir (ages then come from the
``orch/age_*`` gauges); the CLI wants a finished run, else one line on stderr, exit 2. Writes
go through ``paths`` (``gs://`` too). It reads files only (it runs on a laptop) and never
recomputes facts the run owns (ages, rewards).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_orch.paths import as_path
from jaxrl_orch.tools.report_data import (
    BEHAVIOURS,
    ReportInputError,
    age_histogram,
    behaviour_shares,
    eval_keys,
    num,
    read_metrics,
    read_summary,
    series,
    split_records,
    staleness_bound,
)


def _fmt(v: Any, unit: str = "") -> str:
    x = num(v)
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
    for key in eval_keys(evals):
        xs, ys = series(evals, key)
        if ys:
            lines.append(
                f"- `{key}`: {ys[0]:.4g} at step {xs[0]:g} -> {ys[-1]:.4g} at step {xs[-1]:g}"
            )
    return lines


def _age_lines(summary: dict, train: Sequence[dict]) -> list[str]:
    bound = staleness_bound(summary)
    hist = age_histogram(summary)
    if hist is not None:
        ages = np.repeat(np.array(sorted(hist), np.float64), [hist[a] for a in sorted(hist)])
        if ages.size == 0:
            return ["- off-policy age: histogram is empty (no live-policy rollouts trained)"]
        age_max = float(ages.max())
        age_p99 = float(np.percentile(ages, 99))
        source = f"over {ages.size} trained rollouts (summary histogram)"
    else:
        maxes = series(train, "orch/age_max")[1]
        p99s = series(train, "orch/age_p99")[1]
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


def start_cost_text(summary: dict) -> str | None:
    """What the start cost (``summary.json``'s ``restart`` and ``compile_cache``) in words:
    ``warm start: first rollout 3.1 s, first train step 4.0 s after the command started;
    compile cache DIR: 40 hits, 2 misses (95%); programs kept whole: 17 loaded, 0 stored``
    (the executable store's, ``compose.executables``); None for a run that has neither."""
    restart = summary.get("restart")
    cache = summary.get("compile_cache")
    parts = []
    if isinstance(restart, dict):
        kind = "cold" if restart.get("cold") else "warm"
        rollout = _fmt(restart.get("first_rollout_s"), " s")
        step = _fmt(restart.get("first_step_s"), " s")
        parts.append(
            f"{kind} start: first rollout {rollout}, first train step {step} after the "
            "command started"
        )
    if isinstance(cache, dict) and cache.get("dir") is None:
        parts.append("compile cache off")
    elif isinstance(cache, dict):
        hits = int(num(cache.get("hits")) or 0)
        misses = int(num(cache.get("misses")) or 0)
        rate = f" ({hits / (hits + misses):.0%})" if hits + misses else ""
        parts.append(f"compile cache {cache['dir']}: {hits} hits, {misses} misses{rate}")
        kept_whole = cache.get("executables")
        if isinstance(kept_whole, dict):
            loaded = int(num(kept_whole.get("loaded")) or 0)
            stored = int(num(kept_whole.get("stored")) or 0)
            parts.append(f"programs kept whole: {loaded} loaded, {stored} stored")
    kept = restart.get("rollouts") if isinstance(restart, dict) else None
    if isinstance(kept, dict):
        parts.append(kept_text(kept))
    return "; ".join(parts) or None


def kept_text(counts: dict) -> str:
    """What a start took back from the rollout journal, in words (``recovery.Recovery``)."""
    n = {k: int(num(v) or 0) for k, v in counts.items()}
    text = (
        f"rollouts kept {n.get('kept', 0)} (+{n.get('trained_before', 0)} trained before, with "
        f"their groups), sent again {n.get('reissued', 0)}"
    )
    lost = ("future", "expired", "unsendable", "mismatched", "torn_line", "bad_line")
    names = {"future": "from lost versions", "torn_line": "torn lines", "bad_line": "bad lines"}
    untrusted = [f"{n[k]} {names.get(k, k)}" for k in lost if n.get(k)]
    return text + (f"; not trusted: {', '.join(untrusted)}" if untrusted else "")


def _behaviour_lines(summary: dict) -> list[str]:
    shares, names = behaviour_shares(summary) or ({}, [])
    if not shares:
        return []
    steps = sorted({s for st in shares.values() for s in st})
    meaning = ", ".join(f'"{b}" = {BEHAVIOURS.get(b, (b, "not described"))[1]}' for b in names)
    cols = [(b, m) for b in names for m in shares]
    out = [
        "",
        "## Behaviour accounting",
        "",
        f"Share of eval completions per behaviour: {meaning}.",
        "",
        "| eval step | " + " | ".join(f"{b} ({m})" for b, m in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for s in steps:
        tag = " (before RL)" if s == 0 else " (final)" if s == steps[-1] else ""
        cells = [shares[m].get(s, {}).get(b) for b, m in cols]
        out.append(
            f"| {s}{tag} | "
            + " | ".join("n/a" if c is None else f"{100.0 * c:.1f}%" for c in cells)
            + " |"
        )
    return out


def _env_score_lines(summary: dict) -> list[str]:
    """The environment's own named rewards and metrics (a verifiers taskset's), per greedy
    eval: before RL and final."""
    scores = summary.get("env_scores")
    if not isinstance(scores, dict) or not scores:
        return []
    steps = sorted(scores, key=int)
    first = steps[0]
    last = steps[-1]
    names = sorted({k for by in scores.values() for k in by})
    out = ["", "## Environment scores", "", f"| name | eval step {first} | eval step {last} |"]
    out.append("|---|---:|---:|")
    for name in names:
        cells = [scores[s].get(name) for s in (first, last)]
        out.append(f"| {name} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return out


def _markdown(
    workdir: Path,
    summary: dict,
    train: Sequence[dict],
    evals: Sequence[dict],
    written: dict[str, Path],
    skipped: dict[str, str],
) -> str:
    steps = summary.get("rl_steps")
    steps_note = ""
    if steps is None:
        steps = len({r["step"] for r in train if num(r.get("step")) is not None})
        steps_note = " (counted from metrics.jsonl)"
    out = [f"# Run report: `{workdir}`", "", "## Results", ""]
    out += _eval_before_after(summary, evals)
    out += [
        f"- RL steps: {_fmt(steps)}{steps_note}",
        f"- wall time: {_fmt(summary.get('wall_seconds'), ' s')}",
    ]
    start = start_cost_text(summary)
    out += [] if start is None else [f"- {start}"]
    out += _age_lines(summary, train) + _behaviour_lines(summary) + _env_score_lines(summary)
    out += ["", "## Plots", ""]
    for name, path in written.items():
        if path.suffix == ".png":
            out += [f"![{name}]({path.name})", ""]
    out += [f"- `{name}` skipped: {reason}" for name, reason in skipped.items()]
    return "\n".join(out) + "\n"


def write_report(workdir: str | Path) -> dict[str, dict]:
    """Write the plots and ``report.md``: ``{"written": {name: Path}, "skipped": {name: why}}``."""
    # matplotlib is imported here, where the plots are drawn: a run's start formats its restart
    # line from this module and should not pay for it before its first rollout.
    from jaxrl_orch.tools import plots

    workdir = as_path(workdir)  # a local directory or a gs:// prefix
    records = read_metrics(workdir / "metrics.jsonl")
    summary = read_summary(workdir)
    sft, rest, evals, train = split_records(records)
    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for name, draw in plots.figures(sft, rest, train, summary).items():
        if isinstance(fig := draw(), str):
            skipped[name] = fig
            continue
        (workdir / name).write_bytes(plots.png(fig))
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
    done = result["written"].values()
    skipped = result["skipped"].items()
    print("\n".join([*(f"wrote {p}" for p in done), *(f"skipped {n}: {w}" for n, w in skipped)]))


if __name__ == "__main__":
    main()
