"""End-to-end: the pods of a manifest ``jaxrl-gke`` wrote, each run as Kubernetes would start
it, on hosts of their own (``support.netns``), the workdir on ``gs://``.

``python -m jaxrl_orch.tools.gke`` writes ``jobset.yaml`` and ``secret.yaml`` for a run of two
trainer pods (a ``v5p:2x2x2`` slice: 2 hosts) and two engine replicas (``v5e:2x2`` each).
``support.jobset_pods`` expands the JobSet into its four pods: each pod's command and args,
its environment as the kubelet resolves it (the manifest's ``fieldRef``s from the labels
JobSet and the Job controller put on the pod, ``JOB_COMPLETION_INDEX``, ``HOSTNAME``) and the
Secret as a file of its mode. Each pod runs in a network namespace whose hostname is the pod's,
with the pods' DNS names (``<hostname>.<subdomain>``) resolving as the headless service
resolves them; in its own mount namespace the Secret's files are bind-mounted read-only at the
manifest's ``mountPath`` itself (the directory is made on this machine if missing, then
removed). The GCS emulator serves the bucket from a host of its own that every pod reaches.

What stands in for the cluster is the image's environment alone, as a CPU dry run of the
image would set it: 2 CPU devices a process (``JAX_PLATFORMS``, ``XLA_FLAGS``), ``tests/`` on
the import path (the run's env is ``support.dense_env``), the storage clients pointed at the
emulator (GKE's workload identity instead). The TPU node selectors and chip limits are the
scheduler's, not run here. The run completes: the trainer pods exit 0, the engine pods get
SIGTERM when the trainer job completes (the JobSet's ``successPolicy``) and exit 0, every RL
step's row is in the ``gs://`` workdir's metrics once, each pod's platform line names the
JobSet variables it read, and every port the manifest declares is listened on by its job's pods.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import netns
from support.checkout import ROOT, subprocess_env
from support.gcs_emulator import BUCKET, client_env
from support.jobset_pods import Pod, pods
from support.multiprocess import SCENARIO, env

from jaxrl_orch.distributed.platform import COORDINATOR_PORT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
]

NAME = "rl-pods"
URL = f"gs://{BUCKET}/runs/{NAME}"
STORAGE, STORAGE_PORT = "storage", 4443  # the emulator's host, a namespace of its own
LAYOUT = [
    "Processes.trainer_processes = 2",
    "Processes.engine_replicas = 2",
    "Processes.tpu_topology = 'v5p:2x2x2'",  # 8 chips on 2 hosts: one trainer pod each
    "Processes.replica_topology = 'v5e:2x2'",
]
STEPS = 2


def _generate(out: Path) -> tuple[dict, dict]:
    """The run's manifests, written by ``jaxrl-gke`` itself."""
    params = [*SCENARIO, f"RL.steps = {STEPS}", "Orchestrator.max_staleness = 0", *LAYOUT]
    cmd = [sys.executable, "-m", "jaxrl_orch.tools.gke", "--name", NAME, "--image", "jaxrl:dry"]
    cmd += ["--workdir", URL, "--out", str(out), *[f"--gin_param={p}" for p in params]]
    done = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    jobset = yaml.safe_load((out / "jobset.yaml").read_text())
    secret = yaml.safe_load((out / "secret.yaml").read_text())
    return jobset, secret


