"""``train.py --shares 1``: a student that chooses the total cap (and routes) only."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envs
from policies.artifact import load_artifact
from policies.ppo import PpoController
from policies.training.recipe import (
    Recipe,
    RecipeConfig,
    build_student,
    export_student,
    make_labeller,
)
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.types import ControlAction
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.scenarios import make_scenario

TOTAL_ONLY = TotalShareCodec(TOTAL_LADDER, (1.0,), ("fp16",), 4)


def test_a_trim_projects_to_its_total_and_every_action_leaves_buckets_unlimited() -> None:
    trimmed = ControlAction((None, None, 24, 12), ("fp16",) * 4, 96)
    encoded = TOTAL_ONLY.encode(trimmed)
    assert encoded.tolist() == [TOTAL_LADDER.index(96), 0, 0, 0, 0, 0, 0, 0, 0]
    for ti in range(len(TOTAL_LADDER)):
        action = TOTAL_ONLY.decode([ti, 0, 0, 0, 0, 0, 0, 0, 0])
        assert action.caps == (None,) * 4 and action.max_num_seqs == TOTAL_LADDER[ti]
    with pytest.raises(ValueError, match="share index 1 outside"):
        TOTAL_ONLY.decode([0, 1, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("shares, message", [((0.5,), "end at 1"), ((1.0, 0.5), "increase"),
                                             ((), "need totals, shares")])
def test_recipe_refuses_a_bad_share_ladder(shares: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecipeConfig(shares=shares)


@pytest.mark.parametrize("text, expected", [("1", (1.0,)), ("0.5,1", (0.5, 1.0)),
                                            ("0.125,0.25,0.5,1", SHARE_LADDER)])
def test_train_shares_option_reaches_the_recipe(text: str, expected: tuple[float, ...]) -> None:
    from policies.training import command as train

    parser = train.build_parser()
    args = parser.parse_args(["--shares", text, "--train-deployments", "none"])
    assert train._recipe_config(args, ("azure",)).shares == expected
    assert tuple(parser.parse_args([]).shares) == SHARE_LADDER
    with pytest.raises(ValueError, match="end at 1"):
        train._recipe_config(parser.parse_args(["--shares", "0.5"]), ("azure",))


def test_total_only_labels_keep_the_teachers_totals(tmp_path: Path) -> None:
    # the trimming teacher drives both runs, so the decisions are the same; the total-only
    # codec must keep every total and drop every trim
    # (at 3x load the teacher never trims behind the peak KV budget, guard revision 9; the
    # fair teacher keeps none of its trims on this workload, so the unfiltered one drives;
    # behind the tpot_fit rule its total binds before any trim would, so the rule is off)
    cfg = RecipeConfig(out=str(tmp_path), teacher="mpc[fair=false,order=fifo]", tpot_fit=False)
    workload = make_scenario("bursty", seed=1, duration_s=90.0, rate_scale=5.0)
    taken = {}
    for name, codec in (("full", TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)),
                        ("total", TOTAL_ONLY)):
        labeller = make_labeller(cfg, codec)
        run(workload, labeller, DeploymentSpec(), drain_s=10.0)
        taken[name] = labeller.take()
    full, total = taken["full"], taken["total"]
    assert len(full) == len(total) > 3
    assert np.any(full.actions[:, 1::2] < len(SHARE_LADDER) - 1)  # the teacher did trim
    assert len(set(full.actions[:, 0].tolist())) > 1  # and changed its total
    assert np.array_equal(full.obs, total.obs)
    assert np.array_equal(full.actions[:, 0], total.actions[:, 0])
    assert np.all(total.actions[:, 1::2] == 0)
    assert np.array_equal(full.actions[:, 2::2], total.actions[:, 2::2])


def test_total_only_student_trains_serves_and_fine_tunes_in_its_space(tmp_path: Path) -> None:
    cfg = RecipeConfig(out=str(tmp_path), shares=(1.0,), deployments=())
    recipe = Recipe(cfg)
    assert recipe.codec.nvec == [12, 1, 1, 1, 1, 1, 1, 1, 1]
    policy = build_student(cfg, recipe.codec, recipe.obs_size)
    artifact = load_artifact(export_student(policy, cfg, recipe.codec, tmp_path / "student"))
    assert artifact.metadata["shares"] == [1.0] and artifact.nvec == recipe.codec.nvec
    controller = PpoController(artifact, name="student")
    workload = make_scenario("day", seed=0, duration_s=30.0)
    row = run(workload, controller, DeploymentSpec(), drain_s=30.0).row
    assert row["completed"] + row["rejected"] + row["unfinished"] == len(workload)
    assert controller._held is not None and controller._held.caps == (None,) * 4
    # fine-tuning builds its env from the same ladder, so the spaces match
    from policies.training.finetune import recipe_env_kwargs

    kwargs = recipe_env_kwargs(cfg.gpu, cfg.model, cfg.pools, 60.0, cfg.obs_version,
                               cfg.decision_ticks, cfg.shares)
    env = gym.make(envs.ENV_ID, **kwargs)
    assert list(env.action_space.nvec) == recipe.codec.nvec
    env.close()
