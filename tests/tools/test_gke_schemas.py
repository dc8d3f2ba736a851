"""``jaxrl-gke``'s manifests against the schemas the API server holds them to: the JobSet CRD's
(kubernetes-sigs/jobset v0.12.0) and Kubernetes' own (v1.36.0), vendored in tests/tools/schemas
(its README names the sources and what is checked and what is not).

The API server prunes a field a structural schema does not name, and ``kubectl apply`` (strict
field validation, its default) refuses it; the CRD's schema is made strict here the same way so
that a misspelt field fails as it would there. The JobSet's embedded Job and pod templates are
checked twice: by the CRD, which embeds their full schema (no x-kubernetes-preserve-unknown-
fields anywhere), and by Kubernetes' own JobTemplateSpec.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from support.checkout import ROOT

from jaxrl_orch.tools import gke

SCHEMAS = Path(__file__).with_name("schemas")
CRD = SCHEMAS / "jobset.x-k8s.io_jobsets.yaml"
CRD_BLOB = "96add10d030c2ab2c94b1c774edd23c814692808"  # git's blob id at jobset v0.12.0
K8S = SCHEMAS / "k8s-v1.36.0-strict.json"
V5E_16 = [f"configs/{f}.gin" for f in ("model/qwen2.5_0.5b", "slice/v5e_16", "env/reverse_text")]
V5E_16 += ["configs/tune/full.gin", "configs/algo/grpo.gin"]
COMPOSITIONS = {
    "v5e-8 LoRA": ["configs/tpu_v5e_8_lora.gin"],
    "v6e-8": ["configs/tpu_v6e_8.gin"],
    "v5e-16 multi-host": V5E_16,
}


def _strict(node: Any) -> Any:
    """``node`` with every object that names its properties closed to others, as pruning and
    strict field validation treat it; one marked x-kubernetes-preserve-unknown-fields stays
    open."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    closed = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not closed:
        out["additionalProperties"] = False
    return out


def _formats() -> jsonschema.FormatChecker:
    """The integer widths the API server decodes into (a replica count is an int32)."""
    checker = jsonschema.FormatChecker()
    for name, bits in (("int32", 32), ("int64", 64)):
        bound = 2 ** (bits - 1)
        checker.checks(name)(lambda v, b=bound: not isinstance(v, int) or -b <= v < b)
    return checker


