"""The trim release: a policy's per-bucket trim is lifted while its queue head waits too long."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from envs.batch_size import BatchSizeEnv
from policies.ppo import PpoController, ppo_factory
from rlbatch.control.guard import GuardConfig
from rlbatch.control.trim_release import TRIM_RELEASE_FRACTION, release_late_trims
from rlbatch.control.types import ControlAction, DeploymentStats, WindowStats

POOLS = ("fp16",) * 4


def _stats(queued: tuple[int, ...], waits: tuple[float, ...]) -> DeploymentStats:
    window = WindowStats(30.0, (0.0,) * 4, (0.0,) * 4, 0.0, 0.0, 0.0, (0,) * 4, (0,) * 4)
    return DeploymentStats(10.0, 1.0, (), queued, (0,) * 4, (0,) * 4, window,
                           ControlAction((None,) * 4, POOLS), oldest_wait_s=waits)


TRIMMED = ControlAction((2, 4, 8, None), POOLS, max_num_seqs=16)


@pytest.mark.parametrize(("queued", "waits", "caps"), [
    ((1, 1, 1, 1), (0.5, 0.99, 1.0, 5.0), (2, 4, None, None)),  # at the wait it is released
    ((0, 3, 0, 0), (0.0, 4.0, 0.0, 0.0), (2, None, 8, None)),
    ((0, 0, 0, 9), (0.0, 0.0, 0.0, 9.0), (2, 4, 8, None)),  # untrimmed: nothing to release
    ((0, 0, 0, 0), (0.0, 0.0, 0.0, 0.0), (2, 4, 8, None)),
])
def test_only_trims_of_buckets_whose_queue_head_waited_are_released(
        queued: tuple[int, ...], waits: tuple[float, ...], caps: tuple[int | None, ...]) -> None:
    released = release_late_trims(TRIMMED, _stats(queued, waits), 1.0)
    assert released.caps == caps
    assert released.max_num_seqs == 16 and released.pools == POOLS


def test_a_cap_at_the_total_or_without_a_total_is_not_a_trim() -> None:
    late = _stats((1, 1, 1, 1), (3.0,) * 4)
    at_total = ControlAction((16, 16, 2, None), POOLS, max_num_seqs=16)
    assert release_late_trims(at_total, late, 1.0).caps == (16, 16, None, None)
    per_bucket = ControlAction((2, 4, 8, 16), POOLS)  # no engine-wide total
    assert release_late_trims(per_bucket, late, 1.0) is per_bucket


def test_nothing_to_judge_leaves_the_action() -> None:
    assert release_late_trims(TRIMMED, None, 1.0) is TRIMMED
    assert release_late_trims(TRIMMED, replace(_stats((1,) * 4, (9.0,) * 4),
                                               oldest_wait_s=()), 1.0) is TRIMMED


@pytest.mark.parametrize("wait_s", [0.0, -1.0, float("nan")])
def test_a_wait_that_is_not_positive_raises(wait_s: float) -> None:
    with pytest.raises(ValueError, match="trim release wait"):
        release_late_trims(TRIMMED, None, wait_s)


def test_ppo_spec_sets_the_release() -> None:
    default = ppo_factory("policies/default")
    assert default.trim_release == TRIM_RELEASE_FRACTION
    assert ppo_factory("policies/default:release=0.25").trim_release == 0.25
    off = ppo_factory("policies/default:release=off")
    assert off.trim_release is None and off.name == "ppo:policies/default:release=off"
    for bad in ("release=0", "release=-1", "release=soon"):
        with pytest.raises(ValueError, match="release takes"):
            ppo_factory(f"policies/default:{bad}")
    with pytest.raises(ValueError, match="trim_release must be > 0"):
        PpoController(default.artifact, trim_release=0.0)


def test_env_releases_a_starving_trim_exactly_when_the_queue_head_has_waited() -> None:
    # A total of 16 with the 0-1k bucket held to 1/8 of it (cap 2), the guard's rules off so
    # that the caps in force are the proposal: with the release, the bucket's cap is lifted
    # on exactly the ticks whose previous snapshot had its queue head waiting 1 s or more.
    unguarded = GuardConfig(ladder=(4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
                            warmup=False, kv_high=False, p99=False, efficiency=False,
                            kv_budget=False)
    kwargs = {"scenario": "day", "episode_s": 60.0, "drain_s": 20.0, "guard": unguarded,
              "action_kind": "total_share", "obs_version": 3, "load_scale": 6.0}
    action = np.array([3, 0, 0, 3, 0, 3, 0, 3, 0], dtype=np.int64)  # 16; 0-1k at 1/8
    caps_in_force: dict[float | None, list[int | None]] = {}
    released_ticks = 0
    for wait_s in (None, 1.0):
        env = BatchSizeEnv(**kwargs, trim_release_s=wait_s)  # type: ignore[arg-type]
        env.reset(seed=3)
        caps: list[int | None] = []
        previous = None
        for _ in range(60):
            env.step(action)
            stats = env._last_stats
            assert stats is not None
            caps.append(stats.action.caps[0])
            if wait_s is not None and previous is not None:
                late = previous.queued[0] > 0 and previous.oldest_wait_s[0] >= wait_s
                assert stats.action.caps[0] == (None if late else 2)
                released_ticks += late
            previous = stats
        caps_in_force[wait_s] = caps
    assert set(caps_in_force[None]) == {2}
    assert released_ticks > 0
