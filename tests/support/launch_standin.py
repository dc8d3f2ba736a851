"""Stand-ins for the processes ``jaxrl-launch-local`` starts, without JAX, so a test sees the
launcher's own work (its claim, the hand-off, its supervision) in seconds.

``python -m support.launch_standin MODE [the train command's flags] --process_index=K``
(``tests/`` on ``PYTHONPATH``): the launcher starts it in place of ``python -m jaxrl_orch.train``
(``LocalLauncher(..., program=...)``), with the flags it gives every process.

- Trainer process 0 adopts the claim the launcher handed it (``owner.HANDOFF_ENV``), checks that
  a fresh claim on the workdir is refused while it holds it (one lock, not two), prints
  ``ADOPTED``, then waits for ``WORKDIR/go`` and exits 0. Another trainer waits likewise.
- A replica, by ``MODE``: ``serve`` prints ``serving`` and waits like a trainer; ``same`` fails
  at start the same way every time (a line, then ``error: Engine.slots must be >= 1, got 0``,
  exit 2); ``differs`` fails at start with the number of its start in the error line;
  ``drained`` exits 0 at once, as a replica the run drained does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jaxrl_orch.owner import WorkdirBusy, claim_workdir, handed_fd_from_env

WAIT_S = 120.0


def _flag(argv: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def _wait_for_go(workdir: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not (workdir / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _trainer(workdir: Path, index: int) -> int:
    if index == 0:
        claim = claim_workdir(workdir, handed_fd_from_env())
        try:
            claim_workdir(workdir).release()
            print("a fresh claim was granted beside the adopted one", flush=True)
            return 3
        except WorkdirBusy:
            print("ADOPTED: a fresh claim is refused", flush=True)
        _wait_for_go(workdir)
        claim.release()
        return 0
    _wait_for_go(workdir)
    return 0


def _replica(workdir: Path, index: int, mode: str) -> int:
    print(f"replica {index} starting", flush=True)
    if mode == "drained":
        print("drained: it may exit", flush=True)
        return 0
    if mode == "serve":
        print("serving", flush=True)
        _wait_for_go(workdir)
        return 0
    starts = workdir / f"starts_{index}"
    with open(starts, "a") as f:
        f.write("x")
    count = f" (start {len(starts.read_text())})" if mode == "differs" else ""
    print(f"error: Engine.slots must be >= 1, got 0{count}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str]) -> int:
    mode, flags = argv[0], argv[1:]
    workdir, index = Path(_flag(flags, "workdir")), int(_flag(flags, "process_index"))
    trainers = [a for a in flags if a.startswith("--gin_param=Processes.trainer_processes")]
    p = int(trainers[0].rsplit("=", 1)[1])
    return _trainer(workdir, index) if index < p else _replica(workdir, index, mode)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
