"""One run per workdir: the owner record ``run.lock``, taken before anything writes the workdir.

Two runs on one workdir would interleave their metrics rows, overwrite each other's rollouts
and mix their checkpoints, and both would exit 0. ``claim_workdir(workdir)`` makes the second
one fail at start, naming the owner (host, pid, since when) and what to do. Nothing of a run,
its launcher's keys and logs included, is written before its claim is held.

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

Handing a held claim on: ``jaxrl-launch-local`` claims the workdir before it writes its key or
its logs, then starts trainer process 0 with the claim's descriptor inherited (``pass_fds``)
and its number in ``HANDOFF_ENV``. Both descriptors share one open file, so they hold one
``flock``: from the launcher's claim to the end of the run there is never a moment without an
owner, nor two. Trainer process 0 adopts it (``claim_workdir(workdir, handed_fd=...)``) only
when the descriptor is this workdir's ``run.lock`` and holds its lock; the record keeps naming
the launcher, the process to stop.

Lives below ``run`` and ``distributed`` (its own layer, above ``paths``): the train command and
the launcher both claim through it. Only the process that writes the workdir claims (the
launcher, trainer process 0, or the single process); ``release()`` ends the claim early
(tests), and an exiting process ends it anyway.
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
HANDOFF_ENV = "JAXRL_RUN_LOCK_FD"  # set by the launcher for trainer process 0 only


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
    def __init__(self, workdir: Any, handed_fd: int | None = None) -> None:
        self._fd: int | None = None
        if handed_fd is not None:
            self._fd = _adopt(workdir, handed_fd)
            return
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where the workdir or a parent should be, no permission
            reason = exc.strerror or type(exc).__name__
            raise ValueError(f"workdir {workdir} cannot be a directory: {reason}") from None
        self._fd = os.open(os.fspath(workdir / LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(workdir, self._fd)
        except WorkdirBusy:
            self.release()
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(_record()).encode(), 0)

    @property
    def fd(self) -> int:
        """The descriptor holding the lock, for a child to inherit (``HANDOFF_ENV``)."""
        if self._fd is None:
            raise ValueError("the workdir claim was released: there is no lock to hand on")
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _lock(workdir: Any, fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read_json(os.pread(fd, 4096, 0))
        fix = "wait for it to end or stop it (SIGTERM checkpoints it), then run again"
        raise _busy(workdir, owner, fix) from None


def _adopt(workdir: Any, fd: int) -> int:
    """``fd``, inherited from the launcher, once it is shown to be this workdir's lock file and
    to hold its lock (a descriptor sharing the launcher's open file already does)."""
    path = os.fspath(workdir / LOCK_NAME)
    try:
        held, here = os.fstat(fd), os.stat(path)
    except OSError as exc:
        raise ValueError(
            f"{HANDOFF_ENV}={fd}: the launcher's claim on workdir {workdir} was not handed "
            f"on ({exc.strerror}); start the run with jaxrl-launch-local, or unset {HANDOFF_ENV}"
        ) from None
    if (held.st_dev, held.st_ino) != (here.st_dev, here.st_ino):
        raise ValueError(
            f"{HANDOFF_ENV}={fd} is not {path}: a launcher hands on the lock of the workdir it "
            f"claimed; give the same --workdir, or unset {HANDOFF_ENV}"
        )
    try:
        _lock(workdir, fd)
    except WorkdirBusy:
        os.close(fd)  # our copy of the lock file, holding nothing
        raise
    return fd


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


# What owning a workdir gives the owner: ``release()``, and ``fd`` for a local lock.
WorkdirClaim = _LocalClaim | _ObjectClaim


def claim_workdir(workdir: Pathish, handed_fd: int | None = None) -> WorkdirClaim:
    """Own ``workdir`` for this process (see the module docstring); raises ``WorkdirBusy``
    naming the current owner when another run holds it. ``handed_fd``: the launcher's claim,
    inherited (``handed_fd_from_env``)."""
    path = as_path(workdir)
    if handed_fd is not None:
        if is_url(path):
            raise ValueError(f"{HANDOFF_ENV}: a launcher hands on local workdirs only, not {path}")
        return _LocalClaim(path, handed_fd)
    return _ObjectClaim(path) if is_url(path) else _LocalClaim(path)


def handed_fd_from_env() -> int | None:
    """The descriptor a launcher handed this process (``HANDOFF_ENV``), taken out of the
    environment so no child of this process reads it too; None without one."""
    text = os.environ.pop(HANDOFF_ENV, None)
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"{HANDOFF_ENV}={text!r} is not a file descriptor number; unset it")
    return int(text)
