"""Regenerate the vendored schemas in this folder (see SOURCE.md for where the inputs come from).

    python tests/deploy/schemas/vendor.py --k8s DIR --kuberay DIR

--k8s: a `kubernetes-json-schema/v<version>-local-strict` folder of the kubernetes-validate wheel.
--kuberay: a folder holding KubeRay's ray.io_rayclusters.yaml and ray.io_rayjobs.yaml.

The tests run offline, so the schemas live in the repository; these two files are kept
small by taking only the kinds the manifests use (and what they reference) and by
dropping the prose descriptions, which no validation reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# Kinds deploy/ renders, and a few it may soon (a test fails on a kind missing here).
KINDS = {
    "v1/ConfigMap": "configmap-v1.json",
    "v1/Secret": "secret-v1.json",
    "v1/Service": "service-v1.json",
    "v1/ServiceAccount": "serviceaccount-v1.json",
    "v1/PersistentVolumeClaim": "persistentvolumeclaim-v1.json",
    "v1/Namespace": "namespace-v1.json",
    "apps/v1/Deployment": "deployment-apps-v1.json",
    "apps/v1/StatefulSet": "statefulset-apps-v1.json",
    "batch/v1/Job": "job-batch-v1.json",
    "policy/v1/PodDisruptionBudget": "poddisruptionbudget-policy-v1.json",
    "networking.k8s.io/v1/NetworkPolicy": "networkpolicy-networking-v1.json",
    "networking.k8s.io/v1/Ingress": "ingress-networking-v1.json",
}
DEFS_PREFIX = "/api/_definitions.json#/$defs/"
CRDS = {"ray.io/v1/RayCluster": "ray.io_rayclusters.yaml", "ray.io/v1/RayJob": "ray.io_rayjobs.yaml"}


def drop_descriptions(node):
    """Without prose: a `description` whose value is text is the keyword; a property
    named description has a schema (a dict) for its value and stays."""
    if isinstance(node, dict):
        return {k: drop_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [drop_descriptions(v) for v in node]
    return node


def local_refs(node, found: set[str]):
    """References into _definitions.json become references into this document's $defs;
    the names referenced are added to `found`."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            # The kinds' files point into _definitions.json; its own entries point within it.
            prefix = next((p for p in (DEFS_PREFIX, "#/$defs/") if isinstance(v, str) and v.startswith(p)), None)
            if k == "$ref" and prefix:
                name = v[len(prefix):]
                found.add(name)
                out[k] = "#/$defs/" + name
            else:
                out[k] = local_refs(v, found)
        return out
    if isinstance(node, list):
        return [local_refs(v, found) for v in node]
    return node


def kubernetes(folder: Path) -> dict:
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    kinds, todo, defs = {}, set(), {}
    for key, filename in KINDS.items():
        schema = json.loads((folder / filename).read_text())
        for k in ("$schema", "$id"):
            schema.pop(k, None)
        kinds[key] = drop_descriptions(local_refs(schema, todo))
    todo.add("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")  # custom resources' metadata
    while todo:  # the closure of what the kinds reference
        name = todo.pop()
        if name not in defs:
            defs[name] = None
            refs: set[str] = set()
            defs[name] = drop_descriptions(local_refs(definitions[name], refs))
            todo |= refs - defs.keys()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "kinds": kinds, "$defs": dict(sorted(defs.items()))}


def kuberay(folder: Path) -> dict:
    out = {}
    for key, filename in CRDS.items():
        crd = yaml.safe_load((folder / filename).read_text())
        version = key.split("/")[1]
        (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        out[key] = drop_descriptions(entry["schema"]["openAPIV3Schema"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k8s", type=Path, required=True)
    parser.add_argument("--kuberay", type=Path, required=True)
    parser.add_argument("--k8s-version", default="v1.32.0")
    parser.add_argument("--kuberay-version", default="v1.7.0")
    args = parser.parse_args()
    # One line each: generated files, read by programs; diffs are in SOURCE.md's terms.
    for name, doc in ((f"kubernetes-{args.k8s_version}-strict.json", kubernetes(args.k8s)),
                      (f"kuberay-{args.kuberay_version}.json", kuberay(args.kuberay))):
        (HERE / name).write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
