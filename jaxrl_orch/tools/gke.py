"""``jaxrl-gke``: a run's Kubernetes manifests for GKE, a JobSet and the Secret of its key.

    python -m jaxrl_orch.tools.gke --name rl-8b --image IMAGE \\
        --workdir gs://BUCKET/runs/rl-8b --gin_file=... [--gin_param=...] [--queue Q] \\
        [--max_restarts 10] [--out DIR]

What it owns: turning a run's config into what GKE runs, ``manifests(cfg, ...)`` (pure: dicts)
and the command that writes them (``jobset.yaml``, ``secret.yaml``, mode 600) for
``kubectl apply -f DIR``. Nothing here talks to a cluster.

The layout is the config's: one replicated job per role, named as ``distributed.platform``
reads them back. ``trainer`` is one Indexed Job of P pods, one per host of the trainer slice
(``Processes.tpu_topology``); ``engine`` is R Jobs of one pod, each a slice of its own
(``Processes.replica_topology``). Every pod runs the same command; the platform gives each its
index, the coordinator, the replicas' and the weight source's addresses from the JobSet's
labels (downward API) and the pods' DNS names (``spec.network``: the headless service, named
after the run). The TPU node selectors, the chips per pod and the pod count follow from the
topology and are checked against the config's ``Processes.trainer_processes``; a mismatch is
refused naming both.

Safe by default: the replicas and the weight server bind their pod's address, so the run's key
is required: a fresh random one goes in a Secret mounted read-only (mode 0400) where
``--api_key_file`` reads it, never in the JobSet or on a command line. The workdir must be
``gs://`` (every pod reads and writes it). A preemption is a SIGTERM with the pod's grace
period: ``terminationGracePeriodSeconds`` is the run's drain bound plus the time to write its
checkpoint (``config.orchestrator.SAVE_AFTER_DRAIN_S``); after a failure the whole JobSet
restarts (``failurePolicy``), up to ``--max_restarts`` times, and the run resumes from its
workdir. The JobSet succeeds when the trainer job does (``successPolicy``): the replicas' jobs,
which serve until stopped, are then deleted. ``--queue`` adds Kueue's queue label.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

from jaxrl_orch.config.load import load_config
from jaxrl_orch.config.orchestrator import SAVE_AFTER_DRAIN_S
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.platform import (
    COORDINATOR_PORT,
    ENGINE_JOB,
    ENGINE_PORT,
    TRAINER_JOB,
    WEIGHT_PORT,
)
from jaxrl_orch.paths import is_url

# chip -> (GKE's accelerator label, chips per host of a multi-host slice); a slice of at most
# 8 chips (v5e, v6e) is one host holding all of them.
ACCELERATORS = {
    "v5e": ("tpu-v5-lite-podslice", 4),
    "v6e": ("tpu-v6e-slice", 4),
    "v5p": ("tpu-v5p-slice", 4),
}
_TOPOLOGY = re.compile(r"^(v5e|v6e|v5p):(\d+(?:x\d+){1,2})$")
_KEY_DIR = "/var/run/jaxrl"
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice as GKE names it: its node selectors, hosts and chips per host."""

    accelerator: str
    topology: str
    hosts: int
    chips_per_host: int


def tpu_slice(topology: str, setting: str) -> Slice:
    """``"v5e:4x4"`` as a GKE slice; ``setting`` names where the value came from."""
    m = _TOPOLOGY.match(topology or "")
    if m is None:
        raise ValueError(
            f"{setting} = {topology!r} is not a TPU topology GKE schedules; allowed: "
            f"'<chip>:<X>x<Y>' (or x<Z> for v5p), chip one of {sorted(ACCELERATORS)}"
        )
    chip, shape = m.groups()
    accelerator, per_host = ACCELERATORS[chip]
    chips = math.prod(int(n) for n in shape.split("x"))
    if chip != "v5p" and chips <= 8:
        per_host = chips
    return Slice(accelerator, shape, max(1, chips // per_host), min(chips, per_host))


def manifests(
    cfg: TrainConfig,
    train_args: list[str],
    *,
    name: str,
    image: str,
    workdir: str,
    key: str,
    queue: str | None = None,
    max_restarts: int = 10,
) -> list[dict[str, Any]]:
    """The Secret and the JobSet of a run (see the module docstring). ``train_args``: the
    config's own flags (``--gin_file``/``--gin_param``), given to every pod as they are."""
    _check(cfg, name, workdir)
    p = cfg.processes
    trainer = tpu_slice(p.tpu_topology, "Processes.tpu_topology")
    if trainer.hosts != p.trainer_processes:
        raise ValueError(
            f"Processes.tpu_topology = {p.tpu_topology!r} has {trainer.hosts} host(s), one "
            f"trainer process each, but Processes.trainer_processes = {p.trainer_processes}: "
            "set them to agree"
        )
    command = ["python", "-m", "jaxrl_orch.train", *train_args, f"--workdir={workdir}"]
    command.append(f"--api_key_file={_KEY_DIR}/key")
    grace = math.ceil(cfg.orchestrator.drain_timeout_s + SAVE_AFTER_DRAIN_S)
    pod = _Pod(name, image, command, grace)
    jobs = [_replicated(TRAINER_JOB, 1, trainer, pod)]
    if p.engine_replicas:
        engine = tpu_slice(p.replica_topology or p.tpu_topology, "Processes.replica_topology")
        if engine.hosts != 1:
            raise ValueError(
                f"Processes.replica_topology = {p.replica_topology!r} spans {engine.hosts} "
                "hosts; an engine replica is one process on one host"
            )
        jobs.append(_replicated(ENGINE_JOB, p.engine_replicas, engine, pod))
    labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "labels": labels,
            # one replicated job's pods per node pool: a slice is never shared
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": _POOL},
        },
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "failurePolicy": {"maxRestarts": max_restarts},
            # Done when the trainer group is: replicas serve until stopped, so JobSet's default
            # (every job completes) would hold their slices forever. On completion JobSet
            # deletes the jobs still running: the replicas get SIGTERM and drain.
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [TRAINER_JOB]},
            "replicatedJobs": jobs,
        },
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-key"},
        "type": "Opaque",
        "stringData": {"key": key},
    }
    return [secret, jobset]


