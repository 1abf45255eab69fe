"""Issue 11: the KubeRay example (deploy/kuberay/) is valid YAML and agrees with the project:
the Ray release scripts/setup.sh installs (inside the rl extra's range), one image for head
and workers, CPU slots that match the containers' CPUs, and a head that runs no simulations."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deploy" / "kuberay"


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    import yaml

    docs = list(yaml.safe_load_all((KUBERAY / "raycluster.yaml").read_text()))
    assert len(docs) == 1
    doc: dict[str, Any] = docs[0]
    return doc


def _ray_pin() -> str:
    """The Ray release scripts/setup.sh installs, inside the range the rl extra allows."""
    from packaging.requirements import Requirement

    pins = re.findall(r'"ray\[tune\]==([\d.]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert len(pins) == 1, pins
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ray = [r for d in project["optional-dependencies"]["rl"] if (r := Requirement(d)).name == "ray"]
    assert len(ray) == 1 and ray[0].specifier.contains(pins[0]), ray
    return str(pins[0])


def test_ray_version_is_one_everywhere(cluster: dict[str, Any]) -> None:
    pin = _ray_pin()
    assert metadata.version("ray") == pin  # what scripts/setup.sh installed
    assert cluster["spec"]["rayVersion"] == pin
    dockerfile = (KUBERAY / "Dockerfile.ray").read_text()
    assert f"FROM rayproject/ray:{pin}-py311-cpu" in dockerfile
    assert '-e ".[rl,dev]"' in (REPO / "scripts" / "setup.sh").read_text()


def test_raycluster_shape(cluster: dict[str, Any]) -> None:
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head schedules, workers simulate
    head_container = head["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports == {"gcs": 6379, "dashboard": 8265, "client": 10001}
    env = {e["name"]: e["value"] for e in head_container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in head_container["volumeMounts"]}
    assert env["RLBATCH_TRACES_DIR"] == mounts["traces"]
    groups = cluster["spec"]["workerGroupSpecs"]
    assert len(groups) == 1
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        container = group["template"]["spec"]["containers"][0]
        assert container["image"] == head_container["image"]
        cpus = group["rayStartParams"]["num-cpus"]
        assert container["resources"]["requests"]["cpu"] == cpus
        assert container["resources"]["limits"]["cpu"] == cpus
