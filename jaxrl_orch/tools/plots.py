"""The run report's figures: reward, off-policy age, step timeline, behaviour, SFT loss.

What it owns: one function per figure, each taking the lines and summary ``report_data`` read
and returning a matplotlib ``Figure``, or a string saying which input is missing (the report
then skips that plot and says why); ``figures`` names the ones a run's inputs call for and
``png`` renders one. Legends are words, not metric keys; greedy eval ``eval/<env>/...`` is
solid, sampled ``eval/<env>@t<T>/...`` dashed.

The timeline draws, per RL step, ``time/generate_s``, ``time/train_s`` and ``time/transfer_s``
as bars in separate lanes from the step's start and the real step time ``orch/step_s`` as a line;
never stacked: an asynchronous run generates while it trains, so phases sum to more than the
step; bars longer together than the line ran in parallel. Durations are logged, start times not.
A step's lines are merged (its timing line follows its ``orch/`` line).

Figures render in memory (Agg, never ``pyplot``: no global state, no display needed).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxrl_orch.tools.report_data import (
    BEHAVIOURS,
    age_histogram,
    behaviour_shares,
    eval_keys,
    num,
    series,
    staleness_bound,
)

# key -> (legend, lane bottom and height within the step's row): disjoint lanes, no stacking.
TIMELINE_LANES = {
    "time/generate_s": ("generation", -0.40, 0.36),
    "time/train_s": ("training", -0.02, 0.30),
    "time/transfer_s": ("weight transfer", 0.30, 0.10),
}

_DPI = 100


def _eval_label(key: str, keys: Sequence[str], temperature: Any) -> str:
    """``eval/<env>@t1/reward_mean`` -> "eval T=1"; the env is named only if there are several."""
    env, metric = key.removeprefix("eval/").rsplit("/", 1)
    base, _, temp = env.partition("@t")
    if not temp and metric == "sampled_reward_mean":  # T is not in the key: the summary's
        temp = "" if num(temperature) is None else f"{temperature:g}"
    mode = f"eval T={temp}" if temp else "eval sampled" if "sampled" in metric else "eval greedy"
    bases = {k.removeprefix("eval/").rsplit("/", 1)[0].partition("@t")[0] for k in keys}
    return mode if len(bases) <= 1 else f"{mode}, {base}"


def _figure(size: tuple[float, float], xlabel: str, ylabel: str, title: str) -> tuple:
    fig = Figure(figsize=size)
    ax = fig.add_subplot(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return fig, ax


def reward(records: Sequence[dict], summary: dict) -> Figure | str:
    train_x, train_y = series(records, "train/reward_mean")
    keys = eval_keys(records)
    if not train_y and not keys:
        return "no `train/reward_mean` or `eval/<env>/reward_mean` values"
    fig, ax = _figure((8, 4.5), "RL step", "mean reward", "Reward")
    if train_y:
        ax.plot(train_x, train_y, color="0.6", lw=1, label="train reward (sampled)")
    for key in keys:
        style = "--" if key.endswith("/sampled_reward_mean") or "@t" in key else "-"
        label = _eval_label(key, keys, summary.get("eval_temperature"))
        ax.plot(*series(records, key), style, marker="o", ms=3, label=label)
    ax.legend(fontsize="small")
    return fig


def age_hist(summary: dict) -> Figure | str:
    hist = age_histogram(summary)
    if hist is None:
        return "summary.json has no `age_histogram`"
    ages = sorted(hist)
    fig, ax = _figure(
        (6, 4),
        "off-policy age of rollout head (policy versions)",
        "trained rollouts",
        "Observed off-policy age",
    )
    ax.bar(ages, [hist[a] for a in ages], width=0.8, color="tab:blue", label="trained rollouts")
    bound = staleness_bound(summary)
    if bound is not None:
        # Drawn between bars: ages up to the bound are allowed, anything right of it is not.
        ax.axvline(bound + 0.5, color="tab:red", ls="--", label=f"allowed age bound ({bound:g})")
        ax.set_xlim(min(ages[0], bound) - 0.6, max(ages[-1], bound + 0.5) + 0.6)
    ax.set_xticks(ages)
    ax.legend(fontsize="small")
    return fig


def timeline(train: Sequence[dict]) -> Figure | str:
    merged: dict[float, dict] = {}
    for rec in (r for r in train if num(r.get("step")) is not None):
        merged.setdefault(float(rec["step"]), {}).update(rec)  # later lines of a step add keys
    rows = [merged[s] for s in sorted(merged)]
    if not any(num(r.get(k)) is not None for r in rows for k in TIMELINE_LANES):
        return "no " + ", ".join(f"`{k}`" for k in TIMELINE_LANES) + " in the training lines"
    fig, ax = _figure(
        (9, min(12.0, 2.0 + 0.35 * len(rows))),
        "seconds from the start of the step",
        "RL step",
        "Phase durations per step vs real step time\n"
        "(generation + training longer than the step: they overlapped)",
    )
    for key, (label, bottom, height) in TIMELINE_LANES.items():
        # A step that did not log this phase gets no bar in its lane (nothing to draw).
        steps, secs = series(rows, key)
        if secs:
            ax.barh(np.add(steps, bottom), secs, height, left=0.0, align="edge", label=label)
    steps, step_s = series(rows, "orch/step_s")
    if step_s:
        label = "real step time (between shipped batches)"
        ax.plot(step_s, steps, color="black", marker="|", ms=14, lw=1, label=label)
    ax.invert_yaxis()  # first step on top, read like a log
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def behaviour(summary: dict) -> Figure | str:
    shares, names = behaviour_shares(summary) or ({}, [])
    if len({s for st in shares.values() for s in st}) < 2:
        return "summary.json `behaviour` has fewer than two eval steps"
    fig, ax = _figure(
        (9, 4.5), "RL step of the eval", "share of eval completions (%)", "Behaviour per eval"
    )
    for i, b in enumerate(names):
        for mode, st in shares.items():
            if pts := sorted((s, 100.0 * by[b]) for s, by in st.items() if b in by):
                label = f"{BEHAVIOURS.get(b, (b,))[0]}, {mode}"
                style = "-" if mode == "greedy" else "--"
                ax.plot(*zip(*pts, strict=True), style, color=f"C{i % 10}", marker="o", label=label)
    ax.set_ylim(-3, 103)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def sft_loss(sft: Sequence[dict]) -> Figure | str:
    x_key = "sft/step" if any(num(r.get("sft/step")) is not None for r in sft) else "step"
    xs, ys = series(sft, "sft/loss", x_key)
    if not ys:
        return "no SFT lines with `sft/loss`"
    fig, ax = _figure((6, 4), "SFT step", "loss", "SFT loss")
    ax.plot(xs, ys, color="tab:purple")
    return fig


def figures(
    sft: Sequence[dict], rest: Sequence[dict], train: Sequence[dict], summary: dict
) -> dict[str, Callable[[], Figure | str]]:
    """``{file name: draw}`` of the plots this run's inputs call for (``split_records``)."""
    plots: dict[str, Callable[[], Figure | str]] = {
        "reward.png": lambda: reward(rest, summary),
        "age_hist.png": lambda: age_hist(summary),
        "timeline.png": lambda: timeline(train),
    }
    # A run without these inputs is not missing anything: no plot, no skip note.
    if behaviour_shares(summary) is not None:
        plots["behaviour.png"] = lambda: behaviour(summary)
    if sft:
        plots["sft_loss.png"] = lambda: sft_loss(sft)
    return plots


def png(fig: Figure) -> bytes:
    """``fig`` rendered in memory (then written in one go: a file or a gs:// object)."""
    fig.tight_layout()
    FigureCanvasAgg(fig)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=_DPI)
    return out.getvalue()
