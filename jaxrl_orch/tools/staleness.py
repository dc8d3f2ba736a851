"""``jaxrl-staleness``: how much staleness each loss tolerates, as plain commands and one table.

    python -m jaxrl_orch.tools.staleness --workdir=runs/staleness [--gin_file=...]
        [--staleness 0 1 2 4 8] [--losses grpo decoupled icepop] [--policies admit drop pace]
        [--simulate] [--dry_run] [--compare_only] [--gin_param=...]

What it owns: the study's runs, each an ordinary ``python -m jaxrl_orch.train`` command
(printed before it runs, so every row can be rerun by hand), and ``WORKDIR/staleness.md`` (the
tables, ``staleness_table``) and ``WORKDIR/staleness.png`` (final greedy reward vs S per loss):

- ``warmup``: the gin file's warm-up, once (its RL stage is a single step, only so the command
  ends); ``--warmup_from=DIR2`` uses DIR2's ``sft/`` instead. Every RL run starts from it
  (``Warmup.from_workdir``), so the runs differ only in S and the loss.
- ``s<S>_<loss>``: RL at staleness bound S with a loss preset (``PRESETS``: gin bindings).
- ``s<S>_grpo_<policy>`` (``--policies``): the grpo loss at ``--policy_staleness`` under each
  ``Orchestrator.age_policy``; its ``admit`` run is the grid's ``s<S>_grpo`` (one command).

Reaching the bound: every grid run binds ``age_policy = "admit"`` (the gate bounds admission
only, so nothing holds an old rollout back) and ``max_concurrent = None``, i.e. (S + 1) x batch
in flight: the most the gate can admit, so concurrency never binds before staleness. The
engine stamps each token with the version of the decode step that made it, so a rollout
waiting in the engine's queue for a decode slot starts fresh: with fewer slots than rollouts in
flight the engine only gets S versions ahead when it outruns the trainer. ``--slots match``
(the default) sets ``Engine.slots`` to the same (S + 1) x batch, so every admitted rollout
decodes at once under the version it was admitted at; ``--slots config`` keeps the gin file's.
The table reports the ages each run did reach, and says when a run never reached its S.

The study's bindings follow ``--gin_param`` (so a row is what its label says); every run's
config is built and checked before the first command runs. A run with ``summary.json`` is not
run again (rerun the command to continue); ``--compare_only`` rebuilds the outputs;
``--dry_run`` prints the commands; ``--simulate`` predicts each S's steps/s first
(``staleness_sim``: the real orchestrator on a virtual clock, in process, no JAX). Never
imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence

from jaxrl_orch.config.load import load_config
from jaxrl_orch.config.orchestrator import AGE_POLICIES
from jaxrl_orch.paths import as_path
from jaxrl_orch.tools import staleness_sim, staleness_table

# name -> (what it is, in one line; its gin bindings). docs/losses.md has the formulas.
_DECOUPLED = ("RL.recompute_old_logprobs=True", "Loss.tis_cap=2.0")
PRESETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grpo": ("the config's loss as is (clipped token surrogate vs the engine's log-probs)", ()),
    "decoupled": (
        "AReaL's decoupled PPO: ratio vs the recomputed proximal policy, behaviour weight "
        "truncated at 2",
        _DECOUPLED,
    ),
    "icepop": (
        "decoupled + IcePop: tokens whose trainer/engine ratio leaves [0.5, 2] dropped",
        (*_DECOUPLED, "Loss.icepop=(0.5, 2.0)"),
    ),
    "gspo": (
        "GSPO: sequence-level length-normalised ratio and clip, the paper's eps 3e-4 / 4e-4, "
        "per-sequence normalisation",
        (
            'Loss.policy_loss="gspo"',
            "Loss.eps_low=3e-4",
            "Loss.eps_high=4e-4",
            'Loss.norm="sequence"',
        ),
    ),
    "cispo": (
        "CISPO: every token keeps its gradient; its IS weight, clipped at 1.28, is a constant",
        ('Loss.policy_loss="cispo"',),
    ),
}
# The shares each preset's loss reports (shown in the table even when 0).
_PPO_CLIP = ("trainer/clip_low", "trainer/clip_high")
OWN_SHARES = {
    "grpo": _PPO_CLIP,
    "decoupled": (*_PPO_CLIP, "trainer/tis_capped"),
    "icepop": (*_PPO_CLIP, "trainer/tis_capped", "trainer/icepop_masked"),
    "gspo": ("trainer/seq_clipped",),
    "cispo": ("trainer/cispo_clipped",),
}
DEFAULT_LOSSES = ("grpo", "decoupled", "icepop")
# The warm-up run's RL stage exists only so the command ends: one step, one eval example, no
# engine warm-up or export, and no dynamic sampling (a warm-up that solves every prompt would
# leave only flat groups, which dynamic sampling waits past).
_WARMUP_ONLY = (
    "RL.steps=1",
    "RL.eval_examples=1",
    "RL.dynamic_sampling=False",
    "Engine.warmup=False",
    "Outputs.export_hf=False",
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``train`` command of the study: its directory name and the study's bindings."""

    label: str
    bindings: tuple[str, ...]
    s: int = -1  # -1: the warm-up run
    loss: str = ""
    policy: str = "admit"


