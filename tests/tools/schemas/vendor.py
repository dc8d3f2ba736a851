"""Rewrites ``k8s-v1.36.0-strict.json`` here from the kubernetes-validate wheel (README.md).

    pip download --no-deps kubernetes-validate==1.37.0 -d /tmp/kv
    python tests/tools/schemas/vendor.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl

The wheel holds every definition of Kubernetes v1.36.0's API (1.6 MB); the tests need the
objects ``jaxrl-gke`` writes or embeds, so only those and what they reference are kept.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

WHEEL = "kubernetes_validate-1.37.0-py3-none-any.whl"
SHA256 = "85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9"
SOURCE = "kubernetes_validate/kubernetes-json-schema/v1.36.0-local-strict/_definitions.json"
ROOTS = (
    "io.k8s.api.core.v1.Secret",  # secret.yaml
    "io.k8s.api.batch.v1.JobTemplateSpec",  # each replicated job's template
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",  # the JobSet's own metadata
)
OUT = Path(__file__).with_name("k8s-v1.36.0-strict.json")


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rpartition("/")[2]} if "$ref" in node else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def closure(defs: dict[str, object], roots: tuple[str, ...]) -> dict[str, object]:
    """The definitions ``roots`` reach through ``$ref``, sorted by name."""
    kept: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept.add(name)
            todo += sorted(_refs(defs[name]) - kept)
    return {name: defs[name] for name in sorted(kept)}


def main(wheel: str) -> None:
    data = Path(wheel).read_bytes()
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise SystemExit(f"{wheel} is not the pinned {WHEEL} (sha256 {SHA256})")
    with zipfile.ZipFile(wheel) as z:
        doc = json.loads(z.read(SOURCE))
    out = {
        "$schema": doc["$schema"],
        "$comment": f"{WHEEL}:{SOURCE}, trimmed to {', '.join(ROOTS)} (tests/tools/schemas)",
        "$defs": closure(doc["$defs"], ROOTS),
    }
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {len(out['$defs'])} of {len(doc['$defs'])} definitions")


if __name__ == "__main__":
    main(*sys.argv[1:])
