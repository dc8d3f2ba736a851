"""One run per workdir (``owner``): a second command on a workdir in use is refused at start,
naming the owner, and writes nothing; a run killed with SIGKILL leaves no stale claim; a claim
handed to a child (the launcher's, to trainer process 0) is one lock, adopted only when it is
the workdir's and held."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from support.checkout import subprocess_env

from jaxrl_orch import owner, train
from jaxrl_orch.owner import WorkdirBusy, claim_workdir

HOLD = (
    "import sys, time; from jaxrl_orch.owner import claim_workdir; "
    "claim_workdir(sys.argv[1]); print('HELD', flush=True); time.sleep(600)"
)


def _holder(workdir) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert proc.stdout.readline().strip() == "HELD", proc.poll()
    return proc


def test_a_second_command_on_a_workdir_in_use_is_refused_before_any_work(tmp_path, capsys):
    workdir = tmp_path / "run"
    holder = _holder(workdir)
    try:
        rc = train.main([f"--workdir={workdir}", "--gin_param=RL.steps = 1"])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert f"pid {holder.pid} on host {socket.gethostname()}" in err
        assert "in use by another run" in err and str(workdir) in err
        assert sorted(p.name for p in workdir.iterdir()) == ["run.lock"]  # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Killed with SIGKILL: the kernel dropped its lock, so the next claim succeeds at once.
    claim = claim_workdir(workdir)
    record = json.loads((workdir / "run.lock").read_text())
    assert record["pid"] == os.getpid()
    with pytest.raises(WorkdirBusy, match=f"pid {os.getpid()}"):
        claim_workdir(workdir)  # another claim, even from this process, is refused
    claim.release()
    claim_workdir(workdir).release()


ADOPT = """
import sys
from jaxrl_orch.owner import WorkdirBusy, claim_workdir, handed_fd_from_env
claim_workdir(sys.argv[1], handed_fd_from_env())
try:
    claim_workdir(sys.argv[1])
except WorkdirBusy:
    print("ONE LOCK")
"""


def test_a_claim_handed_to_a_child_is_one_lock_held_until_both_let_go(tmp_path):
    workdir = tmp_path / "run"
    claim = claim_workdir(workdir)
    record = (workdir / "run.lock").read_bytes()
    env = subprocess_env(**{owner.HANDOFF_ENV: str(claim.fd)})
    child = subprocess.run(
        [sys.executable, "-c", ADOPT, str(workdir)],
        pass_fds=(claim.fd,),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # The child adopted the claim, and a fresh claim beside it was refused.
    assert child.returncode == 0 and child.stdout.strip() == "ONE LOCK", child.stderr
    assert (workdir / "run.lock").read_bytes() == record  # it still names the launcher
    with pytest.raises(WorkdirBusy, match=f"pid {os.getpid()}"):
        claim_workdir(workdir)  # the child is gone; the launcher holds on
    claim.release()
    claim_workdir(workdir).release()


def test_a_handed_descriptor_is_adopted_only_as_the_workdirs_held_lock(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    claim = claim_workdir(workdir)
    try:
        with pytest.raises(ValueError, match=rf"{owner.HANDOFF_ENV}={other} is not .*run.lock"):
            claim_workdir(workdir, handed_fd=other)
        # The workdir's lock file, but not the launcher's open file: it holds nothing.
        stray = os.open(workdir / "run.lock", os.O_RDWR)
        with pytest.raises(WorkdirBusy, match=f"pid {os.getpid()}"):
            claim_workdir(workdir, handed_fd=stray)
        with pytest.raises(OSError):
            os.fstat(stray)  # closed: it never holds the lock later
        with pytest.raises(ValueError, match="was not handed on"):
            claim_workdir(workdir, handed_fd=stray)
    finally:
        claim.release()
        os.close(other)
    monkeypatch.setenv(owner.HANDOFF_ENV, "three")
    with pytest.raises(ValueError, match=f"{owner.HANDOFF_ENV}='three' is not a file descriptor"):
        owner.handed_fd_from_env()
    monkeypatch.setenv(owner.HANDOFF_ENV, "7")
    assert owner.handed_fd_from_env() == 7
    assert owner.HANDOFF_ENV not in os.environ  # taken once: no child of the run inherits it


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_a_workdir_that_cannot_be_a_directory_is_one_line_naming_it(tmp_path, kind):
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    workdir = blocker if kind == "a file" else blocker / "run"
    with pytest.raises(ValueError, match=f"workdir {workdir} cannot be a directory") as exc:
        claim_workdir(workdir)
    assert "\n" not in str(exc.value)


def test_an_object_store_claim_is_taken_over_only_once_its_owner_stopped_refreshing(tmp_path):
    # The object-store claim on a local path: the same record logic without a bucket.
    now = [1_000_000.0]
    lock = tmp_path / owner.LOCK_NAME
    lock.write_text(json.dumps({"host": "tpu-vm-3", "pid": 41, "refreshed": now[0] - 30}))
    with pytest.raises(WorkdirBusy, match="pid 41 on host tpu-vm-3.*refreshed 30 s ago"):
        owner._ObjectClaim(tmp_path, clock=lambda: now[0])
    now[0] += owner.STALE_S  # the owner stopped refreshing (a preempted VM)
    claim = owner._ObjectClaim(tmp_path, clock=lambda: now[0])
    record = json.loads(lock.read_text())
    assert record["pid"] == os.getpid() and record["refreshed"] == now[0]
    claim.release()
    assert not lock.exists()


def test_the_claim_record_names_this_process(tmp_path):
    claim = claim_workdir(tmp_path / "w")
    record = json.loads((tmp_path / "w" / "run.lock").read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert abs(record["since"] - time.time()) < 60
    claim.release()


def test_a_workdir_url_the_run_cannot_write_is_one_line_before_any_work(tmp_path, capsys):
    rc = train.main(["--workdir=s3://bucket/run", "--gin_param=RL.steps = 1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "unsupported URL 's3://bucket/run'" in err


def _refused() -> None:
    # How gcsfs fails against a closed port: the connection error wrapped by its retries.
    try:
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
    except ConnectionRefusedError as exc:
        raise RuntimeError("retries exhausted\n(ninety lines of client frames)") from exc


def test_an_unreachable_or_silent_object_store_is_one_line_naming_the_workdir():
    with pytest.raises(ValueError) as exc:
        owner._reach("gs://bucket/run", _refused)
    text = str(exc.value)
    assert text.startswith("workdir gs://bucket/run: its storage cannot be reached")
    assert "ConnectionRefusedError: [Errno 111] Connect call failed" in text and "\n" not in text
    with pytest.raises(ValueError, match=r"gs://bucket/run: .*no answer within 0.2 s"):
        owner._reach("gs://bucket/run", lambda: time.sleep(30), timeout_s=0.2)
    assert owner._reach("gs://bucket/run", lambda: True) is True


@pytest.mark.slow
def test_the_train_command_on_an_unreachable_bucket_ends_in_one_line(tmp_path):
    # Real gcsfs against a port nothing listens on: its retries run out, then one line.
    env = subprocess_env(JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST="http://127.0.0.1:9")
    cmd = [sys.executable, "-m", "jaxrl_orch.train", "--workdir=gs://no-bucket/run"]
    out = subprocess.run(
        [*cmd, "--gin_param=RL.steps = 1"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "workdir gs://no-bucket/run: its storage cannot be reached" in lines[0]