def staleness_bindings(s: int, policy: str, batch_size: int, slots: str) -> tuple[str, ...]:
    """S, the age policy and the concurrency that lets the dispatcher run S versions ahead."""
    out = (
        f"Orchestrator.max_staleness={s}",
        f'Orchestrator.age_policy="{policy}"',
        "Orchestrator.max_concurrent=None",
    )
    return (*out, f"Engine.slots={(s + 1) * batch_size}") if slots == "match" else out


def plan(args: argparse.Namespace, batch_size: int) -> list[Run]:
    """Every run of the study, in run order (the warm-up first)."""
    root = as_path(args.workdir)
    runs = [] if args.warmup_from else [Run("warmup", _WARMUP_ONLY)]
    warm = args.warmup_from or str(root / "warmup")

    def rl_run(s: int, loss: str, policy: str) -> Run:
        label = f"s{s}_{loss}" + ("" if policy == "admit" else f"_{policy}")
        bindings = (
            f'Warmup.from_workdir="{warm}"',
            *staleness_bindings(s, policy, batch_size, args.slots),
            *PRESETS[loss][1],
        )
        return Run(label, bindings, s, loss, policy)

    runs += [rl_run(s, loss, "admit") for s in args.staleness for loss in args.losses]
    for policy in args.policies:
        run = rl_run(args.policy_staleness, "grpo", policy)
        if run not in runs:  # the grid's (S, grpo) run is the block's admit run
            runs.append(run)
    return runs


def command(args: argparse.Namespace, run: Run) -> list[str]:
    cmd = [sys.executable, "-m", "jaxrl_orch.train"]
    cmd += [f"--gin_file={f}" for f in args.gin_file]
    cmd += [f"--gin_param={p}" for p in args.gin_param]
    cmd.append(f"--workdir={as_path(args.workdir) / run.label}")
    return cmd + [f"--gin_param={b}" for b in run.bindings]


def printable(cmd: Sequence[str]) -> str:
    return shlex.join(["python", *cmd[1:]])


def check_configs(args: argparse.Namespace, runs: Sequence[Run]) -> None:
    """Build every run's config now: a bad binding fails before hours of runs, naming the run."""
    for run in runs:
        try:
            load_config(args.gin_file, [*args.gin_param, *run.bindings])
        except ValueError as exc:
            raise ValueError(f"run {run.label!r}: {exc}") from exc


def results(args: argparse.Namespace, runs: Sequence[Run]) -> list[staleness_table.RunResult]:
    root = as_path(args.workdir)
    out = []
    for run in runs:
        if run.s >= 0:
            r = staleness_table.read_run(run.label, root / run.label, run.s, run.loss, run.policy)
            if r is not None:
                out.append(r)
    return out


