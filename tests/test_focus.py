"""DAgger's focus: the student's total error per kind of episode and the families' odds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from policies.training.distill import Demonstrations, fit_policy
from policies.training.episodes import (
    TRAINING_FAMILIES,
    draw_family,
    family_episode,
    sample_tagged_episodes,
)
from policies.training.focus import FOCUS_FLOOR, focus_weights, total_errors
from policies.training.recipe import RecipeConfig, build_student
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.observation import observation_size

CODEC = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)


def _demos(obs: np.ndarray, total_index: int) -> Demonstrations:
    actions = np.zeros((len(obs), len(CODEC.nvec)), dtype=np.int64)
    actions[:, 0] = total_index
    actions[:, 1::2] = 3
    return Demonstrations(obs, actions)


def test_total_errors_measure_the_distance_on_the_ladder_per_kind(tmp_path: Path) -> None:
    """A student fitted to one teacher total (index 11) is 0 steps off where the teacher
    chose it and exactly 8 steps off where the teacher chose index 3."""
    size = observation_size(4, 2)
    cfg = RecipeConfig(traces=(), deployments=(), obs_version=2, out=str(tmp_path))
    policy = build_student(cfg, CODEC, size)
    obs = np.random.default_rng(0).uniform(0, 1, size=(64, size)).astype(np.float32)
    fit_policy(policy, _demos(obs, 11), epochs=100, batch_size=32)
    errors = total_errors(policy, [_demos(obs[:32], 11), _demos(obs[32:], 3),
                                   _demos(obs[:16], 3)], ["chat", "code", "code"])
    assert errors == {"chat": 0.0, "code": 8.0}
    with pytest.raises(ValueError, match="2 episodes but 1 kinds"):
        total_errors(policy, [_demos(obs, 11)] * 2, ["chat"])


def test_focus_weights_grow_with_the_error_and_count_unseen_families_as_the_worst() -> None:
    weights = focus_weights({"chat": 0.0, "code": 2.0, "trace": 5.0})
    assert set(weights) == set(TRAINING_FAMILIES)
    assert weights["chat"] == FOCUS_FLOOR
    assert weights["code"] == pytest.approx(FOCUS_FLOOR + 2.0)
    # trace slices are not families; unseen families take the worst family's error
    assert weights["rag"] == weights["report"] == weights["drift"] == weights["code"]
    assert focus_weights({}) == {f: FOCUS_FLOOR + 1.0 for f in TRAINING_FAMILIES}
    with pytest.raises(ValueError, match="floor"):
        focus_weights({}, floor=0.0)


def test_family_draws_follow_the_odds_and_refuse_bad_ones() -> None:
    rng = np.random.default_rng(0)
    draws = [draw_family(rng, {"code": 3.0, "chat": 1.0}) for _ in range(400)]
    assert set(draws) == {"code", "chat"}
    assert 0.68 < draws.count("code") / 400 < 0.82
    for bad in ({"code": -1.0}, {"code": float("nan")}, {"code": 0.0}):
        with pytest.raises(ValueError, match="family weights"):
            draw_family(rng, bad)


def test_tagged_episodes_name_their_kind_and_keep_the_untagged_draws() -> None:
    cfg = RecipeConfig(traces=(), family_share=0.5, episode_s=60.0, deployments=())
    tagged = sample_tagged_episodes(cfg, np.random.default_rng(3), 12, [])
    kinds = {kind for kind, _ in tagged}
    assert kinds <= {*TRAINING_FAMILIES, "generated"} and "generated" in kinds
    assert kinds & set(TRAINING_FAMILIES)
    only_code = sample_tagged_episodes(replace(cfg, family_share=1.0),
                                       np.random.default_rng(3), 6, [], {"code": 1.0})
    assert [kind for kind, _ in only_code] == ["code"] * 6


def test_drifts_pass_through_the_families_at_the_focus_odds() -> None:
    """With focus odds, a drift's two families are drawn at them (distinct, the second from
    the rest); without odds the draws stay uniform."""
    cfg = RecipeConfig(traces=(), family_share=1.0, episode_s=60.0, deployments=())
    rng = np.random.default_rng(5)
    pairs = [family_episode(cfg, rng, 1.0, "drift", {"code": 8.0, "chat": 1.0, "drift": 9.0})
             .name.split("-")[1:] for _ in range(200)]
    assert all(len(set(p)) == 2 for p in pairs)
    assert {f for p in pairs for f in p} == {"code", "chat"}
    assert 0.8 < sum(p[0] == "code" for p in pairs) / 200 < 0.97
    only_code = [family_episode(cfg, rng, 1.0, "drift", {"code": 1.0}).name.split("-")[1:]
                 for _ in range(40)]
    assert all(p[0] == "code" and p[1] != "code" for p in only_code)
    assert len({p[1] for p in only_code}) == 3
    uniform = {tuple(family_episode(cfg, rng, 1.0, "drift").name.split("-")[1:])
               for _ in range(120)}
    assert len(uniform) == 12
