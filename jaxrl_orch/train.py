"""``python -m jaxrl_orch.train``: SFT warm-up, then asynchronous RL, resumable, with a report.

    python -m jaxrl_orch.train --gin_file=configs/reverse_text.gin \\
        [--gin_param='RL.steps=40'] [--workdir=runs/reverse_text]

What it owns: the command line and the process's life around the run, not the run's parts:

- reading the config (``config.load``): every setting is a field of one of ``TrainConfig``'s
  sections, and a bad file, binding or value is refused before any work, naming it;
- this process's role (``distributed.group``: the only process, a trainer of a group, or an
  engine replica, from ``Processes`` and ``--process_index``; a trainer group's
  ``jax.distributed`` cluster is joined before any JAX computation; the launch flags left out
  come from the platform's environment, ``distributed.platform``) and, for the process that
  writes the workdir, its claim on it (``owner``: ``run.lock``; a launcher's claim handed on
  to trainer process 0 is adopted);
- handing over to the stages (``run.stages``): ``finished`` first (a workdir that holds the
  run complete for this command is left untouched: nothing is built or written, the closing
  lines are printed again), then ``prepare`` checks everything and builds the
  run's parts (``compose.parts.build_run``: meshes, model, environment, data, the engine
  setting), ``write_config`` writes ``config.gin``, ``run`` takes the stages in order (the
  warm-up, skipped when its checkpoint is complete; RL, resumed from its newest checkpoint with
  the engine on the restored weights, or its imitation control; the export) and ``finish``
  writes ``summary.json`` and the report. Checkpoints (periodic, on the trainer's thread
  between two steps; a final one after the drain), placement and the weight path belong to
  those stages and ``compose``;
- SIGTERM / Ctrl-C: the run drains (at most ``Orchestrator.drain_timeout_s``), checkpoints
  and exits 0; a second signal exits at once, non-zero (128 + the signal);
- exit statuses: 2 for a refused config or command line (named on one line); 1 for a run
  stopped by its storage (a full disk, a read-only or forbidden workdir: one line naming the
  path; the same command resumes once fixed); and ``cli`` ends the process even when a thread
  left behind by environment code never returns (``run.ending``).

First contact: ``--help`` shows the documented command; ``--list_config`` prints every
setting by section with its type, default, allowed values and meaning, read from each field's
own declaration (``config.listing``, ``jaxrl_orch.settings``); a bare command (no gin file, no
binding) does not quietly start a long run of the built-in defaults but lists
``configs/*.gin`` and exits 2 (``--defaults`` runs them on purpose); a finished run prints a
JSON line of headline numbers, then a line naming ``report.md``, the plots, ``export/`` and
``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import gin

from jaxrl_orch.config import listing
from jaxrl_orch.config.load import load_config
from jaxrl_orch.config.rl import RLSettings
from jaxrl_orch.config.train import TrainConfig, WarmupSettings
from jaxrl_orch.distributed.addresses import add_launch_flags
from jaxrl_orch.distributed.platform import resolve_flags
from jaxrl_orch.paths import as_path

if TYPE_CHECKING:  # imported where they are used, after the config checks: they bring JAX
    from jaxrl_orch.compose.parts import RunParts
    from jaxrl_orch.distributed.addresses import Replicas
    from jaxrl_orch.run.stop import StopFlag

DEFAULT_COMMAND = (
    "python -m jaxrl_orch.train --gin_file=configs/reverse_text.gin --workdir=runs/reverse_text"
)

_DESCRIPTION = f"""\
SFT warm-up, then asynchronous RL, from gin config files; every output and checkpoint goes to
--workdir, and the same command run again resumes from its last checkpoint.

The documented default run (the tiny byte-level model learns to reverse sentences, on CPU):

  {DEFAULT_COMMAND}
"""

_EPILOG = """\
Every setting is a TrainConfig field: --list_config prints them all (type, default, meaning).
Override one with --gin_param, e.g. --gin_param='RL.steps = 40'."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.train",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the command on one line
    )
    p.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    p.add_argument(
        "--gin_param",
        action="append",
        default=[],
        help="gin binding, e.g. 'RL.steps = 40' (repeatable; applied after files)",
    )
    p.add_argument("--workdir", default="runs/default", help="outputs and checkpoints")
    p.add_argument(
        "--defaults",
        action="store_true",
        help="run TrainConfig's built-in defaults without a gin file, on purpose",
    )
    add_launch_flags(p)
    p.add_argument(
        "--list_config",
        action="store_true",
        help="print every TrainConfig setting (type, default, meaning) and exit",
    )
    return p.parse_args(argv)


