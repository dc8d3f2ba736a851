"""One run per workdir: the owner record ``run.lock``, taken before anything writes the workdir.

Two runs on one workdir would interleave their metrics rows, overwrite each other's rollouts
and mix their checkpoints, and both would exit 0. ``claim_workdir(workdir)`` makes the second
one fail at start, naming the owner (host, pid, since when) and what to do.

How the claim holds
- A local workdir: an exclusive ``fcntl.flock`` on ``WORKDIR/run.lock``, held by an open file
  for the life of the process. The kernel drops it whenever the process ends, kill -9 included,
  so a crashed run never leaves a stale lock and the same command resumes at once. The file
  holds the owner's host, pid and start time, for the message. (``flock`` does not reach across
  hosts on a network filesystem: one host per local workdir.)
- A ``gs://`` workdir has no lock primitive that every host shares: the owner record is an
  object refreshed every ``REFRESH_S`` by a daemon thread. A record not refreshed for
  ``STALE_S`` is a run that died (a preempted TPU VM): it is taken over, with a line saying
  so. Claims that race within one refresh are not excluded: a guard against the mistake of a
  second command, not against a determined one.

Only trainer process 0 claims (it alone writes the workdir); ``release()`` ends the claim
early (tests), and an exiting process ends it anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from jaxrl_orch.paths import Pathish, as_path, is_url

LOCK_NAME = "run.lock"
REFRESH_S = 60.0
STALE_S = 300.0
REACH_S = 60.0  # the first call to a gs:// workdir: an answer, or one line


class WorkdirBusy(ValueError):
    """Another run owns the workdir."""


def _record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def _describe(owner: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("since", 0)))
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} (since {since})"


def _busy(workdir: Any, owner: dict[str, Any], fix: str) -> WorkdirBusy:
    return WorkdirBusy(
        f"workdir {workdir} is in use by another run: {_describe(owner)}. Two runs on one "
        f"workdir would mix their metrics, rollouts and checkpoints; {fix}"
    )


class _LocalClaim:
    def __init__(self, workdir: Any) -> None:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where the workdir or a parent should be, no permission
            reason = exc.strerror or type(exc).__name__
            raise ValueError(f"workdir {workdir} cannot be a directory: {reason}") from None
        path = os.fspath(workdir / LOCK_NAME)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_json(os.pread(self._fd, 4096, 0))
            self.release()
            fix = "wait for it to end or stop it (SIGTERM checkpoints it), then run again"
            raise _busy(workdir, owner, fix) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(_record()).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


class _ObjectClaim:
    def __init__(self, workdir: Any, clock: Any = time.time) -> None:
        self._path = workdir / LOCK_NAME
        self._clock = clock
        if _reach(workdir, self._path.exists):
            owner = _read_json(self._path.read_bytes())
            age = clock() - float(owner.get("refreshed", owner.get("since", 0)))
            if age < STALE_S:
                fix = (
                    f"wait for it to end or stop it; a record not refreshed for {STALE_S:g} s "
                    f"is taken over (this one was refreshed {age:.0f} s ago)"
                )
                raise _busy(workdir, owner, fix)
            print(f"== workdir {workdir}: taking over from a run that stopped ({_describe(owner)})")
        self._owner = _record()
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._refresh, name="workdir-owner", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self._path.write_text(json.dumps({**self._owner, "refreshed": self._clock()}))

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(Exception):  # one failed refresh is retried next time
                self._write()

    def release(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            with contextlib.suppress(Exception):
                self._path.unlink()


def _reach(workdir: Any, probe: Any, timeout_s: float = REACH_S) -> Any:
    """``probe()``, the first call to the workdir's storage, within ``timeout_s``: an
    unreachable service, a missing bucket or missing credentials end the command in one line
    naming the workdir, not in the client's hundred-line chain after minutes of retries."""
    done: dict[str, Any] = {}

    def call() -> None:
        try:
            done["value"] = probe()
        except Exception as exc:
            done["error"] = exc

    # gcsfs logs each exhausted retry with its whole traceback: the line below says it once.
    client_log = logging.getLogger("gcsfs")
    level = client_log.level
    client_log.setLevel(logging.CRITICAL)
    worker = threading.Thread(target=call, name="workdir-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    client_log.setLevel(level)
    if "value" in done:
        return done["value"]
    if "error" not in done:
        cause = f"no answer within {timeout_s:g} s"
    else:
        root = done["error"]
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        text = (str(root).splitlines() or [""])[0][:300]
        cause = f"{type(root).__name__}: {text}"
    raise ValueError(
        f"workdir {workdir}: its storage cannot be reached ({cause}); check the bucket's name, "
        "the credentials and the network"
    )


def _read_json(raw: bytes) -> dict[str, Any]:
    try:
        owner = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def claim_workdir(workdir: Pathish) -> _LocalClaim | _ObjectClaim:
    """Own ``workdir`` for this process (see the module docstring); raises ``WorkdirBusy``
    naming the current owner when another run holds it."""
    path = as_path(workdir)
    return _ObjectClaim(path) if is_url(path) else _LocalClaim(path)
