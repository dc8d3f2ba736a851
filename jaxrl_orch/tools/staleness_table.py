"""The staleness study's outputs: what each finished run says, one table per block, one plot.

What it owns: reading a finished run (``summary.json`` and the per-step rows of
``metrics.jsonl``: those with ``orch/step_s``) into one table row, rendering the grid table
(S x loss) and the age-policy table as markdown, and drawing final greedy reward vs S, one line
per loss. ``staleness.py`` (the command) decides which runs exist and passes their labels,
settings and the presets' meanings in.

Where each number comes from:
- greedy / sampled eval before and after RL: ``eval_reward_before_rl``, ``eval_reward_final``,
  ``eval_sampled_reward_before_rl``, ``eval_sampled_reward_final``;
- observed head ages: the histogram is ``summary.json["age_histogram"]`` (the run's last
  attempt: a resumed run is marked), the maximum also takes every step's ``orch/age_max``;
  a run whose maximum is below its S never reached the bound and says so;
- RL steps/s: step rows over the sum of their ``orch/step_s`` (ship to ship), else
  ``rl_steps_this_run / rl_seconds``;
- masked / clipped shares: each ``trainer/...`` share averaged over the step rows; a loss's own
  shares are shown even when 0, any other only when it is not.

Reads only; never recomputes what the run recorded, never imports JAX.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl_orch.tools.report_data import age_histogram, num, read_metrics, read_summary

# trainer share key -> its short name in the table (docs/losses.md says what each counts)
SHARE_KEYS = {
    "trainer/clip_low": "clip low",
    "trainer/clip_high": "clip high",
    "trainer/tis_capped": "TIS capped",
    "trainer/icepop_masked": "IcePop masked",
    "trainer/mis_masked": "MIS masked",
    "trainer/geo_masked": "geo masked",
    "trainer/seq_clipped": "seq clipped",
    "trainer/cispo_clipped": "CISPO clipped",
}


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One finished run, as the tables show it."""

    label: str
    s: int
    loss: str
    policy: str
    greedy: tuple[float | None, float | None]  # before, after
    sampled: tuple[float | None, float | None]
    ages: dict[int, int]  # the summary's histogram
    age_max: float | None
    resumed: bool  # the histogram covers the last attempt only
    steps_per_s: float | None
    shares: dict[str, float]  # SHARE_KEYS present in the step rows -> mean per step
    dropped: int | None

    @property
    def reached(self) -> bool:
        return self.age_max is not None and self.age_max >= self.s


def step_rows(records: Sequence[dict]) -> list[dict]:
    """The per-step rows of the RL stage (the ledger's: they carry ``orch/step_s``)."""
    return [r for r in records if num(r.get("orch/step_s")) is not None]


def read_run(label: str, workdir: Path, s: int, loss: str, policy: str) -> RunResult | None:
    """The run in ``workdir`` as a table row, or None while it has no ``summary.json``."""
    summary = read_summary(workdir)
    if not summary:
        return None
    metrics = workdir / "metrics.jsonl"
    rows = step_rows(read_metrics(metrics)) if metrics.is_file() else []
    hist = age_histogram(summary) or {}
    maxes = [m for r in rows if (m := num(r.get("orch/age_max"))) is not None]
    age_max = max([*maxes, *map(float, hist)]) if maxes or hist else None
    shares = {}
    for key in SHARE_KEYS:
        values = [v for r in rows if (v := num(r.get(key))) is not None]
        if values:
            shares[key] = statistics.fmean(values)
    return RunResult(
        label=label,
        s=s,
        loss=loss,
        policy=policy,
        greedy=(num(summary.get("eval_reward_before_rl")), num(summary.get("eval_reward_final"))),
        sampled=(
            num(summary.get("eval_sampled_reward_before_rl")),
            num(summary.get("eval_sampled_reward_final")),
        ),
        ages=hist,
        age_max=age_max,
        resumed=summary.get("resumed_from_step") is not None,
        steps_per_s=_steps_per_s(rows, summary),
        shares=shares,
        dropped=None if summary.get("dropped") is None else int(summary["dropped"]),
    )