_POOL = "cloud.google.com/gke-nodepool"


def _check(cfg: TrainConfig, name: str, workdir: str) -> None:
    if not _NAME.match(name):
        raise ValueError(
            f"--name {name!r} is not a JobSet name: lowercase letters, digits and '-', starting "
            "with a letter, at most 40 characters (pod DNS names are built from it)"
        )
    if not (is_url(workdir) and workdir.startswith("gs://")):
        raise ValueError(f"--workdir {workdir!r} must be gs://BUCKET/PATH: every pod writes it")
    if cfg.processes.tpu_topology is None:
        raise ValueError("Processes.tpu_topology is not set: the slice file names it")


@dataclasses.dataclass(frozen=True)
class _Pod:
    """What every pod of the run shares: the run's name, the image, the command, the grace."""

    name: str
    image: str
    command: list[str]
    grace: int


def _replicated(job: str, replicas: int, tpu: Slice, pod: _Pod) -> dict[str, Any]:
    """One replicated job: ``replicas`` Jobs of ``tpu.hosts`` pods, one per host."""
    ports = [COORDINATOR_PORT, WEIGHT_PORT] if job == TRAINER_JOB else [ENGINE_PORT]
    label = "metadata.labels['jobset.sigs.k8s.io/{}']"
    env = [
        {"name": var, "valueFrom": {"fieldRef": {"fieldPath": label.format(field)}}}
        for var, field in (
            ("JOBSET_NAME", "jobset-name"),
            ("REPLICATED_JOB_NAME", "replicatedjob-name"),
            ("JOB_INDEX", "job-index"),
        )
    ]
    container = {
        "name": "jaxrl",
        "image": pod.image,
        "command": list(pod.command),  # its own list: YAML would alias a shared one
        "env": env,  # JOB_COMPLETION_INDEX comes with an Indexed Job
        "ports": [{"containerPort": port} for port in ports],
        "resources": {"limits": {"google.com/tpu": tpu.chips_per_host}},
        "volumeMounts": [{"name": "key", "mountPath": _KEY_DIR, "readOnly": True}],
    }
    spec = {  # the key file's mode 0400 is 256: JSON and YAML have no octal
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": pod.grace,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": tpu.accelerator,
            "cloud.google.com/gke-tpu-topology": tpu.topology,
        },
        "containers": [container],
        "volumes": [
            {"name": "key", "secret": {"secretName": f"{pod.name}-key", "defaultMode": 0o400}}
        ],
    }
    return {
        "name": job,
        "replicas": replicas,
        "template": {
            "spec": {
                "parallelism": tpu.hosts,
                "completions": tpu.hosts,
                "completionMode": "Indexed",
                "backoffLimit": 0,  # a failed pod fails its Job, and the JobSet restarts
                "template": {"spec": spec},
            }
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxrl-gke", description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True, help="the JobSet's name (and its pods' subdomain)")
    p.add_argument("--image", required=True, help="the container image holding this package")
    p.add_argument("--workdir", required=True, help="gs://BUCKET/PATH, shared by every pod")
    p.add_argument("--gin_file", action="append", default=[], help="the run's config (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="a binding (repeatable)")
    p.add_argument("--queue", default=None, help="a Kueue LocalQueue to submit to")
    p.add_argument("--max_restarts", type=int, default=10, help="JobSet restarts after failures")
    p.add_argument("--out", default=".", help="where jobset.yaml and secret.yaml are written")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.max_restarts < 0:
            raise ValueError(f"--max_restarts must be >= 0, got {args.max_restarts}")
        cfg = load_config(args.gin_file, args.gin_param)
        train_args = [f"--gin_file={f}" for f in args.gin_file]
        train_args += [f"--gin_param={b}" for b in args.gin_param]
        secret, jobset = manifests(
            cfg,
            train_args,
            name=args.name,
            image=args.image,
            workdir=args.workdir,
            key=secrets.token_hex(32),
            queue=args.queue,
            max_restarts=args.max_restarts,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobset.yaml").write_text(yaml.safe_dump(jobset, sort_keys=False))
    secret_file = out / "secret.yaml"
    secret_file.unlink(missing_ok=True)  # a file of another mode would keep that mode
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:  # the key: readable by its owner only
        f.write(yaml.safe_dump(secret, sort_keys=False))
    print(f"wrote {out / 'jobset.yaml'} and {out / 'secret.yaml'}; submit: kubectl apply -f {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
