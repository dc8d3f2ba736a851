"""``jaxrl-lift``: the RL demo with its controls, as plain commands, and one table.

    python -m jaxrl_orch.tools.lift --workdir=runs/lift [--gin_file=configs/reverse_text.gin]
        [--seeds 0 1 2] [--gin_param=...]

What it owns: running the embedded demo and the controls that say what its lift is made of,
each as an ordinary ``python -m jaxrl_orch.train`` command (printed before it runs, so every
row of the table can be rerun by hand), then writing ``WORKDIR/comparison.md`` (one table) and
``WORKDIR/comparison.png`` (held-out greedy eval vs RL step, one line per run). Runs:

- ``seed<k>``: the gin file as given with ``TrainConfig.seed = k`` (warm-up, then RL);
- from ``seed<first>``'s warm-up (``Warmup.from_workdir``), the same RL budget spent as
  ``permuted`` (``algorithm = 'permuted:<algorithm>'``: the same updates with each group's
  advantages shuffled, i.e. the update noise alone), ``imitation`` (``after_warmup = 'sft'``:
  more SFT on the same mixed demonstrations, the same number of optimizer updates), and
  ``clean_sft`` (the same, on always-right demonstrations: ``demonstrations = ()``).

A run whose ``summary.json`` exists is not run again (rerunning the command completes an
interrupted comparison). ``--compare_only`` rebuilds the table and plot from what is there.
It reads only ``summary.json`` and ``metrics.jsonl``; it never imports JAX.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from jaxrl_orch.paths import as_path

_EVAL_KEY = re.compile(r"^eval/([^/@]+)/reward_mean$")
# What each control is, in words (the plot's legend; the table names runs by their directory).
_LEGEND = {
    "permuted": "permuted advantages (noise only)",
    "imitation": "more SFT on the mixed demos (imitation)",
    "clean_sft": "SFT on clean demos (upper bound)",
}


def run_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """Label -> the ``train`` command line of each run of the comparison, in run order."""
    base = [sys.executable, "-m", "jaxrl_orch.train"]
    base += [f"--gin_file={f}" for f in args.gin_file]
    base += [f"--gin_param={p}" for p in args.gin_param]
    root = as_path(args.workdir)  # a gs:// URL stays one
    runs = {}
    for seed in args.seeds:
        runs[f"seed{seed}"] = [
            *base,
            f"--workdir={root / f'seed{seed}'}",
            f"--gin_param=TrainConfig.seed={seed}",
        ]
    warm = root / f"seed{args.seeds[0]}"
    control = [
        *base,
        f"--gin_param=TrainConfig.seed={args.seeds[0]}",
        f'--gin_param=Warmup.from_workdir="{warm}"',
    ]
    runs["permuted"] = [
        *control,
        f"--workdir={root / 'permuted'}",
        f'--gin_param=RL.algorithm="permuted:{args.algorithm}"',
    ]
    runs["imitation"] = [
        *control,
        f"--workdir={root / 'imitation'}",
        '--gin_param=RL.after_warmup="sft"',
    ]
    runs["clean_sft"] = [
        *control,
        f"--workdir={root / 'clean_sft'}",
        '--gin_param=RL.after_warmup="sft"',
        "--gin_param=Warmup.demonstrations=()",
    ]
    return runs


def eval_curve(workdir: Path) -> dict[int, float]:
    """Held-out greedy eval reward per step from ``metrics.jsonl`` (the env without ``@t``)."""
    curve: dict[int, float] = {}
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return curve
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if _EVAL_KEY.match(k) and v is not None:
                curve[int(row["step"])] = float(v)
    return curve


def _share(summary: dict[str, Any], kind: str, step: str, behaviour: str) -> float | None:
    return summary.get("behaviour", {}).get(kind, {}).get(step, {}).get(behaviour)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def table_rows(runs: dict[str, Path]) -> list[dict[str, Any]]:
    """One row per run that has a ``summary.json``: before/after greedy and sampled evals,
    their lifts, and the greedy behaviour shares (word-order, full reversal) before -> after."""
    rows = []
    for label, wd in runs.items():
        path = wd / "summary.json"
        if not path.is_file():
            continue
        s = json.loads(path.read_text())
        g0 = s.get("eval_reward_before_rl")
        g1 = s.get("eval_reward_final")
        t0 = s.get("eval_sampled_reward_before_rl")
        t1 = s.get("eval_sampled_reward_final")
        steps = sorted(s.get("behaviour", {}).get("greedy", {}), key=int)
        first, last = (steps[0], steps[-1]) if steps else ("0", "0")
        rows.append(
            {
                "run": label,
                "greedy_before": g0,
                "greedy_after": g1,
                "greedy_lift": None if g0 is None or g1 is None else g1 - g0,
                "sampled_before": t0,
                "sampled_after": t1,
                "sampled_lift": None if t0 is None or t1 is None else t1 - t0,
                "word_order": (
                    _share(s, "greedy", first, "word_order"),
                    _share(s, "greedy", last, "word_order"),
                ),
                "full": (_share(s, "greedy", first, "full"), _share(s, "greedy", last, "full")),
                "wall_s": s.get("wall_seconds"),
            }
        )
    return rows


def comparison_markdown(rows: list[dict[str, Any]], commands: dict[str, list[str]]) -> str:
    out = [
        "# RL lift and its controls",
        "",
        "Held-out eval reward (greedy, and sampled at the training temperature) before and after "
        "the stage that follows the warm-up, and the greedy answers' behaviour shares before -> "
        "after (word-order reversal, full reversal).",
        "",
        "| run | greedy before -> after (lift) | sampled before -> after (lift) "
        "| word-order answers | full reversals | wall s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        w = r["word_order"]
        f = r["full"]
        out.append(
            f"| {r['run']} | {_num(r['greedy_before'])} -> {_num(r['greedy_after'])} "
            f"({_num(r['greedy_lift'], True)}) | {_num(r['sampled_before'])} -> "
            f"{_num(r['sampled_after'])} ({_num(r['sampled_lift'], True)}) | "
            f"{_pct(w[0])} -> {_pct(w[1])} | {_pct(f[0])} -> {_pct(f[1])} | "
            f"{'-' if r['wall_s'] is None else round(r['wall_s'])} |"
        )
    out += ["", "Commands:", ""]
    out += [f"- {label}: `{shlex.join(['python', *cmd[1:]])}`" for label, cmd in commands.items()]
    return "\n".join(out) + "\n"


def plot(runs: dict[str, Path], out: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for label, wd in runs.items():
        curve = eval_curve(wd)
        if curve:
            xs = sorted(curve)
            name = _LEGEND.get(label, label.replace("seed", "RL, seed "))
            ax.plot(xs, [curve[x] for x in xs], marker="o", ms=3, label=name)
            drawn += 1
    if drawn:
        ax.set_xlabel("RL step (controls: the same number of optimizer updates)")
        ax.set_ylabel("held-out eval reward, greedy")
        ax.set_title("RL (each seed from its warm-up) vs controls (from the first seed's)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        out.write_bytes(png.getvalue())
    plt.close(fig)
    return bool(drawn)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.tools.lift",
        description="Run the RL demo over seeds plus its controls; write one table and plot.",
    )
    p.add_argument("--workdir", default="runs/lift")
    p.add_argument("--gin_file", action="append", default=None)
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--algorithm", default="grpo", help="the estimator the permuted control shuffles"
    )
    p.add_argument("--compare_only", action="store_true", help="only rebuild the table and plot")
    args = p.parse_args(argv)
    args.gin_file = args.gin_file or ["configs/reverse_text.gin"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commands = run_commands(args)
    root = as_path(args.workdir)
    runs = {label: root / label for label in commands}
    if not args.compare_only:
        for label, cmd in commands.items():
            if (runs[label] / "summary.json").is_file():
                print(f"[lift] {label}: done already ({runs[label]})", flush=True)
                continue
            print(f"[lift] {label}: $ {shlex.join(['python', *cmd[1:]])}", flush=True)
            rc = subprocess.call(cmd)
            if rc != 0:
                print(
                    f"error: run {label!r} exited {rc}; rerun the command to continue",
                    file=sys.stderr,
                )
                return rc
    root.mkdir(parents=True, exist_ok=True)
    rows = table_rows(runs)
    (root / "comparison.md").write_text(comparison_markdown(rows, commands))
    drew = plot(runs, root / "comparison.png")
    print(
        f"[lift] wrote {root / 'comparison.md'}"
        + (f" and {root / 'comparison.png'}" if drew else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