def _image_env() -> dict[str, str]:
    """The container's own environment (its image's): a CPU dry run of this checkout."""
    found = env(2)
    found["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), found.get("PATH", "")])
    return {**found, **client_env(f"http://{STORAGE}:{STORAGE_PORT}")}


def _volumes(pod: Pod, root: Path) -> list[str]:
    """The pod's volumes written under ``root`` with their modes: ``mount`` lines putting them
    at the manifest's paths, read-only where it says so."""
    lines = []
    for n, mount in enumerate(pod.mounts):
        src = root / pod.name / str(n)
        src.mkdir(parents=True)
        for name, (data, mode) in mount.files.items():
            fd = os.open(src / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ro = " -o ro" if mount.read_only else ""
        lines.append(f"mount --bind{ro} {shlex.quote(str(src))} {shlex.quote(mount.path)}")
    return lines


@contextlib.contextmanager
def _mount_points(paths: set[str]):
    """The volumes' mount points, made where missing and removed after (a bind mount needs
    one; what is mounted there stays in each pod's own mount namespace)."""
    made = []
    try:
        for path in sorted(paths):
            missing = [p for p in [Path(path), *Path(path).parents] if not p.exists()]
            Path(path).mkdir(parents=True, exist_ok=True)
            made += missing
        yield
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()


def _start(hosts: netns.Hosts, pod: Pod, volumes: Path, logs: Path) -> subprocess.Popen:
    """``pod``'s command in its namespace, its volumes mounted, its environment on the image's."""
    script = " && ".join([*_volumes(pod, volumes), 'exec "$@"'])
    with open(logs / f"{pod.name}.log", "w") as out:
        return hosts.popen(
            pod.name,
            ["sh", "-c", script, "pod", *pod.argv],
            env={**_image_env(), **pod.env},
            cwd=ROOT,  # the image's working directory: the repository root (docs/scale-out.md)
            stdout=out,
            stderr=out,
        )


def _run(hosts: netns.Hosts, run: list[Pod], tmp: Path) -> dict[str, netns.Table]:
    """Every pod at once until the trainer job completes (its pods exit), then SIGTERM to the
    pods still running, as the JobSet's ``successPolicy`` deletes their jobs. Returns each
    pod's socket table over the run."""
    (tmp / "logs").mkdir()
    procs = {pod.name: _start(hosts, pod, tmp / "volumes", tmp / "logs") for pod in run}
    seen: dict[str, netns.Table] = {pod.name: set() for pod in run}
    trainers = [procs[p.name] for p in run if p.job == "trainer"]
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in trainers) and time.monotonic() < deadline:
        for name, proc in procs.items():
            seen[name] |= hosts.sockets(name, proc)
        if any(p.poll() not in (None, 0) for p in procs.values()):
            break
        time.sleep(0.5)
    serving = [name for name, proc in procs.items() if proc.poll() is None]
    for name in serving:
        procs[name].send_signal(signal.SIGTERM)
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            codes[name] = "still running"
    assert codes == dict.fromkeys(procs, 0), (codes, _tails(tmp / "logs"))
    # the replicas serve until stopped: the JobSet's end is what stops them
    assert serving == [p.name for p in run if p.job == "engine"], serving
    return seen


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))


def _rows(hosts: netns.Hosts) -> list[dict]:
    """The workdir's metrics rows, read through the emulator from its own host."""
    read = (
        "import json; from jaxrl_orch.paths import as_path; from jaxrl_orch.run.history "
        f"import read_rows; print(json.dumps(read_rows(as_path({URL!r}) / 'metrics.jsonl')))"
    )
    env = {**subprocess_env(), **client_env(f"http://{STORAGE}:{STORAGE_PORT}")}
    proc = hosts.popen(STORAGE, [sys.executable, "-c", read], env=env, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out)


def _platform_line(pod: Pod) -> str:
    """How ``pod``'s platform line starts: what it read, its process index, the coordinator."""
    index = pod.completion_index if pod.job == "trainer" else 2 + pod.job_index
    read = (
        f"JOBSET_NAME={NAME}, REPLICATED_JOB_NAME={pod.job}, JOB_INDEX={pod.job_index}, "
        f"JOB_COMPLETION_INDEX={pod.completion_index}"
    )
    leader = f"{NAME}-trainer-0-0.{NAME}:{COORDINATOR_PORT}"
    return f"== platform: gke-jobset ({read}): process {index}, coordinator {leader}, "


def test_the_pods_of_a_generated_jobset_run_the_run_to_completion(tmp_path: Path) -> None:
    jobset, secret = _generate(tmp_path / "gke")
    run = pods(jobset, {secret["metadata"]["name"]: secret})
    assert [(p.job, p.job_index, p.completion_index) for p in run] == [
        ("trainer", 0, 0), ("trainer", 0, 1), ("engine", 0, 0), ("engine", 1, 0),
    ]  # fmt: skip
    names = {p.name: [p.fqdn] for p in run} | {STORAGE: [STORAGE]}
    hosts = netns.Hosts(names)
    try:
        emulator = hosts.popen(
            STORAGE,
            [
                sys.executable,
                "-m",
                "support.gcs_emulator",
                hosts.address[STORAGE],
                str(STORAGE_PORT),
            ],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert emulator.stdout.readline().strip() == "serving"
        with _mount_points({m.path for p in run for m in p.mounts}):
            seen = _run(hosts, run, tmp_path)
        rows = _rows(hosts)
    finally:
        hosts.close()
    steps = [r["step"] for r in rows if "train/reward_mean" in r]
    assert steps == list(range(1, STEPS + 1)), rows
    for pod in run:
        log = (tmp_path / "logs" / f"{pod.name}.log").read_text()
        line = next(x for x in log.splitlines() if "platform" in x)
        assert line.startswith(_platform_line(pod)), line
    for job in {p.job for p in run}:  # each port the manifest declares is one its pods serve
        mine = [p for p in run if p.job == job]
        listening = {r[1:3] for p in mine for r in seen[p.name] if r[0] == "LISTEN"}
        for port in mine[0].ports:
            assert any((hosts.address[p.name], port) in listening for p in mine), (job, port)