def no_gin_file_message() -> str:
    """What the command says when run bare: what it would have run, and what to run instead."""
    # The classes' own defaults: bindings left by an earlier parse must not show here.
    sft, rl = (c.__dataclass_fields__["steps"].default for c in (WarmupSettings, RLSettings))
    default_gin = listing.CONFIGS_DIR / "reverse_text.gin"
    # The exact documented command from the repository root; a path that works from elsewhere.
    command = DEFAULT_COMMAND
    if default_gin.is_file():
        command = command.replace("configs/reverse_text.gin", listing.shown(default_gin))
    return "\n".join(
        [
            "error: no --gin_file given. Without one this would run TrainConfig's built-in",
            f"defaults ({sft} SFT steps, then {rl} RL steps) "
            "into --workdir; refusing to start that by accident.",
            "",
            *listing.configs_help(),
            "",
            "Run the documented default:",
            f"  {command}",
            "",
            "Run the built-in defaults on purpose: add --defaults (or give --gin_param bindings,",
            "which apply on top of the defaults). Every setting: python -m jaxrl_orch.train "
            "--list_config",
        ]
    )


def outputs_line(workdir: str | Path) -> str:
    """The closing line of a run: the files in ``workdir`` a newcomer opens, those present."""
    wd = as_path(workdir)
    parts = []
    if (wd / "report.md").is_file():
        parts.append(f"report {wd / 'report.md'}")
    plots = sorted(str(p) for p in wd.glob("*.png"))
    if plots:
        parts.append("plots " + " ".join(plots))
    if (wd / "export").is_dir():
        parts.append(f"HF checkpoint {wd / 'export'}/")
    if (wd / "summary.json").is_file():
        parts.append(f"numbers {wd / 'summary.json'}")
    return "outputs: " + ("; ".join(parts) if parts else f"none found in {wd}")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # what a restart's cost is measured from (run.restart)
    args = parse_args(argv)
    if args.list_config:
        print(listing.format_config_listing())
        return 0
    # A bare command would quietly start a long run of defaults; bindings alone are a deliberate
    # choice (the end-to-end tests run that way), as is --defaults.
    if not (args.gin_file or args.gin_param or args.defaults):
        print(no_gin_file_message(), file=sys.stderr)
        return 2
    if args.defaults and args.gin_file:
        print(
            f"error: --defaults runs TrainConfig's built-in defaults without a gin file, but "
            f"--gin_file {' '.join(args.gin_file)} was also given; drop one of them",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = load_config(args.gin_file, args.gin_param)
        layout = (cfg.processes.trainer_processes, cfg.processes.engine_replicas)
        if args.join is None:  # a replica joining mid-run is given its flags: it has no index
            args = resolve_flags(args, os.environ, *layout)
        # Heavy imports (jax) only after the config checks.
        from jaxrl_orch.run import stages

        parts, claim = _prepare(stages, cfg, args, started)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(parts, dict):  # the workdir's run is complete: nothing to run or write
        if claim is None:
            return 0  # a peer: the leader, which holds the claim, reports it
        claim.release()
        return _report_finished(args.workdir, parts)
    from jaxrl_orch.run.stop import StopFlag

    stop = StopFlag(parts.role)
    try:
        with _signals_stop(stop, cfg.orchestrator.drain_timeout_s):
            summary = _run(stages, parts, stop)
    except Exception as exc:
        storage = storage_error(exc)
        if storage is None:
            raise
        print(f"error: {storage}", file=sys.stderr)
        return 1
    finally:
        if claim is not None:
            claim.release()
    if not parts.role.leader:
        return 0  # the leader reports the run
    print(json.dumps({k: summary[k] for k in _HEADLINE if k in summary}))
    print(outputs_line(args.workdir))
    return 0


def _report_finished(workdir: str, summary: dict[str, Any]) -> int:
    from jaxrl_orch.run.finished import finished_line

    print(finished_line(workdir, summary))
    print(json.dumps({k: summary[k] for k in _HEADLINE if k in summary}))
    print(outputs_line(workdir))
    return 0


def _prepare(
    stages: ModuleType, cfg: TrainConfig, args: argparse.Namespace, started: float
) -> tuple[RunParts | dict[str, Any], Any]:
    """This process's role (joining the trainer group's cluster first), the workdir claimed
    when this process writes it (``owner``; a launcher's claim is adopted), then the run's
    parts, or the summary of a run the workdir holds complete (``stages.finished``)."""
    from jaxrl_orch.distributed.group import Role, join_group, resolve_role
    from jaxrl_orch.owner import claim_workdir, handed_fd_from_env

    p, r = cfg.processes.trainer_processes, cfg.processes.engine_replicas
    # A replica joining mid-run comes after the run's own: the pool gives it its index.
    role = Role("engine", p + r, p, r) if args.join else resolve_role(p, r, args.process_index)
    replicas = _replicas(r, args)
    handed = handed_fd_from_env()
    claim = claim_workdir(args.workdir, handed) if role.leader else None
    try:
        role = join_group(role, args.coordinator_address, args.host_address)  # before any JAX
        if claim is None and role.leader:  # on a TPU slice the index is known only now
            claim = claim_workdir(args.workdir, handed)
        if role.kind != "single":
            print(f"[process {role.process_index}] {role.describe()}", flush=True)
        workdir = as_path(args.workdir)  # gs:// a URL
        done = stages.finished(cfg, workdir, role)
        if done is not None:
            return done, claim
        return stages.prepare(cfg, workdir, role, replicas, started), claim
    except BaseException:
        if claim is not None:
            claim.release()
        raise


def _replicas(engine_replicas: int, args: argparse.Namespace) -> Replicas:
    """Where the engine replicas are (``--engine_addresses``, ``--weight_source``,
    ``--api_key_file``), checked against the config's ``engine_replicas``."""
    from jaxrl_orch.distributed.addresses import Replicas, host_port, read_api_key, replica_urls

    if args.join is not None:
        return _joiner(args)
    urls = replica_urls(args.engine_addresses)
    if engine_replicas and len(urls) != engine_replicas:
        raise ValueError(
            f"--engine_addresses names {len(urls)} replicas ({args.engine_addresses!r}); "
            f"the config has engine_replicas={engine_replicas}"
        )
    if args.weight_source is not None:
        host_port(args.weight_source)
    elif engine_replicas:
        raise ValueError(
            "--weight_source=HOST:PORT is missing: trainer process 0 offers new weights there "
            "and every engine replica pulls them from there (launch_local sets it)"
        )
    return Replicas(urls, args.weight_source, read_api_key(args.api_key_file))


def _joiner(args: argparse.Namespace) -> Replicas:
    """Where a replica joining mid-run serves (``--join``), and the run it joins."""
    from jaxrl_orch.distributed.addresses import Replicas, bind_of, host_port, read_api_key

    for flag in ("process_index", "engine_addresses"):
        if getattr(args, flag) not in (None, ""):
            raise ValueError(f"--join serves a replica the run numbers itself: drop --{flag}")
    if args.weight_source is None:
        raise ValueError("--join needs --weight_source=HOST:PORT: the run's trainer process 0")
    bind_of(args.join, "--join")
    host_port(args.weight_source)
    key = read_api_key(args.api_key_file)
    if key is None:
        raise ValueError("--join needs --api_key_file: the run admits only replicas with its key")
    return Replicas((), args.weight_source, key, join=args.join.rstrip("/"))


def _run(stages: ModuleType, parts: RunParts, stop: StopFlag) -> dict[str, Any]:
    stages.write_config(parts, gin.config_str())
    t0 = time.time()
    summary = stages.run(parts, stop)
    summary["wall_seconds"] = time.time() - t0
    summary["stopped_by_signal"] = stop.signal
    stages.finish(parts, summary)
    return summary


@contextlib.contextmanager
def _signals_stop(stop: StopFlag, drain_timeout_s: float) -> Iterator[None]:
    """SIGTERM / Ctrl-C set ``stop`` (drain, checkpoint, exit 0); a second one exits at once.
    The previous handlers come back afterwards: ``main`` also runs in-process (tests)."""

    def on_signal(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            # No drain. Metrics rows are flushed as written and checkpoints are committed
            # atomically, so the last committed checkpoint is what resumes.
            print(
                f"\n{name} again: exiting now without the drain; the same command resumes "
                "from the last checkpoint",
                file=sys.stderr,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)
        print(
            f"\n{name}: draining (at most drain_timeout_s={drain_timeout_s:g}s), then a "
            "checkpoint; send it again to exit at once",
            file=sys.stderr,
        )
        stop.set(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_TENSORSTORE_ERRNO = re.compile(r"(os_error_code='(\d+)')")
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def storage_error(exc: BaseException) -> str | None:
    """The one line for a run stopped by its storage (disk full, read-only, permissions), found
    anywhere in ``exc``'s chain (orbax and the event loop wrap the ``OSError``); else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    fix = "free space or fix the permissions there, then rerun the same command: it resumes "
    fix += "from the last checkpoint"
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return (
                f"{e.strerror or os.strerror(e.errno)} writing {e.filename or 'the workdir'}; {fix}"
            )
        found = _TENSORSTORE_ERRNO.search(str(e))  # tensorstore's errors are not OSErrors
        if found and int(found.group(2)) in _STORAGE_ERRNOS:
            text = str(e).splitlines()[0][:400]
            return f"{os.strerror(int(found.group(2)))} ({text}); {fix}"
        e = e.__cause__ or e.__context__
    return None


_HEADLINE = (
    "eval_reward_before_rl",
    "eval_reward_final",
    "rl_steps",
    "wall_seconds",
    "stopped_by_signal",
)


def cli(argv: list[str] | None = None) -> int:
    """The command (``python -m jaxrl_orch.train``, ``jaxrl-train``): ``main``, then an exit
    that no thread left hanging by environment code can hold up (``run.ending``)."""
    rc = main(argv)
    from jaxrl_orch.run.ending import exit_code

    return exit_code(rc)


if __name__ == "__main__":
    raise SystemExit(cli())
