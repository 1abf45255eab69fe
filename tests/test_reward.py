"""The per-tick reward: every component recomputed independently, and they add up."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.batch_size import BatchSizeEnv
from rlbatch.control.reward import REWARD_PARTS, RewardConfig, compute_reward, episode_objective
from rlbatch.control.types import SLA, ControlAction, DeploymentStats
from rlbatch.workload.scenarios import slice_trace
from rlbatch.workload.traces import load_trace
from tests.factories import (
    counts3,
    deployment_stats,
    engine_stats,
    random_deployment_stats,
    record,
    window,
)

SLA_ = SLA(ttft_s=2.0, tpot_s=0.1)


def _expected_parts(stats: DeploymentStats, overrides: int, norm: float, cfg: RewardConfig,
                    unbooked: tuple[int, ...] = ()) -> dict[str, float]:
    recs = [r for e in stats.engines for r in e.finished]
    good = [r for r in recs if r.ttft_s <= SLA_.ttft_s and r.tpot_s <= SLA_.tpot_s]
    bad = [r for r in recs if r not in good]
    if stats.doomed:  # tracked: a TTFT miss was booked as doomed
        bad = [r for r in bad if r.ttft_s <= SLA_.ttft_s]
    missed = len(bad) + sum(stats.rejected) + sum(stats.doomed)
    n = max(norm, 1e-6)
    late = [min(max(w / SLA_.ttft_s - 1.0, 0.0), cfg.wait_cap) for w in stats.oldest_wait_s]
    attain = []
    for b, (m, c) in enumerate(zip(stats.window.sla_met, stats.window.completed, strict=True)):
        if c:
            attain.append(m / c)
        elif (stats.doomed and stats.doomed[b] + stats.doomed_pending[b] > 0) \
                or stats.oldest_wait_s[b] > SLA_.ttft_s:
            attain.append(0.0)
    return {
        "goodput": len(good) / n,
        "sla_miss": -cfg.w_miss * missed / n,
        "unfinished": -cfg.w_miss * sum(unbooked) / n,
        "late_queue": -cfg.w_wait * sum(late) / len(stats.queued),
        "preemption": -cfg.w_preempt * sum(e.preemptions for e in stats.engines) / n,
        "kv_overflow": -cfg.w_overflow * float(any(e.kv_overflows for e in stats.engines)),
        "guard": -cfg.w_guard * overrides / len(stats.queued),
        "fp8_quality": -cfg.w_fp8 * sum(r.pool == "fp8" for r in good) / n,
        "fairness": cfg.w_fair * ((min(attain) if attain else 1.0) - 1.0),
    }


@settings(max_examples=80, deadline=None)
@given(stats=random_deployment_stats(), overrides=st.integers(0, 10),
       norm=st.floats(0.0, 50.0), doomed=st.one_of(st.none(), st.tuples(counts3, counts3)),
       unbooked=st.one_of(st.just(()), counts3))
def test_reward_components_add_up(stats: DeploymentStats, overrides: int, norm: float,
                                  doomed: tuple[tuple[int, ...], tuple[int, ...]] | None,
                                  unbooked: tuple[int, ...]) -> None:
    if doomed is not None:
        stats = replace(stats, doomed=doomed[0], doomed_pending=doomed[1])
    cfg = RewardConfig()
    reward, parts = compute_reward(stats, overrides, norm, SLA_, cfg, unbooked=unbooked)
    expected = _expected_parts(stats, overrides, norm, cfg, unbooked)
    assert set(parts) == set(expected) == set(REWARD_PARTS)
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
    assert parts["unfinished"] == 0.0
    assert parts["late_queue"] == pytest.approx(-0.2 * 1.0 / 3)
    assert parts["preemption"] == -0.05 * 2 / 2.0
    assert parts["kv_overflow"] == -1.0
    assert parts["guard"] == pytest.approx(-0.02 * 3 / 3)
    assert parts["fp8_quality"] == -0.015 * 1 / 2.0
    assert parts["fairness"] == pytest.approx(0.2 * (0.5 - 1.0))
    assert reward == pytest.approx(sum(parts.values()))


def test_a_doomed_request_is_booked_once_and_its_late_completion_never() -> None:
    # tracked stats: request 1 finishes with TTFT 3 s (doomed in an earlier tick), request
    # 2 within TTFT but over TPOT; two others doomed in this tick
    finished = (record(0, 0, ttft=0.5, tpot=0.05), record(1, 0, ttft=3.0, tpot=0.05),
                record(2, 1, ttft=0.5, tpot=0.5))
    stats = replace(deployment_stats((engine_stats(finished=finished),)), doomed=(2, 0, 0),
                    doomed_pending=(2, 0, 0))
    _, parts = compute_reward(stats, 0, 1.0, SLA_, RewardConfig())
    assert parts["goodput"] == 1.0
    assert parts["sla_miss"] == -0.5 * 3  # 2 doomed + 1 over TPOT; request 1 not again
    untracked = replace(stats, doomed=(), doomed_pending=())
    _, parts = compute_reward(untracked, 0, 1.0, SLA_, RewardConfig())
    assert parts["sla_miss"] == -0.5 * 2  # without tracking: booked at completion


def test_unfinished_requests_are_booked_at_the_episode_end() -> None:
    stats = replace(deployment_stats((engine_stats(),)), doomed=(0, 0, 0),
                    doomed_pending=(0, 0, 0))
    _, parts = compute_reward(stats, 0, 4.0, SLA_, RewardConfig(), unbooked=(3, 0, 1))
    assert parts["unfinished"] == -0.5 * 4 / 4.0


@pytest.mark.parametrize(("doomed", "pending", "oldest", "worst"), [
    ((0, 0, 0), (0, 0, 0), (0.0, 0.0, 0.0), 0.5),   # bucket 1 idle: skipped
    ((0, 0, 0), (0, 0, 0), (0.0, 1.5, 0.0), 0.5),   # queued, not yet late: skipped
    ((0, 1, 0), (0, 1, 0), (0.0, 0.0, 0.0), 0.0),   # doomed in the tick: starved
    ((0, 0, 0), (0, 7, 0), (0.0, 0.0, 0.0), 0.0),   # doomed earlier, still waiting
    ((0, 0, 0), (0, 0, 0), (0.0, 2.5, 0.0), 0.0),   # queue head past its deadline
])
def test_a_starved_bucket_counts_zero_in_the_fairness_term(
        doomed: tuple[int, ...], pending: tuple[int, ...], oldest: tuple[float, ...],
        worst: float) -> None:
    # bucket 0: 1 of 2 window completions met the SLA; bucket 1: no completions
    stats = replace(deployment_stats((engine_stats(),), oldest_wait_s=oldest,
                                     win=window(completed=(2, 0, 3), sla_met=(1, 0, 3))),
                    doomed=doomed, doomed_pending=pending)
    _, parts = compute_reward(stats, 0, 1.0, SLA_, RewardConfig())
    assert parts["fairness"] == pytest.approx(0.2 * (worst - 1.0))


def test_episode_objective_of_a_hand_checked_run() -> None:
    records = [record(0, 0), record(1, 0, ttft=3.0), record(2, 1),
               record(3, 1, rejected=True)]
    obj = episode_objective(records, (1, 0, 0), SLA_)
    assert (obj.requests, obj.met, obj.missed) == (5, 2, 3)
    assert obj.attainment[:2] == (1 / 3, 1 / 2) and math.isnan(obj.attainment[2])
    assert obj.worst_attainment == 1 / 3 and obj.goodput == 2 / 5
    assert obj.score == pytest.approx((2 - 0.5 * 3) / 5 + 0.2 * (1 / 3 - 1))
    starved = episode_objective(records, (1, 0, 4), SLA_)
    assert starved.worst_attainment == 0.0


REFERENCE = ("azure_conv_2023.csv", 1050.0, 600.0, 0.75)
"""The reference contested episode: 600 s of the Azure trace from 1050 s, time-compressed to
rate x0.75 (2,720 requests; the best static, 32 per bucket, meets 57% of the SLA)."""


def test_starving_a_bucket_scores_below_a_fair_cap_set(
        trace_path: Callable[[str], Path]) -> None:
    name, start, duration, rate = REFERENCE
    workload = slice_trace(load_trace(trace_path(name)), start, duration, rate)

    def episode(caps: tuple[int, ...]) -> tuple[float, int, float]:
        env = BatchSizeEnv(scenario="night")
        env.reset(seed=0, options={"workload": workload})
        action = env.encode_action(ControlAction(caps, ("fp16",) * 4))
        total = 0.0
        info: dict[str, Any] = {}
        truncated = False
        while not truncated:
            _, reward, _, truncated, info = env.step(action)
            total += float(reward)
        summary = info["episode_summary"]
        return total, summary["unfinished"], summary["sla_attainment"]

    starving, left, _ = episode((64, 1, 64, 64))
    fair, fair_left, fair_sla = episode((32, 32, 32, 32))
    print(f"reference episode: starving (64,1,64,64) return {starving:.1f}, {left} "
          f"unfinished; fair (32,32,32,32) return {fair:.1f}, {fair_left} unfinished")
    assert 0.2 <= fair_sla <= 0.95  # contested
    assert left > 500 and fair_left == 0
    assert starving < fair
