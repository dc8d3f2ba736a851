"""End-to-end: a run over hosts of their own, each a network namespace (``support.netns``).

Two trainer hosts (2 CPU devices each) and two replica hosts, each with its own interface and
address, run the same command, ``python -m jaxrl_orch.train``, with the environment the
scheduler gives its processes (the run's layout read from it: ``distributed.platform``) and
names that resolve as that scheduler's names do: a GKE JobSet's pods (their headless service),
a TPU VM slice's workers (``TPU_WORKER_HOSTNAMES``), a Slurm job step's tasks, one per node.
Each run completes with the losses of the one-process run, and every host's socket table, read
all through the run, shows each listener on its own host's address and every connection
between two hosts' addresses: nothing binds every interface, and nothing dials a loopback
address another host was meant to be.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
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
# The run's processes in order: process K is the K-th (trainers, then replicas).
HOSTS = ("trainer-0", "trainer-1", "engine-0", "engine-1")
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


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """How a scheduler names a run's hosts and what it sets in each process's environment."""

    platform: str  # as the platform line names it
    name: Callable[[str], str]  # host -> the name the others reach it by (its hostname first)
    variables: Callable[[str], dict[str, str]]  # host -> what the scheduler sets there
    read: tuple[str, ...]  # the variables the platform line names, in its order

    def env(self, host: str) -> dict[str, str]:
        return {**env(2), **self.variables(host)}

    def line(self, host: str) -> str:
        """How the platform line of ``host`` starts: what was read, K, the coordinator."""
        variables = self.variables(host)
        read = ", ".join(f"{k}={variables[k]}" for k in self.read)
        leader = self.name("trainer-0")
        return (
            f"== platform: {self.platform} ({read}): process {HOSTS.index(host)}, coordinator "
            f"{leader}:{COORDINATOR_PORT}, "
        )


def _jobset(host: str) -> dict[str, str]:
    """A pod's environment: the JobSet's labels (downward API), the Indexed Job's completion
    index, the hostname Kubernetes sets."""
    job, i, j = PODS[host]
    return {
        "JOBSET_NAME": JOBSET,
        "REPLICATED_JOB_NAME": job,
        "JOB_INDEX": str(i),
        "JOB_COMPLETION_INDEX": str(j),
        "HOSTNAME": pod_name(host).split(".")[0],
    }


def _tpu_vm(host: str) -> dict[str, str]:
    """A TPU VM worker's: its place in the slice and the slice's workers, in order (the
    whole run on one slice: the trainer group's workers first, then the replicas')."""
    workers = ",".join(f"w-{k}" for k in range(len(HOSTS)))
    return {"TPU_WORKER_ID": str(HOSTS.index(host)), "TPU_WORKER_HOSTNAMES": workers}


def _slurm(host: str) -> dict[str, str]:
    """A Slurm task's, one task per node (``srun --ntasks-per-node=1``)."""
    return {
        "SLURM_PROCID": str(HOSTS.index(host)),
        "SLURM_NTASKS": str(len(HOSTS)),
        "SLURM_STEP_NODELIST": f"node[01-{len(HOSTS):02d}]",
        "SLURMD_NODENAME": f"node{HOSTS.index(host) + 1:02d}",
    }


SCHEDULERS = {
    "gke-jobset": Scheduler(
        "gke-jobset",
        pod_name,
        _jobset,
        ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX"),
    ),
    "tpu-vm": Scheduler(
        "tpu-vm",
        lambda host: f"w-{HOSTS.index(host)}",
        _tpu_vm,
        ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"),
    ),
    "slurm": Scheduler(
        "slurm",
        lambda host: f"node{HOSTS.index(host) + 1:02d}",
        _slurm,
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST"),
    ),
}


@pytest.fixture(params=SCHEDULERS)
def scheduled(request):
    """The scheduler under test and its hosts: namespaces named as that scheduler names them."""
    scheduler = SCHEDULERS[request.param]
    made = netns.Hosts({host: [scheduler.name(host)] for host in HOSTS})
    yield scheduler, made
    made.close()


def _key(tmp_path: Path) -> Path:
    path = tmp_path / "engine.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("a-key-of-this-test-only")
    return path


def _run(scheduler: Scheduler, hosts: netns.Hosts, cmd: list[str], logs: Path) -> dict[str, Table]:
    """``cmd`` on every host, each with its scheduler's environment, until the trainers exit;
    then the replicas get SIGTERM, as a JobSet's pods do when it completes. Returns each host's
    socket table over the run (every entry seen, read twice a second)."""
    logs.mkdir()
    procs = {}
    for host in HOSTS:  # as a scheduler starts them: in no order the run may count on
        env = scheduler.env(host)
        with open(logs / f"{host}.log", "w") as out:
            procs[host] = hosts.popen(host, cmd, env=env, stdout=out, stderr=out)
    seen: dict[str, Table] = {host: set() for host in HOSTS}
    trainers = [procs[h] for h in HOSTS if h.startswith("trainer")]
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
    assert codes == dict.fromkeys(HOSTS, 0), (codes, _tails(logs))
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
        # A weight pull is a short connection: seen from either end (the side that closes
        # first keeps it in TIME_WAIT a while; the other's may be gone before a read).
        pull = (address[replica], leader, WEIGHT_PORT)
        at_replica = any((r[1], *r[3:]) == pull for r in seen[replica])
        at_leader = any((r[3], *r[1:3]) == pull for r in seen["trainer-0"])
        assert at_replica or at_leader, (replica, seen[replica], seen["trainer-0"])
        to_replica = (address[replica], ENGINE_PORT)
        assert any(r[3:] == to_replica for r in seen["trainer-0"]), (replica, seen["trainer-0"])


def test_two_trainer_hosts_and_two_replica_hosts_under_each_scheduler_match_one_process(
    tmp_path: Path, scheduled: tuple[Scheduler, netns.Hosts]
) -> None:
    scheduler, hosts = scheduled
    steps = ["RL.steps = 2", "Orchestrator.max_staleness = 0"]
    single = single_run(tmp_path / "single", *steps)  # meanwhile: the run waits on its hosts
    workdir = tmp_path / "multi"  # on GKE a gs:// URL; here every namespace sees this path
    try:
        layout = ["Processes.trainer_processes = 2", "Processes.engine_replicas = 2"]
        cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={workdir}"]
        cmd += [f"--api_key_file={_key(tmp_path)}", *params(*steps, *layout)]
        seen = _run(scheduler, hosts, cmd, tmp_path / "logs")
    except BaseException:
        single.kill()
        raise
    wait_single(single)
    logs = tmp_path / "logs"
    assert_same_run(tmp_path / "single", workdir, 2, _tails(logs))
    for host in HOSTS:
        k = HOSTS.index(host)
        log = (logs / f"{host}.log").read_text()
        line = next(x for x in log.splitlines() if "platform" in x)
        assert line.startswith(scheduler.line(host)), line
        if host.startswith("trainer"):  # the listener no flag names: on the address of its name
            listen = f"[process {k}] the trainer group's collectives listen on "
            where = f"{listen}{hosts.address[host]} (--host_address, or the platform"
            assert where in log, log[-3000:]
    _check_sockets(seen, hosts.address)