def _steps_per_s(rows: Sequence[dict], summary: Mapping[str, Any]) -> float | None:
    total = sum(num(r["orch/step_s"]) for r in rows)
    if rows and total > 0:
        return len(rows) / total
    steps = num(summary.get("rl_steps_this_run"))
    secs = num(summary.get("rl_seconds"))
    return steps / secs if steps and secs else None


def ages_text(hist: Mapping[int, int]) -> str:
    """``{0: 2, 1: 1, 2: 1}`` -> ``0:50% 1:25% 2:25%``."""
    total = sum(hist.values())
    if not total:
        return "-"
    return " ".join(f"{a}:{hist[a] / total:.0%}" for a in sorted(hist))


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _lift(pair: tuple[float | None, float | None]) -> str:
    before, after = pair
    lift = None if before is None or after is None else after - before
    return f"{_num(before)} -> {_num(after)} ({_num(lift, '+.3f')})"


def _age_max(r: RunResult) -> str:
    if r.age_max is None:
        return "-"
    return f"{r.age_max:g}" + ("" if r.reached else f" (**never reached S = {r.s}**)")


def shares_text(r: RunResult, own: Sequence[str]) -> str:
    """The loss's own shares (``own``), then any other share that is not 0."""
    keys = [k for k in SHARE_KEYS if k in r.shares and (k in own or r.shares[k] > 0)]
    return ", ".join(f"{SHARE_KEYS[k]} {r.shares[k]:.1%}" for k in keys) or "-"


def grid_markdown(results: Sequence[RunResult], own_shares: Mapping[str, Sequence[str]]) -> str:
    """The S x loss table; ``own_shares``: loss -> the share keys it reports."""
    out = [
        "| S | loss | greedy before -> after (lift) | sampled before -> after (lift) "
        "| age max | observed ages | RL steps/s | masked / clipped (mean share per step) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ages = ages_text(r.ages) + (" (last attempt)" if r.resumed and r.ages else "")
        out.append(
            f"| {r.s} | {r.loss} | {_lift(r.greedy)} | {_lift(r.sampled)} | {_age_max(r)} "
            f"| {ages} | {_num(r.steps_per_s)} | {shares_text(r, own_shares.get(r.loss, ()))} |"
        )
    return "\n".join(out) + "\n"


def policy_markdown(results: Sequence[RunResult]) -> str:
    """The age-policy table (one S, one loss, a row per ``Orchestrator.age_policy``)."""
    out = [
        "| age policy | greedy after | sampled after | dropped rollouts | age max | RL steps/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        out.append(
            f"| {r.policy} | {_num(r.greedy[1])} | {_num(r.sampled[1])} "
            f"| {'-' if r.dropped is None else r.dropped} | {_age_max(r)} "
            f"| {_num(r.steps_per_s)} |"
        )
    return "\n".join(out) + "\n"


def plot(results: Sequence[RunResult], losses: Sequence[str], out: Any) -> bool:
    """Final greedy eval reward vs S, one line per loss, the warm-up's as a dashed line;
    written to ``out`` (local or ``gs://``). False (nothing written) when no run has a final
    greedy eval."""
    from matplotlib.figure import Figure

    from jaxrl_orch.tools.plots import png

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot(
        xlabel="staleness bound S (policy versions)",
        ylabel="held-out eval reward after RL, greedy",
        title="Final greedy reward vs staleness, per loss",
    )
    ax.grid(alpha=0.3)
    drawn: set[int] = set()
    for loss in losses:
        mine = [r for r in results if r.loss == loss and r.greedy[1] is not None]
        pts = sorted((r.s, r.greedy[1]) for r in mine)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=loss)
            drawn.update(s for s, _ in pts)
    if not drawn:
        return False
    before = [r.greedy[0] for r in results if r.greedy[0] is not None]
    if before:
        ax.axhline(statistics.fmean(before), color="0.5", ls="--", label="warm-up (before RL)")
    ax.set_xticks(sorted(drawn))
    ax.legend(fontsize="small")
    out.write_bytes(png(fig))
    return True