@functools.cache
def _crd() -> tuple[str, dict[str, Any], jsonschema.protocols.Validator]:
    """The CRD's kind, apiVersions (to served schema) and a validator of the served version."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group = crd["spec"]["group"]
    served = {f"{group}/{v['name']}": v for v in crd["spec"]["versions"] if v["served"]}
    (version,) = served.values()  # v0.12.0 serves one: v1alpha2
    schema = _strict(version["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft202012Validator(schema, format_checker=_formats())
    return crd["spec"]["names"]["kind"], served, validator


@functools.cache
def _k8s(definition: str) -> jsonschema.protocols.Validator:
    doc = json.loads(K8S.read_text())
    schema = {**doc, "$ref": f"#/$defs/{definition}"}
    return jsonschema.Draft202012Validator(schema, format_checker=_formats())


def _errors(source: str, validator: jsonschema.protocols.Validator, doc: Any, *at: object):
    return [
        f"{source} {'.'.join(str(p) for p in (*at, *e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def violations(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse in one manifest, each with the schema that says so and
    the field's path; empty when it validates."""
    if doc.get("apiVersion") == "v1" and doc.get("kind") == "Secret":
        return _errors("Kubernetes Secret", _k8s("io.k8s.api.core.v1.Secret"), doc)
    kind, served, crd = _crd()
    if doc.get("kind") != kind or doc.get("apiVersion") not in served:
        what = f"{doc.get('apiVersion')}/{doc.get('kind')}"
        return [f"{what} is neither v1/Secret nor {kind} of {sorted(served)}"]
    found = _errors("JobSet CRD", crd, doc)
    meta = _k8s("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    found += _errors("Kubernetes ObjectMeta", meta, doc.get("metadata", {}), "metadata")
    job_template = _k8s("io.k8s.api.batch.v1.JobTemplateSpec")
    for i, job in enumerate(doc.get("spec", {}).get("replicatedJobs", [])):
        if "template" in job:  # else the CRD names it missing
            at = ("spec", "replicatedJobs", i, "template")
            found += _errors("Kubernetes JobTemplateSpec", job_template, job["template"], *at)
    return found


def _written(tmp_path: Path, files: list[str], extra: list[str] = ()) -> list[dict[str, Any]]:
    """The Secret and the JobSet as ``jaxrl-gke`` writes them for ``kubectl apply``."""
    argv = ["--name", "rl-8", "--image", "img:1", "--workdir", "gs://b/runs/rl-8"]
    argv += ["--out", str(tmp_path), *extra, *(f"--gin_file={f}" for f in files)]
    assert gke.main(argv) == 0
    return [yaml.safe_load((tmp_path / f).read_text()) for f in ("secret.yaml", "jobset.yaml")]


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_the_vendored_crd_is_jobsets_own_file_at_the_pinned_release():
    data = CRD.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == CRD_BLOB
    assert "x-kubernetes-preserve-unknown-fields" not in data.decode()  # nothing left unchecked


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_the_written_manifests_validate(tmp_path, composition):
    secret, jobset = _written(tmp_path, COMPOSITIONS[composition], ["--queue", "team-a"])
    assert violations(secret) == [] and violations(jobset) == []
    pods = jobset["spec"]["replicatedJobs"]
    assert len(pods) == (2 if composition == "v5e-16 multi-host" else 1)


def _pod(jobset: dict[str, Any]) -> dict[str, Any]:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _break_port(js):
    _pod(js)["containers"][0]["ports"][0]["containerPort"] = "8476"


def _misspell(js):
    _pod(js)["nodeSelecter"] = _pod(js).pop("nodeSelector")


def _chips(js):
    _pod(js)["containers"][0]["resources"]["limits"]["google.com/tpu"] = "four"


def _mode(js):
    _pod(js)["volumes"][0]["secret"]["defaultMode"] = 2**40


def _label(js):
    js["metadata"]["labels"] = {"team": 7}


def _restarts(js):
    js["spec"]["failurePolicies"] = js["spec"].pop("failurePolicy")


def _no_template(js):
    del js["spec"]["replicatedJobs"][0]["template"]


def _parallelism(js):
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = 1.5


JOB = "spec.replicatedJobs.0.template.spec."
POD = JOB + "template.spec."


@pytest.mark.parametrize(
    "damage, field, sources",
    [
        (_break_port, POD + "containers.0.ports.0.containerPort", {"CRD", "JobTemplateSpec"}),
        (_misspell, POD[:-1], {"CRD", "JobTemplateSpec"}),
        (_chips, POD + "containers.0.resources.limits.google.com/tpu", {"CRD"}),
        (_mode, POD + "volumes.0.secret.defaultMode", {"CRD", "JobTemplateSpec"}),
        (_no_template, "spec.replicatedJobs.0", {"CRD"}),
        (_label, "metadata.labels.team", {"ObjectMeta"}),
        (_restarts, "spec", {"CRD"}),
        (_parallelism, JOB + "parallelism", {"CRD", "JobTemplateSpec"}),
    ],
)
def test_a_broken_jobset_fails_naming_the_field(tmp_path, damage, field, sources):
    """Nested pod fields are checked: a wrong type, an unknown field, a quantity that is no
    quantity, an int32 overflow; so are the JobSet's own fields and metadata: each named with
    its path and the schema that refuses it."""
    _, jobset = _written(tmp_path, COMPOSITIONS["v5e-8 LoRA"])
    broken = copy.deepcopy(jobset)
    damage(broken)
    found = violations(broken)
    assert {e.split(" ")[1] for e in found if f" {field}:" in e} == sources, found
    assert violations(jobset) == []


def test_a_broken_secret_or_a_wrong_api_version_fails(tmp_path):
    secret, jobset = _written(tmp_path, COMPOSITIONS["v6e-8"])
    secret["stringData"]["key"] = 5
    assert [e.split(":")[0] for e in violations(secret)] == ["Kubernetes Secret stringData.key"]
    jobset["apiVersion"] = "jobset.x-k8s.io/v1"
    (error,) = violations(jobset)
    assert "jobset.x-k8s.io/v1/JobSet is neither" in error and "v1alpha2" in error
