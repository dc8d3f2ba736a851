"""``jaxrl-launch-local``: a whole multi-process run on one machine (like torchrun).

    python -m jaxrl_orch.distributed.launch_local --trainer_processes=2 --engine_replicas=2 \\
        --gin_file=configs/reverse_text.gin [--gin_param=...] --workdir=runs/multi

What it owns: the processes of one run on this machine. It picks free loopback ports (the
trainer group's jax.distributed coordinator, one HTTP port per replica, passed as
``--engine_addresses=http://127.0.0.1:PORT,...``, and the trainer leader's weight server,
passed to every process as ``--weight_source=127.0.0.1:PORT``: the leader offers there, each
replica pulls only from there, with the run's key), gives every process its own
``--devices_per_process`` fake CPU devices (``XLA_FLAGS``) unless told to leave the devices
alone, and starts ``python -m
jaxrl_orch.train`` once per process with the layout bound (``Processes.trainer_processes`` /
``engine_replicas``) and that process's ``--process_index``: 0..P-1 train (0 also runs the
orchestrator), P..P+R-1 serve. Other flags go to every process; without ``--api_key_file``
the replicas get a fresh key of this launch (``WORKDIR/logs/engine.key``, mode 0600); a key
file of the user's that its group or others may read or write is refused. Each process's
output goes to ``WORKDIR/logs/process_<K>_<role>.log``; process 0's is also echoed here. The
workdir (a local path: every process runs here) gets the same outputs as the single-process
command (``summary.json``, ``metrics.jsonl``, checkpoints, report, export).

Ownership: the launcher claims the workdir (``owner``: ``run.lock``) before it writes anything
there, its key and its logs included, and hands the held claim to trainer process 0 (the
descriptor inherited, its number in ``owner.HANDOFF_ENV``), which adopts it instead of
claiming: one lock from the launch to the launcher's exit. A workdir in use is refused (exit
2) naming its owner, with nothing written.

Supervision
    - The run ends when the trainer processes have exited: exit status 0 when all did,
      otherwise the first failure's; the replicas are then stopped (SIGTERM, then SIGKILL).
    - A trainer process that dies stops the whole run at once (the others would block in a
      collective), naming it and its log; the same command resumes from the last checkpoint.
    - A replica that dies is restarted (``--restart_replicas``, on by default) on the same
      port; it pulls the current weights before it serves again. One that exits 0 was drained
      on purpose (SIGTERM to it: it asked the run to drain it, docs/scale-out.md) and is left
      stopped. One that exits the same way
      twice in a row (``replica_exits``) stops the run with its last line and its log's path.
    - Every process dies with the launcher (Linux ``PR_SET_PDEATHSIG``), even a kill -9 of it.
    - SIGTERM / SIGINT here: passed to trainer process 0, which drains (at most
      ``drain_timeout_s``), checkpoints and tells its peers to stop; past the deadline
      (``--stop_timeout_s``) every process is killed. A second signal kills at once.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jaxrl_orch.distributed.addresses import read_api_key
from jaxrl_orch.distributed.replica_exits import ExitWatch
from jaxrl_orch.owner import HANDOFF_ENV, WorkdirClaim, claim_workdir
from jaxrl_orch.paths import is_url

TRAIN = (sys.executable, "-m", "jaxrl_orch.train")

# Set per process by the launcher; a user's would point the processes at the wrong places.
LAUNCHER_FLAGS = (
    "--process_index",
    "--coordinator_address",
    "--engine_addresses",
    "--weight_source",
)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback TCP ports (bound then released, so a process can take one)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, SIGKILL it when the launcher dies (even by kill -9),
    so no process of the run outlives it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.distributed.launch_local",
        description="Start every process of a multi-process run on this machine.",
        epilog="Other flags (--gin_file, --gin_param, --workdir, ...) go to every process's "
        "python -m jaxrl_orch.train.",
    )
    p.add_argument("--trainer_processes", type=int, default=2)
    p.add_argument("--engine_replicas", type=int, default=1)
    p.add_argument(
        "--devices_per_process",
        type=int,
        default=2,
        help="fake CPU devices per process (XLA_FLAGS); 0: leave the devices as they are",
    )
    p.add_argument("--workdir", default="runs/launch_local")
    p.add_argument("--restart_replicas", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max_restarts", type=int, default=10, help="replica restarts in all")
    p.add_argument("--stop_timeout_s", type=float, default=120.0)
    args, rest = p.parse_known_args(argv)
    if args.trainer_processes < 1:
        p.error(f"--trainer_processes must be >= 1, got {args.trainer_processes}")
    if args.engine_replicas < 1:
        p.error(
            f"--engine_replicas must be >= 1, got {args.engine_replicas} (a run without "
            "replicas is the single-process command: python -m jaxrl_orch.train)"
        )
    for flag in LAUNCHER_FLAGS:
        if any(a.split("=")[0] == flag for a in rest):
            p.error(f"{flag} is set by the launcher for every process; leave it out")
    return args, rest


def check_inputs(args: argparse.Namespace, rest: list[str]) -> None:
    """What the launcher is given, checked before it claims or writes anything."""
    if is_url(args.workdir):
        raise ValueError(
            f"--workdir={args.workdir!r}: jaxrl-launch-local starts every process on this "
            "machine and keeps their logs in the workdir; give a local path"
        )
    key_file = flag_value(rest, "--api_key_file")
    if key_file is not None:
        read_api_key(key_file)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag=V`` or ``--flag V``; the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
    return value


class LocalLauncher:
    """The processes of one run; built once the workdir's ``claim`` is held (``main``)."""

    def __init__(
        self,
        args: argparse.Namespace,
        train_args: list[str],
        claim: WorkdirClaim,
        program: tuple[str, ...] = TRAIN,
    ) -> None:
        self.args = args
        self.claim = claim
        self.program = program
        self.p = args.trainer_processes
        self.r = args.engine_replicas
        ports = free_ports(2 + self.r)
        self.coordinator = f"127.0.0.1:{ports[0]}"
        self.weight_source = f"127.0.0.1:{ports[1]}"
        self.addresses = [f"http://127.0.0.1:{port}" for port in ports[2:]]
        self.logs = Path(args.workdir) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.train_args = [
            *train_args,
            f"--workdir={args.workdir}",
            f"--gin_param=Processes.trainer_processes = {self.p}",
            f"--gin_param=Processes.engine_replicas = {self.r}",
            f"--coordinator_address={self.coordinator}",
            f"--engine_addresses={','.join(self.addresses)}",
            f"--weight_source={self.weight_source}",
        ]
        if self.r and not any(a.startswith("--api_key_file") for a in train_args):
            self.train_args.append(f"--api_key_file={self._new_key()}")
        self.procs: dict[int, subprocess.Popen] = {}
        self.exits = ExitWatch()
        self.restarts = 0
        self.drained: set[int] = set()  # replicas that exited 0: left the run on purpose
        self.stop_at: float | None = None

    def _new_key(self) -> Path:
        """A fresh secret for this launch's replicas, readable by this user only: any other
        local user or process reaching a replica's port is refused."""
        path = self.logs / "engine.key"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        return path

    def role(self, k: int) -> str:
        return "trainer" if k < self.p else "engine"

    def start(self, k: int) -> None:
        env = dict(os.environ)
        if self.args.devices_per_process:
            flags = env.get("XLA_FLAGS", "")
            flags = " ".join(f for f in flags.split() if "host_platform_device_count" not in f)
            n = self.args.devices_per_process
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
            env.setdefault("JAX_PLATFORMS", "cpu")
        handed: tuple[int, ...] = ()
        if k == 0:  # the process that writes the workdir runs under the launcher's claim
            handed = (self.claim.fd,)
            env[HANDOFF_ENV] = str(self.claim.fd)
        path = self.logs / f"process_{k}_{self.role(k)}.log"
        self.exits.started(k, path)
        log = open(path, "ab")  # noqa: SIM115
        self.procs[k] = subprocess.Popen(
            [*self.program, *self.train_args, f"--process_index={k}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            pass_fds=handed,
        )
        log.close()

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_at is not None:
            print(f"{signal.Signals(signum).name} again: killing every process", flush=True)
            self.kill_all()
            return
        print(
            f"{signal.Signals(signum).name}: trainer process 0 drains and checkpoints; every "
            f"process is killed past {self.args.stop_timeout_s:g} s",
            flush=True,
        )
        self.stop_at = time.monotonic() + self.args.stop_timeout_s
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGTERM)

    def run(self) -> int:
        for k in range(self.p, self.p + self.r):  # replicas first: they import and compile
            self.start(k)
        for k in range(self.p):
            self.start(k)
        print(
            f"launch_local: {self.p} trainer process(es) (coordinator {self.coordinator}), "
            f"{self.r} engine replica(s) at {', '.join(self.addresses)}, weights offered at "
            f"{self.weight_source}; logs in {self.logs}",
            flush=True,
        )
        follow = open(self.logs / "process_0_trainer.log", "rb")  # noqa: SIM115
        try:
            return self._supervise(follow)
        finally:
            follow.close()
            self.stop_replicas()

    def _supervise(self, follow: Any) -> int:
        while True:
            chunk = follow.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            codes = {k: self.procs[k].poll() for k in range(self.p)}
            failed = [k for k, c in codes.items() if c not in (None, 0)]
            if failed:
                k = failed[0]
                print(
                    f"launch_local: trainer process {k} exited with {codes[k]} (log "
                    f"{self.logs / f'process_{k}_trainer.log'}); stopping the run. The same "
                    "command resumes from the last checkpoint",
                    flush=True,
                )
                self.kill_all()
                sys.stdout.write(follow.read().decode(errors="replace"))
                return codes[k] if codes[k] > 0 else 128 - codes[k]
            if all(c == 0 for c in codes.values()):
                sys.stdout.write(follow.read().decode(errors="replace"))
                return 0
            for k in range(self.p, self.p + self.r):
                code = self.procs[k].poll()
                if code == 0 and k not in self.drained:
                    self.drained.add(k)
                    print(
                        f"launch_local: engine replica {k - self.p} drained and exited 0; "
                        "not restarted",
                        flush=True,
                    )
                elif code and self.args.restart_replicas and self.stop_at is None:
                    stopped = self._replica_exited(k, code)
                    if stopped is not None:
                        self.kill_all()
                        return stopped
            if self.stop_at is not None and time.monotonic() > self.stop_at:
                print("launch_local: the stop deadline passed; killing every process", flush=True)
                self.kill_all()
                return 124
            time.sleep(0.2)

    def _replica_exited(self, k: int, code: int) -> int | None:
        """Restart replica ``k``, or stop the run (its exit status) when it exited as it did
        last time (``replica_exits``) or the restarts are spent."""
        name, log = f"engine replica {k - self.p}", self.logs / f"process_{k}_engine.log"
        repeated = self.exits.exited(k, code)
        if repeated is not None:
            print(
                f"launch_local: {name} exited with {code} twice in a row, the same way: "
                f"{repeated or '(no output)'}\nlaunch_local: its log: {log}; stopping the run "
                "(a restart would fail again: fix the cause, then run the same command)",
                flush=True,
            )
            return code
        if self.restarts >= self.args.max_restarts:
            print(
                f"launch_local: {name} exited with {code} after {self.restarts} restarts "
                f"(--max_restarts; its log: {log}); stopping the run",
                flush=True,
            )
            return 1
        self.restarts += 1
        print(
            f"launch_local: {name} exited with {code}; restarting it (restart {self.restarts})",
            flush=True,
        )
        self.start(k)
        return None

    def stop_replicas(self, timeout_s: float = 10.0) -> None:
        for k in range(self.p, self.p + self.r):
            if self.procs[k].poll() is None:
                os.killpg(self.procs[k].pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill_all()


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(argv)
    try:
        check_inputs(args, rest)
        claim = claim_workdir(args.workdir)  # before anything is written there
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        launcher = LocalLauncher(args, rest, claim)
        sigs = (signal.SIGTERM, signal.SIGINT)
        previous = {s: signal.signal(s, launcher.on_signal) for s in sigs}
        try:
            return launcher.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        claim.release()


if __name__ == "__main__":
    raise SystemExit(main())
