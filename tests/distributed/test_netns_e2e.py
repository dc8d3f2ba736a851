"""End-to-end: a run over hosts of their own, each a network namespace (``support.netns``).

Two trainer hosts (2 CPU devices each) and two replica hosts, each with its own interface and
address, run the same command, ``python -m jaxrl_orch.train``, with the environment a GKE
JobSet gives its pods (the run's layout read from it: ``distributed.platform``) and names that
resolve as the JobSet's headless service resolves them. The run completes with the losses of
the one-process run, and every host's socket table, read all through the run, shows each
listener on its own host's address and every connection between two hosts' addresses: nothing
binds every interface, and nothing dials a loopback address another host was meant to be.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from support import netns
from support.multiprocess import assert_same_run, env, params, single_run, wait_single

from jaxrl_orch.distributed.platform import COORDINATOR_PORT, ENGINE_PORT, WEIGHT_PORT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
]

JOBSET = "run1"
# host -> (replicated job, JOB_INDEX, JOB_COMPLETION_INDEX), as JobSet labels its pods
PODS = {
    "trainer-0": ("trainer", 0, 0),
    "trainer-1": ("trainer", 0, 1),
    "engine-0": ("engine", 0, 0),
    "engine-1": ("engine", 1, 0),
}
Table = netns.Table


def pod_name(host: str) -> str:
    """The pod's DNS name in the JobSet's headless service: ``<jobset>-<job>-<i>-<j>.<sub>``."""
    job, i, j = PODS[host]
    return f"{JOBSET}-{job}-{i}-{j}.{JOBSET}"


def pod_env(host: str) -> dict[str, str]:
    """What the pod's environment holds: the JobSet's labels (downward API), the Indexed Job's
    completion index, the hostname Kubernetes sets."""
    job, i, j = PODS[host]
    found = env(2)
    found.update(
        JOBSET_NAME=JOBSET,
        REPLICATED_JOB_NAME=job,
        JOB_INDEX=str(i),
        JOB_COMPLETION_INDEX=str(j),
        HOSTNAME=pod_name(host).split(".")[0],
    )
    return found


@pytest.fixture
def hosts():
    made = netns.Hosts({host: [pod_name(host)] for host in PODS})
    yield made
    made.close()


def _key(tmp_path: Path) -> Path:
    path = tmp_path / "engine.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("a-key-of-this-test-only")
    return path


def _run(hosts: netns.Hosts, cmd: list[str], logs: Path) -> dict[str, Table]:
    """``cmd`` on every host, each with its pod's environment, until the trainers exit; then
    the replicas get SIGTERM, as a JobSet's pods do when it completes. Returns each host's
    socket table over the run (every entry seen, read twice a second)."""
    logs.mkdir()
    procs = {}
    for host in PODS:  # replicas first, as a JobSet starts them: in no particular order
        with open(logs / f"{host}.log", "w") as out:
            procs[host] = hosts.popen(host, cmd, env=pod_env(host), stdout=out, stderr=out)
    seen: dict[str, Table] = {host: set() for host in PODS}
    trainers = [procs[h] for h in PODS if h.startswith("trainer")]
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in trainers) and time.monotonic() < deadline:
        for host, proc in procs.items():
            seen[host] |= hosts.sockets(host, proc)
        if any(p.poll() not in (None, 0) for p in procs.values()):
            break
        time.sleep(0.5)
    for host in ("engine-0", "engine-1"):
        if procs[host].poll() is None:
            procs[host].send_signal(signal.SIGTERM)
    codes = {}
    for host, proc in procs.items():
        try:
            codes[host] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            codes[host] = "still running"
    assert codes == dict.fromkeys(PODS, 0), (codes, _tails(logs))
    return seen


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))


def _check_sockets(seen: Mapping[str, Table], address: Mapping[str, str]) -> None:
    """Every listener on its own host's address; every connection from its host's address to
    another host's (a loopback or wildcard end at either side would be an address of no host)."""
    assert netns.misplaced(seen, address) == dict.fromkeys(seen, []), address
    for host, table in seen.items():
        assert any(row[0] == "LISTEN" for row in table), (host, table)
    # The run's traffic crossed hosts: the group's coordinator, the weight pulls, the requests.
    leader = address["trainer-0"]
    assert any(r[3:] == (leader, COORDINATOR_PORT) for r in seen["trainer-1"]), seen["trainer-1"]
    assert (leader, COORDINATOR_PORT) in {r[1:3] for r in seen["trainer-0"] if r[0] == "LISTEN"}
    for replica in ("engine-0", "engine-1"):
        assert any(r[3:] == (leader, WEIGHT_PORT) for r in seen[replica]), (replica, seen[replica])
        to_replica = (address[replica], ENGINE_PORT)
        assert any(r[3:] == to_replica for r in seen["trainer-0"]), (replica, seen["trainer-0"])


def test_two_trainer_hosts_and_two_replica_hosts_under_a_jobset_match_one_process(
    tmp_path: Path, hosts: netns.Hosts
) -> None:
    steps = ["RL.steps = 2", "Orchestrator.max_staleness = 0"]
    single = single_run(tmp_path / "single", *steps)  # meanwhile: the run waits on its hosts
    workdir = tmp_path / "multi"  # on GKE a gs:// URL; here every namespace sees this path
    try:
        layout = ["Processes.trainer_processes = 2", "Processes.engine_replicas = 2"]
        cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={workdir}"]
        cmd += [f"--api_key_file={_key(tmp_path)}", *params(*steps, *layout)]
        seen = _run(hosts, cmd, tmp_path / "logs")
    except BaseException:
        single.kill()
        raise
    wait_single(single)
    logs = tmp_path / "logs"
    assert_same_run(tmp_path / "single", workdir, 2, _tails(logs))
    for host, (job, i, j) in PODS.items():
        k = j if job == "trainer" else 2 + i
        log = (logs / f"{host}.log").read_text()
        line = next(x for x in log.splitlines() if "platform" in x)
        assert line.startswith(
            f"== platform: gke-jobset (JOBSET_NAME={JOBSET}, REPLICATED_JOB_NAME={job}, "
            f"JOB_INDEX={i}, JOB_COMPLETION_INDEX={j}): process {k}, coordinator "
            f"{JOBSET}-trainer-0-0.{JOBSET}:{COORDINATOR_PORT}, "
        ), line
        if job == "trainer":  # the listener no flag names: on the address of the pod's name
            listen = f"[process {k}] the trainer group's collectives listen on "
            where = f"{listen}{hosts.address[host]} (--host_address, or the platform"
            assert where in log, log[-3000:]
    _check_sockets(seen, hosts.address)
