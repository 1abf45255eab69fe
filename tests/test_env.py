"""The registered Gymnasium environment: checkers, determinism, action validation."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs
from envs.batch_size import BatchSizeEnv
from rlbatch.control.observation import feature_names

SHORT = {"episode_s": 60.0, "drain_s": 20.0}


@pytest.mark.parametrize("kwargs", [
    {"scenario": "night"},
    {"scenario": "mixed"},
    {"scenario": "day", "pools": "fp16:1,fp8:1"},
    {"scenario": "mixed", "action_kind": "total_share", "obs_version": 2, "decision_ticks": 5},
    {"scenario": "day", "action_kind": "total_share", "obs_version": 3, "decision_ticks": 5,
     "gpu": "h200-141g", "model": "llama-3.1-8b"},
    {"scenario": "mixed", "action_kind": "total_share", "obs_version": 4, "decision_ticks": 5,
     "pools": "fp16:1,fp8:1"},
    {"scenario": "day", "action_kind": "total_share", "obs_version": 3, "decision_ticks": 5,
     "pools": "fp16:1,fp8:1", "shares": (1.0,)},
    {"scenario": "mixed", "action_kind": "total_share", "obs_version": 6, "decision_ticks": 5,
     "pools": "fp16:1,fp8:1"},
])
def test_registered_env_passes_checkers(kwargs: dict[str, object]) -> None:
    env = gym.make(envs.ENV_ID, **SHORT, **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(gym.make(envs.ENV_ID, **SHORT, **kwargs).unwrapped, warn=True)


def _rollout(seed: int, steps: int = 80,
             **kwargs: object) -> list[tuple[np.ndarray, float, bool]]:
    env = gym.make(envs.ENV_ID, scenario="mixed", **SHORT, **kwargs)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    out = [(obs, 0.0, False)]
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        out.append((obs, float(reward), truncated))
        if terminated or truncated:
            obs, _ = env.reset()
            out.append((obs, 0.0, False))
    return out


@pytest.mark.parametrize("kwargs", [
    {}, {"action_kind": "total_share", "obs_version": 2, "decision_ticks": 3},
    {"action_kind": "total_share", "obs_version": 3, "decision_ticks": 3},
    {"action_kind": "total_share", "obs_version": 4, "decision_ticks": 3},
    {"action_kind": "total_share", "obs_version": 3, "decision_ticks": 3, "shares": (1.0,)},
    {"action_kind": "total_share", "obs_version": 6, "decision_ticks": 3}])
def test_same_seed_identical_rollouts(kwargs: dict[str, object]) -> None:
    a, b = _rollout(3, **kwargs), _rollout(3, **kwargs)
    assert len(a) == len(b)
    for (oa, ra, ta), (ob, rb, tb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(oa, ob)
        assert (ra, ta) == (rb, tb)


def test_different_seed_different_episode() -> None:
    a, b = _rollout(3, 30), _rollout(4, 30)
    assert any(not np.array_equal(x[0], y[0]) for x, y in zip(a, b, strict=False))


@pytest.mark.parametrize("action,message", [
    ([0, 0, 0, 0, 0, 0, 0], "shape"),
    ([10, 0, 0, 0, 0, 0, 0, 0], "cap index 10"),
    ([-1, 0, 0, 0, 0, 0, 0, 0], "cap index -1"),
    ([0, 1, 0, 0, 0, 0, 0, 0], "pool index 1"),
    ([0.5, 0, 0, 0, 0, 0, 0, 0], "integers"),
])
def test_invalid_actions_raise(action: list[float], message: str) -> None:
    env = BatchSizeEnv(scenario="day", **SHORT)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=message):
        env.step(np.array(action))


def test_step_before_reset_raises() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        BatchSizeEnv(scenario="day", **SHORT).step(np.zeros(8, dtype=np.int64))


def test_info_carries_reward_parts_that_sum_to_reward() -> None:
    env = BatchSizeEnv(scenario="night", **SHORT)
    env.reset(seed=1)
    for _ in range(20):
        _, reward, _, _, info = env.step(env.action_space.sample())
        assert reward == pytest.approx(sum(info["reward_parts"].values()))
        assert set(info["reward_parts"]) == {"goodput", "sla_miss", "unfinished",
                                             "late_queue", "preemption", "kv_overflow",
                                             "guard", "fp8_quality", "fairness"}


def test_guard_applies_inside_env() -> None:
    env = BatchSizeEnv(scenario="day", **SHORT)
    env.reset(seed=0)
    top = np.array([9, 0] * 4)  # every bucket asks for cap 64
    for _ in range(5):
        _, _, _, _, info = env.step(top)
    assert info["caps"] == (64, 64, 64, 64)  # warm engines: nothing to override
    cold = BatchSizeEnv(scenario="day", **SHORT)
    cold.deployment_spec = cold.deployment_spec.__class__(
        **{**cold.deployment_spec.__dict__, "cold_start": True})
    cold.reset(seed=0)
    _, _, _, _, info = cold.step(top)
    assert info["caps"] == (4, 4, 4, 4) and "warmup" in info["overrides"]


def test_episode_ends_with_summary_and_nothing_lost() -> None:
    env = BatchSizeEnv(scenario="night", **SHORT)
    env.reset(seed=2)
    assert env.workload is not None
    truncated = False
    info: dict[str, object] = {}
    while not truncated:
        _, _, _, truncated, info = env.step(env.action_space.sample())
    summary = info["episode_summary"]
    assert isinstance(summary, dict)
    assert summary["completed"] + summary["rejected"] + summary["unfinished"] == len(env.workload)
    assert summary["kv_overflows"] == 0


def test_observation_names_cover_the_vector() -> None:
    env = BatchSizeEnv(scenario="day", **SHORT)
    obs, _ = env.reset(seed=0)
    assert len(feature_names(("0-1k", "1k-2k", "2k-4k", "4k+"))) == obs.shape[0] == 45
