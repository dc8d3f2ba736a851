"""The pods a JobSet manifest makes, each as Kubernetes would start it: for the test that runs
a generated manifest's pods (``tests/distributed/test_gke_pods_e2e.py``).

``pods(jobset, secrets)`` expands every replicated job (``replicas`` Jobs of ``completions``
pods, Indexed) into its pods: the name and hostname JobSet gives each
(``<jobset>-<rjob>-<jobIndex>-<podIndex>``: the Job is ``<jobset>-<rjob>-<jobIndex>``, an
Indexed Job's pod hostname is ``<job>-<index>``), the subdomain of the headless service
(``spec.network.subdomain``, else the JobSet's name), the labels and annotations JobSet v0.12
and the Job controller put on the pod, the container's ``command`` + ``args``, its
environment (literal values, downward-API ``fieldRef``s resolved from that metadata, the
``JOB_COMPLETION_INDEX`` the Job controller adds to every container of an Indexed Job,
``HOSTNAME`` as the container runtime sets it) and its Secret volumes as files with their
mode. Anything the manifest uses that is not modelled here (another volume kind, a
``secretKeyRef``, a field path or label not listed: the JobSet's UID and job key, hashes a
cluster makes, are not) raises naming it: the test never runs a pod other than the manifest
declares. Not modelled: webhooks that edit pods at admission, service-link variables.
"""

from __future__ import annotations

import base64
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

JOBSET = "jobset.sigs.k8s.io/"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


@dataclasses.dataclass(frozen=True)
class Mount:
    """A volume as the container sees it: ``files`` (name -> (bytes, mode)) at ``path``."""

    path: str
    files: dict[str, tuple[bytes, int]]
    read_only: bool


@dataclasses.dataclass(frozen=True)
class Pod:
    name: str
    hostname: str
    subdomain: str
    job: str  # the replicated job
    job_index: int
    completion_index: int
    argv: list[str]  # command + args
    env: dict[str, str]  # what the manifest and Kubernetes set (the image's env comes first)
    mounts: list[Mount]
    ports: list[int]

    @property
    def fqdn(self) -> str:
        """The name the headless service resolves to this pod."""
        return f"{self.hostname}.{self.subdomain}"


def pods(jobset: Mapping[str, Any], secrets: Mapping[str, Mapping[str, Any]]) -> list[Pod]:
    """Every pod of ``jobset``, in the JobSet's order; ``secrets``: name -> Secret manifest."""
    name = jobset["metadata"]["name"]
    spec = jobset["spec"]
    subdomain = spec.get("network", {}).get("subdomain") or name
    found, global_index = [], 0
    jobs = sum(rjob.get("replicas", 1) for rjob in spec["replicatedJobs"])
    for rjob in spec["replicatedJobs"]:
        job = rjob["template"]["spec"]
        completions = job.get("completions", 1)
        if job.get("completionMode") != "Indexed" or job.get("parallelism", 1) != completions:
            raise ValueError(f"{rjob['name']}: not an Indexed Job running all pods at once")
        for i in range(rjob.get("replicas", 1)):
            for k in range(completions):
                meta = {
                    "jobset-name": name,
                    "replicatedjob-name": rjob["name"],
                    "replicatedjob-replicas": str(rjob.get("replicas", 1)),
                    "global-replicas": str(jobs),
                    "job-index": str(i),
                    "job-global-index": str(global_index),
                    "restart-attempt": "0",
                }
                # JobSet puts these on as labels and annotations; the Job controller adds its
                # Job's name and, Indexed, the pod's index
                annotations = {JOBSET + key: v for key, v in meta.items()}
                annotations[COMPLETION_INDEX] = str(k)
                labels = {
                    **annotations,
                    "batch.kubernetes.io/job-name": f"{name}-{rjob['name']}-{i}",
                }
                hostname = f"{name}-{rjob['name']}-{i}-{k}"
                metadata = {"name": hostname, "labels": labels, "annotations": annotations}
                found.append(_pod(rjob, i, k, metadata, subdomain, secrets))
            global_index += 1
    return found


def _pod(
    rjob: Mapping[str, Any],
    i: int,
    k: int,
    metadata: Mapping[str, Any],
    subdomain: str,
    secrets: Mapping[str, Mapping[str, Any]],
) -> Pod:
    spec = rjob["template"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {"HOSTNAME": metadata["name"]}  # the runtime's, from the pod's hostname
    declared = list(container.get("env", []))
    if not any(v["name"] == "JOB_COMPLETION_INDEX" for v in declared):  # as the Job controller
        declared.append(
            _field("JOB_COMPLETION_INDEX", f"metadata.annotations['{COMPLETION_INDEX}']")
        )
    for var in declared:
        env[var["name"]] = _value(var, metadata)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = [_mount(m, volumes[m["name"]], secrets) for m in container.get("volumeMounts", [])]
    return Pod(
        name=metadata["name"],
        hostname=metadata["name"],
        subdomain=subdomain,
        job=rjob["name"],
        job_index=i,
        completion_index=k,
        argv=[*container.get("command", []), *container.get("args", [])],
        env=env,
        mounts=mounts,
        ports=[p["containerPort"] for p in container.get("ports", [])],
    )


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _value(var: Mapping[str, Any], metadata: Mapping[str, Any]) -> str:
    """A variable's value as the kubelet resolves it (``$(VAR)`` expansion is not modelled)."""
    if "value" in var:
        if "$(" in var["value"]:
            raise ValueError(f"env {var['name']}: $(VAR) expansion is not modelled here")
        return var["value"]
    source = var.get("valueFrom", {})
    if set(source) != {"fieldRef"}:
        raise ValueError(f"env {var['name']}: {sorted(source)} is not modelled here")
    path = source["fieldRef"]["fieldPath"]
    if path == "metadata.name":
        return metadata["name"]
    m = _SUBSCRIPT.match(path)
    if m is None:
        raise ValueError(f"env {var['name']}: fieldPath {path!r} is not modelled here")
    kind, key = m.groups()
    if key not in metadata[kind]:  # the kubelet would give "", but it may be one not modelled
        raise ValueError(f"env {var['name']}: {kind} {key!r} is not on the pod as modelled here")
    return metadata[kind][key]


def _mount(
    mount: Mapping[str, Any], volume: Mapping[str, Any], secrets: Mapping[str, Mapping[str, Any]]
) -> Mount:
    if set(volume) != {"name", "secret"}:
        raise ValueError(f"volume {volume['name']}: only Secret volumes are modelled here")
    source = volume["secret"]
    if "items" in source or "subPath" in mount:
        raise ValueError(f"volume {volume['name']}: items/subPath are not modelled here")
    secret = secrets[source["secretName"]]
    data = {k: v.encode() for k, v in secret.get("stringData", {}).items()}
    data |= {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
    mode = source.get("defaultMode", 0o644)
    files = {key: (value, mode) for key, value in data.items()}
    return Mount(mount["mountPath"], files, bool(mount.get("readOnly", False)))
