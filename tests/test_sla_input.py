"""The SLA as an input of the policy: SLAs drawn per training workload, recorded in the
artifact, refused outside the trained range when served."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from policies.artifact import ArtifactError
from policies.ppo import check_trained_sla
from policies.training.episodes import draws_slas, sample_slas
from policies.training.recipe import RecipeConfig, build_student, export_student
from rlbatch.control.controllers import make_controller
from rlbatch.control.observation import observation_size
from rlbatch.control.types import SLA
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import resolve_workload


def test_slas_are_drawn_in_their_ranges_only_when_a_range_is_open() -> None:
    cfg = RecipeConfig(traces=(), deployments=(), sla_ttft_s=(0.5, 5.0), sla_tpot_s=(0.025, 0.15))
    assert draws_slas(cfg)
    slas = sample_slas(cfg, np.random.default_rng(0), 400)
    ttft = np.array([s.ttft_s for s in slas])
    tpot = np.array([s.tpot_s for s in slas])
    assert ttft.min() >= 0.5 and ttft.max() <= 5.0
    assert tpot.min() >= 0.025 and tpot.max() <= 0.15
    # log-uniform: the geometric middle splits the draws in half
    assert 0.4 < np.mean(ttft < np.sqrt(0.5 * 5.0)) < 0.6
    fixed = replace(cfg, sla_ttft_s=(1.0, 1.0), sla_tpot_s=(0.05, 0.05))
    rng = np.random.default_rng(0)
    assert not draws_slas(fixed)
    assert sample_slas(fixed, rng, 3) == [SLA(1.0, 0.05)] * 3
    assert rng.random() == np.random.default_rng(0).random()  # nothing drawn
    with pytest.raises(ValueError, match="sla_tpot_s"):
        RecipeConfig(traces=(), deployments=(), sla_tpot_s=(0.1, 0.05))


@pytest.mark.parametrize(("ttft", "tpot", "ok"), [
    (1.0, 0.05, True), (0.5, 0.025, True), (5.0, 0.15, True),
    (0.4, 0.1, False), (2.0, 0.2, False)])
def test_check_trained_sla(ttft: float, tpot: float, ok: bool) -> None:
    meta = {"sla_ttft_s": [0.5, 5.0], "sla_tpot_s": [0.025, 0.15]}
    if ok:
        check_trained_sla(meta, SLA(ttft, tpot))
    else:
        with pytest.raises(ArtifactError, match="outside the range this policy was trained"):
            check_trained_sla(meta, SLA(ttft, tpot))
    check_trained_sla({}, SLA(ttft, tpot))  # artifacts without the record serve any SLA


@pytest.mark.parametrize("version", [3, 5])
def test_a_student_that_reads_the_sla_serves_only_its_trained_range(
        tmp_path: Path, version: int) -> None:
    cfg = RecipeConfig(traces=(), deployments=(), obs_version=version, sla_ttft_s=(1.0, 3.0),
                       sla_tpot_s=(0.05, 0.1), out=str(tmp_path))
    codec = cfg.student_codec()
    policy = build_student(cfg, codec, observation_size(len(cfg.spec().buckets), version))
    path = export_student(policy, cfg, codec, tmp_path / "student")
    workload = resolve_workload("poisson:rate=1,duration=20", 0)
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"))
    row = run(workload, make_controller(f"ppo:{path}"), replace(spec, sla=SLA(2.0, 0.1))).row
    assert row["completed"] > 0
    outside = replace(spec, sla=SLA(0.5, 0.1))
    if version >= 5:
        with pytest.raises(ArtifactError, match=r"TTFT limit 0\.5 s is outside"):
            run(workload, make_controller(f"ppo:{path}"), outside)
    else:  # a version-3 student does not read the SLA and records no range
        assert run(workload, make_controller(f"ppo:{path}"), outside).row["completed"] > 0
