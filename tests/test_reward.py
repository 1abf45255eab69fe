"""The per-tick reward: every component recomputed independently, and they add up."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.control.reward import RewardConfig, compute_reward
from rlbatch.control.types import SLA, DeploymentStats
from tests.factories import deployment_stats, engine_stats, random_deployment_stats, record, window

SLA_ = SLA(ttft_s=2.0, tpot_s=0.1)


def _expected_parts(stats: DeploymentStats, overrides: int, norm: float,
                    cfg: RewardConfig) -> dict[str, float]:
    recs = [r for e in stats.engines for r in e.finished]
    good = [r for r in recs if r.ttft_s <= SLA_.ttft_s and r.tpot_s <= SLA_.tpot_s]
    missed = len(recs) - len(good) + sum(stats.rejected)
    n = max(norm, 1e-6)
    late = [min(max(w / SLA_.ttft_s - 1.0, 0.0), 5.0) for w in stats.oldest_wait_s]
    attain = [m / c for m, c in zip(stats.window.sla_met, stats.window.completed, strict=True)
              if c]
    return {
        "goodput": len(good) / n,
        "sla_miss": -cfg.w_miss * missed / n,
        "late_queue": -cfg.w_wait * sum(late) / len(stats.queued),
        "preemption": -cfg.w_preempt * sum(e.preemptions for e in stats.engines) / n,
        "kv_overflow": -cfg.w_overflow * float(any(e.kv_overflows for e in stats.engines)),
        "guard": -cfg.w_guard * overrides / len(stats.queued),
        "fp8_quality": -cfg.w_fp8 * sum(r.pool == "fp8" for r in good) / n,
        "fairness": cfg.w_fair * ((min(attain) if attain else 1.0) - 1.0),
    }


@settings(max_examples=80, deadline=None)
@given(stats=random_deployment_stats(), overrides=st.integers(0, 10),
       norm=st.floats(0.0, 50.0))
def test_reward_components_add_up(stats: DeploymentStats, overrides: int, norm: float) -> None:
    cfg = RewardConfig()
    reward, parts = compute_reward(stats, overrides, norm, SLA_, cfg)
    expected = _expected_parts(stats, overrides, norm, cfg)
    assert set(parts) == set(expected)
    for name, value in expected.items():
        if math.isnan(value):
            assert math.isnan(parts[name]), name
        else:
            assert parts[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    if all(math.isfinite(v) for v in parts.values()):
        assert reward == pytest.approx(math.fsum(parts.values()), rel=1e-12, abs=1e-12)


def test_reward_of_a_hand_checked_tick() -> None:
    finished = (record(0, 0, ttft=0.5, tpot=0.05),  # meets the SLA
                record(1, 0, ttft=3.0, tpot=0.05),  # misses (TTFT)
                record(2, 1, ttft=0.5, tpot=0.05, pool="fp8"))
    stats = deployment_stats(
        (engine_stats(finished=finished, preemptions=2, kv_overflows=1),),
        rejected=(1, 0, 0), oldest_wait_s=(4.0, 0.0, 0.0),
        win=window(completed=(2, 1, 0), sla_met=(1, 1, 0)))
    reward, parts = compute_reward(stats, 3, 2.0, SLA_, RewardConfig())
    assert parts["goodput"] == 1.0  # 2 met / norm 2
    assert parts["sla_miss"] == -0.5 * 2 / 2.0  # one late, one rejected
    assert parts["late_queue"] == pytest.approx(-0.2 * 1.0 / 3)
    assert parts["preemption"] == -0.05 * 2 / 2.0
    assert parts["kv_overflow"] == -1.0
    assert parts["guard"] == pytest.approx(-0.02 * 3 / 3)
    assert parts["fp8_quality"] == -0.015 * 1 / 2.0
    assert parts["fairness"] == pytest.approx(0.2 * (0.5 - 1.0))
    assert reward == pytest.approx(sum(parts.values()))
