"""``--members K``: K students, each by the whole recipe, shipped as the mean of their logits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from policies.artifact import load_artifact
from policies.training.members import finished, member_config, train_students
from policies.training.recipe import RecipeConfig, run_recipe


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory, azure_trace: Path) -> Path:
    # the first ~10 minutes of the Azure trace: selection replays it in seconds
    path = tmp_path_factory.mktemp("trace") / "azure_head.csv"
    path.write_text("".join(azure_trace.read_text().splitlines(keepends=True)[:301]))
    return path


def _cfg(trace: Path, out: Path, **overrides: object) -> RecipeConfig:
    values: dict[str, object] = {"members": 2, **overrides}
    return RecipeConfig(traces=(str(trace),), episodes=1, episode_s=30.0, dagger_rounds=0,
                        epochs=2, finetune_steps=0, selection_rates=(0.8,), deployments=(),
                        shares=(1.0,), seed=1, out=str(out), **values)  # type: ignore[arg-type]


def test_member_seeds_and_folders(tmp_path: Path) -> None:
    cfg = RecipeConfig(members=3, seed=1, deployments=(), out=str(tmp_path))
    members = [member_config(cfg, k) for k in range(3)]
    assert [m.seed for m in members] == [3, 4, 5]
    assert [m.out for m in members] == [str(tmp_path / f"member-{k}") for k in range(3)]
    assert all(m.members == 1 for m in members)
    with pytest.raises(ValueError, match="member 3 of 3"):
        member_config(cfg, 3)
    with pytest.raises(ValueError, match="members >= 1"):
        RecipeConfig(members=0)
    with pytest.raises(ValueError, match="train_students"):
        run_recipe(cfg)


def test_members_train_merge_and_resume(small_trace: Path, tmp_path: Path) -> None:
    cfg = _cfg(small_trace, tmp_path)
    tags: list[str] = []
    said: list[str] = []
    summary = train_students(cfg, log=lambda tag, value, step: tags.append(tag),
                         progress=said.append)
    members = [member_config(cfg, k) for k in range(2)]
    bests = [load_artifact(Path(m.out) / "best") for m in members]
    assert [json.loads((Path(m.out) / "recipe.json").read_text())["config"]["seed"]
            for m in members] == [2, 3]
    merged = load_artifact(summary["best"])
    obs = np.random.default_rng(0).uniform(0, 3, (50, merged.obs_size)).astype(np.float32)
    np.testing.assert_allclose(merged.logits(obs), np.mean([b.logits(obs) for b in bests],
                                                           axis=0), atol=2e-5)
    assert not np.allclose(bests[0].logits(obs), bests[1].logits(obs), atol=1e-3)
    assert merged.metadata["phase"] == "ensemble"
    assert merged.metadata["training"]["members"] == 2
    assert merged.metadata["training"]["seed"] == 1
    assert [m["seed"] for m in summary["members"]] == [2, 3]
    assert [m["reused"] for m in summary["members"]] == [False, False]
    assert {t.split("/")[0] for t in tags} == {"member-0", "member-1"}
    assert any(t.startswith("member-1/select/") for t in tags)
    assert json.loads((tmp_path / "recipe.json").read_text())["best"] == summary["best"]

    # a second run reuses both members and writes the same policy
    weights = (tmp_path / "best" / "policy.safetensors").read_bytes()
    member_weights = [(Path(m.out) / "best" / "policy.safetensors").stat().st_mtime_ns
                      for m in members]
    said.clear()
    again = train_students(cfg, progress=said.append)
    assert [m["reused"] for m in again["members"]] == [True, True]
    assert sum("reusing the finished run" in s for s in said) == 2
    assert (tmp_path / "best" / "policy.safetensors").read_bytes() == weights
    assert [(Path(m.out) / "best" / "policy.safetensors").stat().st_mtime_ns
            for m in members] == member_weights


def test_a_member_of_other_options_is_not_reused(small_trace: Path, tmp_path: Path) -> None:
    cfg = _cfg(small_trace, tmp_path, members=1)
    run_recipe(cfg)
    assert finished(cfg) is not None
    assert finished(replace(cfg, out=str(tmp_path / "elsewhere"))) is None  # nothing there
    assert finished(replace(cfg, epochs=3)) is None
    assert finished(replace(cfg, seed=2)) is None
    recorded = json.loads((tmp_path / "recipe.json").read_text())["config"]
    assert RecipeConfig.from_record(recorded) == cfg
    with pytest.raises(ValueError, match="does not know: bogus"):
        RecipeConfig.from_record({**recorded, "bogus": 1})
    assert RecipeConfig.from_record({**recorded, "bogus": 1}, ignore_unknown=True) == cfg
    (tmp_path / "best" / "policy.json").unlink()
    assert finished(cfg) is None
