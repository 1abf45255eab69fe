"""``policies.training.ensemble``: the mean of students' logits as one artifact."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from policies.artifact import ArtifactError, PolicyArtifact, load_artifact
from policies.ppo import PpoController
from policies.training.ensemble import main as ensemble_main
from policies.training.ensemble import merge, save_ensemble
from policies.training.recipe import RecipeConfig, build_student, export_student
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.scenarios import make_scenario


def _students(tmp_path: Path, seeds: tuple[int, ...], **overrides: object) -> list[Path]:
    paths = []
    for seed in seeds:
        cfg = replace(RecipeConfig(out=str(tmp_path), deployments=()), seed=seed,
                      **overrides)  # type: ignore[arg-type]
        codec = cfg.student_codec()
        from rlbatch.control.observation import observation_size

        size = observation_size(len(cfg.spec().buckets), cfg.obs_version)
        policy = build_student(cfg, codec, size)
        paths.append(export_student(policy, cfg, codec, tmp_path / f"s{seed}"))
    return paths


def _observations(artifact: PolicyArtifact, n: int = 200) -> np.ndarray:
    return np.random.default_rng(3).uniform(0.0, 4.0, (n, artifact.obs_size)).astype(np.float32)


@pytest.mark.parametrize("seeds", [(0,), (0, 1), (0, 1, 2)])
def test_merged_logits_are_the_members_mean(tmp_path: Path, seeds: tuple[int, ...]) -> None:
    members = [load_artifact(p) for p in _students(tmp_path, seeds)]
    merged = merge(members)
    obs = _observations(members[0])
    expected = np.mean([m.logits(obs) for m in members], axis=0)
    np.testing.assert_allclose(merged.logits(obs), expected, rtol=0, atol=2e-5)
    assert merged.nvec == members[0].nvec
    if len(seeds) > 1:  # members differ, so the mean is not any one of them
        assert not np.allclose(members[0].logits(obs), members[1].logits(obs), atol=1e-3)


def test_saved_ensemble_loads_records_its_members_and_serves(tmp_path: Path) -> None:
    paths = _students(tmp_path, (0, 1))
    out = save_ensemble(paths, tmp_path / "ensemble", {"phase": "ensemble"})
    loaded = load_artifact(out)
    assert [m["path"] for m in loaded.metadata["ensemble_members"]] == [str(p) for p in paths]
    assert [m["weights_sha256"] for m in loaded.metadata["ensemble_members"]] == [
        load_artifact(p).metadata["weights_sha256"] for p in paths]
    assert loaded.metadata["phase"] == "ensemble"
    assert loaded.metadata["weights_sha256"] != load_artifact(paths[0]).metadata[
        "weights_sha256"]
    obs = _observations(loaded)
    np.testing.assert_array_equal(loaded.act(obs), merge(
        [load_artifact(p) for p in paths]).act(obs))
    controller = PpoController(loaded, name="ensemble")
    workload = make_scenario("day", seed=0, duration_s=30.0)
    row = run(workload, controller, DeploymentSpec(), drain_s=30.0).row
    assert row["completed"] + row["rejected"] + row["unfinished"] == len(workload)


def test_members_that_disagree_are_refused(tmp_path: Path) -> None:
    full = _students(tmp_path / "a", (0,))
    total_only = _students(tmp_path / "b", (1,), shares=(1.0,))
    with pytest.raises(ArtifactError, match="member 1 differs from member 0 in 'nvec'"):
        merge([load_artifact(full[0]), load_artifact(total_only[0])])
    with pytest.raises(ArtifactError, match="at least one member"):
        merge([])


def test_the_command_merges_members_and_refuses_what_it_cannot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _students(tmp_path, (0, 1))
    out = tmp_path / "merged"
    assert ensemble_main([str(p) for p in paths] + ["--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "policy.json")
    obs = _observations(load_artifact(out))
    np.testing.assert_array_equal(load_artifact(out).act(obs), merge(
        [load_artifact(p) for p in paths]).act(obs))
    with pytest.raises(SystemExit):  # an artifact is there already
        ensemble_main([str(p) for p in paths] + ["--out", str(out)])
    assert "already holds an artifact" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ensemble_main([str(paths[0]), "--out", str(tmp_path / "one")])
    assert "at least two members" in capsys.readouterr().err
    assert ensemble_main([str(paths[0]), str(tmp_path / "missing"), "--out",
                          str(tmp_path / "bad")]) == 2
    assert "policy artifact not found" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