def study_markdown(
    args: argparse.Namespace, runs: Sequence[Run], found: Sequence[staleness_table.RunResult]
) -> str:
    grid = [r for r in found if r.policy == "admit" and r.loss in args.losses]
    grid = [r for r in grid if r.s in args.staleness]
    grid.sort(key=lambda r: (args.losses.index(r.loss), r.s))
    warm = args.warmup_from or str(as_path(args.workdir) / "warmup")
    out = [
        "# Staleness study",
        "",
        f"RL from one warm-up (`{warm}`) at each staleness bound S with each loss; every run "
        "`age_policy = admit` with (S + 1) x batch rollouts in flight"
        + (" and as many engine slots" if args.slots == "match" else "")
        + ". Held-out eval reward (greedy, and sampled at the training temperature) before and "
        "after RL; observed head ages of the trained rollouts; masked / clipped token shares "
        "averaged over the RL steps.",
        "",
        staleness_table.grid_markdown(grid, OWN_SHARES),
        "Losses:",
        "",
    ]
    for loss in args.losses:
        meaning, bindings = PRESETS[loss]
        out.append(f"- `{loss}`: {meaning} ({', '.join(f'`{b}`' for b in bindings) or 'none'})")
    if args.policies:
        s = args.policy_staleness
        block = [r for r in found if r.s == s and r.loss == "grpo" and r.policy in args.policies]
        block.sort(key=lambda r: args.policies.index(r.policy))
        out += ["", f"## Age policies at S = {s} (grpo)", ""]
        out.append(staleness_table.policy_markdown(block))
    out += ["", "Commands:", ""]
    out += [f"- {run.label}: `{printable(command(args, run))}`" for run in runs]
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.tools.staleness",
        description="RL at several staleness bounds x losses from one warm-up; one table, one "
        "plot. Losses: " + "; ".join(f"{k}: {v[0]}" for k, v in PRESETS.items()),
    )
    p.add_argument("--workdir", default="runs/staleness")
    p.add_argument("--gin_file", action="append", default=None)
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--warmup_from", default=None, help="a workdir whose sft/ every run starts from")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--losses", nargs="+", choices=list(PRESETS), default=list(DEFAULT_LOSSES))
    p.add_argument("--policies", nargs="*", choices=AGE_POLICIES, default=[])
    p.add_argument("--policy_staleness", type=int, default=2, help="the S of --policies")
    p.add_argument(
        "--slots",
        choices=("match", "config"),
        default="match",
        help="Engine.slots: (S + 1) x batch, as many as rollouts in flight (match), or the gin "
        "file's (config)",
    )
    p.add_argument("--compare_only", action="store_true", help="only rebuild the table and plot")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    staleness_sim.add_arguments(p)
    args = p.parse_args(argv)
    args.gin_file = args.gin_file or ["configs/reverse_text.gin"]
    for name in ("staleness", "policy_staleness"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 0:
            p.error(f"--{name} must be >= 0 (versions of staleness), got {values}")
    for name in ("losses", "policies"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            p.error(f"--{name} names each entry once, got {values}")
    return args


def run_all(runs: Sequence[Run], args: argparse.Namespace, runner: Callable[..., int]) -> int:
    """Each run without ``summary.json``, in order; the first failure stops the study."""
    root = as_path(args.workdir)
    for run in runs:
        if (root / run.label / "summary.json").is_file():
            print(f"[staleness] {run.label}: done already ({root / run.label})", flush=True)
            continue
        cmd = command(args, run)
        print(f"[staleness] {run.label}: $ {printable(cmd)}", flush=True)
        rc = runner(cmd)
        if rc != 0:
            print(
                f"error: run {run.label!r} exited {rc}; rerun the command to continue",
                file=sys.stderr,
            )
            return rc
    return 0


def write_outputs(args: argparse.Namespace, runs: Sequence[Run]) -> None:
    root = as_path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    found = results(args, runs)
    (root / "staleness.md").write_text(study_markdown(args, runs, found))
    grid = [r for r in found if r.policy == "admit"]
    drew = staleness_table.plot(grid, args.losses, root / "staleness.png")
    print(
        f"[staleness] wrote {root / 'staleness.md'}"
        + (f" and {root / 'staleness.png'}" if drew else "")
    )


def main(argv: Sequence[str] | None = None, runner: Callable[..., int] = subprocess.call) -> int:
    """``runner(cmd) -> exit status`` runs one command (tests pass a fake)."""
    args = parse_args(argv)
    try:
        base = load_config(args.gin_file, args.gin_param)
        runs = plan(args, base.rl.batch_size)
        if args.simulate:
            return staleness_sim.predict(args, base, [r for r in runs if r.s >= 0])
        check_configs(args, runs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for run in runs:
            print(f"[staleness] {run.label}: $ {printable(command(args, run))}")
        return 0
    if not args.compare_only:
        warm = args.warmup_from
        if warm and not (as_path(warm) / "sft").is_dir():
            print(f"error: --warmup_from {warm!r} has no sft/ directory", file=sys.stderr)
            return 2
        rc = run_all(runs, args, runner)
        if rc:
            return rc
    write_outputs(args, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
