"""PPO fine-tuning of a recipe student: the value head is fitted alone first, then the actor
moves; the fine-tuned network still serves as a policy artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policies.artifact import load_artifact
from policies.ppo import PpoController
from policies.training.finetune import (
    FinetuneConfig,
    finetune,
    finetune_many,
    recipe_env_kwargs,
)
from policies.training.recipe import RecipeConfig, build_student, export_student
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.observation import observation_size
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.scenarios import make_scenario

CODEC = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)


def _snapshot(policy: torch.nn.Module, part: str) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for name, p in policy.named_parameters()
            if part in name]


def _moved(before: list[np.ndarray], after: list[np.ndarray]) -> bool:
    return any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("warmup,actor_moves", [(4, False), (0, True)])
def test_value_warmup_leaves_the_actor_alone(tmp_path: Path, warmup: int,
                                             actor_moves: bool) -> None:
    cfg = RecipeConfig(out=str(tmp_path), net_arch=(8,))
    policy = build_student(cfg, CODEC, observation_size(4, cfg.obs_version))
    actor = _snapshot(policy, "policy_net") + _snapshot(policy, "action_net")
    critic = _snapshot(policy, "value")
    workload = make_scenario("day", seed=0, duration_s=40.0)
    kwargs = recipe_env_kwargs(cfg.gpu, cfg.model, cfg.pools, 40.0, cfg.obs_version,
                               cfg.decision_ticks)
    logged: list[str] = []
    finetune(policy, kwargs, lambda: workload,
             FinetuneConfig(steps=64, n_steps=16, batch_size=8, n_epochs=1,
                            learning_rate=1e-2, value_warmup_rollouts=warmup),
             seed=0, log=lambda tag, value, step: logged.append(tag))
    assert _moved(critic, _snapshot(policy, "value"))
    after = _snapshot(policy, "policy_net") + _snapshot(policy, "action_net")
    assert _moved(actor, after) is actor_moves
    assert "finetune/value_loss" in logged and "finetune/actor_frozen" in logged
    # still a servable student artifact
    path = export_student(policy, cfg, CODEC, tmp_path / "ft")
    row = run(workload, PpoController(load_artifact(path), name="finetuned"),
              DeploymentSpec()).row
    assert row["completed"] + row["rejected"] + row["unfinished"] == row["submitted"]


def test_zero_steps_is_a_no_op(tmp_path: Path) -> None:
    cfg = RecipeConfig(out=str(tmp_path), net_arch=(8,))
    policy = build_student(cfg, CODEC, observation_size(4, cfg.obs_version))
    before = _snapshot(policy, "")
    finetune(policy, {}, lambda: make_scenario("day", seed=0, duration_s=1.0),
             FinetuneConfig(steps=0), seed=0)
    assert not _moved(before, _snapshot(policy, ""))
    with pytest.raises(ValueError, match="steps >= 0"):
        FinetuneConfig(steps=-1)


def test_each_episode_comes_back_as_a_run_row(tmp_path: Path) -> None:
    """Fine-tuning's episodes are logged as the other phases' runs: the env's summary with
    the ticks of each total and bucket cap in force (decision_ticks per decision)."""
    cfg = RecipeConfig(out=str(tmp_path), net_arch=(8,))
    policy = build_student(cfg, CODEC, observation_size(4, cfg.obs_version))
    workload = make_scenario("day", seed=0, duration_s=40.0)
    kwargs = recipe_env_kwargs(cfg.gpu, cfg.model, cfg.pools, 40.0, cfg.obs_version,
                               cfg.decision_ticks)
    rows: list[tuple[dict[str, Any], int]] = []
    finetune_many(policy, [(kwargs, lambda: workload)],
                  FinetuneConfig(steps=64, n_steps=32, batch_size=8, n_epochs=1), seed=0,
                  on_episode=lambda row, decisions: rows.append((row, decisions)))
    assert rows
    decisions = [n for _, n in rows]
    assert decisions == sorted(decisions) and decisions[-1] <= 64
    for row, _ in rows:
        assert set(row["per_bucket"]) == set(row["bucket_cap_ticks"]) == {
            "0-1k", "1k-2k", "2k-4k", "4k+"}
        ticks = sum(row["max_num_seqs_ticks"].values())
        assert ticks % cfg.decision_ticks == 0 and ticks > 0
        assert all(sum(t.values()) == ticks for t in row["bucket_cap_ticks"].values())
        assert row["sla_ttft_s"] > 0 and row["guard_overrides"] >= 0
