"""The guard: property tests over arbitrary observations, each rule, and guard-alone safety."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.rules import GuardedController
from rlbatch.buckets import Buckets
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import AdmissionDiscipline
from rlbatch.control.guard import RULES, Guard, GuardConfig
from rlbatch.control.pipeline import DecisionPipeline
from rlbatch.control.types import (
    SLA,
    ControlAction,
    DeploymentInfo,
    DeploymentStats,
    WindowStats,
    balanced_route,
)
from rlbatch.engine.stats import EngineStats
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import load_trace
from rlbatch.workload.scenarios import SCENARIOS, make_scenario
from rlbatch.workload.spec import resolve_workload

INFO = DeploymentInfo(buckets=Buckets(), pools={"fp16": 1, "fp8": 1}, gpu="a100-80g",
                      model="llama-2-7b", default_max_num_seqs=256, max_num_batched_tokens=2048,
                      num_kv_blocks={"fp16": 7000, "fp8": 14000}, block_size=16,
                      max_model_len=4096, tick_s=1.0, sla=SLA(), cold_start=True)

wild = st.floats(allow_nan=True, allow_infinity=True)
wild_int = st.integers(min_value=-10**12, max_value=10**12)


@st.composite
def engine_stats(draw: st.DrawFn) -> EngineStats:
    four = st.tuples(wild_int, wild_int, wild_int, wild_int)
    return EngineStats(
        engine_id=0, pool="fp16", start_s=draw(wild), time_s=draw(wild),
        running=draw(four), waiting=draw(four), kv_cache_usage=draw(wild),
        kv_cache_usage_peak=draw(wild), committed_tokens=draw(wild_int),
        kv_capacity_tokens=draw(wild_int), num_kv_blocks=draw(wild_int),
        gpu_memory_used_bytes=draw(wild_int), gpu_memory_total_bytes=draw(wild_int),
        iterations=draw(wild_int), busy_s=draw(wild), prefill_tokens=draw(wild_int),
        decode_tokens=draw(wild_int), preemptions=draw(wild_int),
        recomputed_tokens=draw(wild_int), kv_overflows=draw(wild_int),
        max_num_seqs=256, finished=())


@st.composite
def deployment_stats(draw: st.DrawFn) -> DeploymentStats:
    four_f = st.tuples(wild, wild, wild, wild)
    four_i = st.tuples(wild_int, wild_int, wild_int, wild_int)
    caps = draw(st.tuples(*[st.one_of(st.none(), st.integers(1, 10**6))] * 4))
    pools = draw(st.tuples(*[st.sampled_from(["fp16", "fp8"])] * 4))
    window = WindowStats(draw(wild), draw(four_f), draw(four_f), draw(wild), draw(wild),
                         draw(wild), draw(four_i), draw(four_i))
    return DeploymentStats(
        time_s=draw(wild), tick_s=draw(wild),
        engines=tuple(draw(st.lists(engine_stats(), min_size=0, max_size=2))),
        queued=draw(four_i), arrived=draw(four_i), rejected=draw(four_i), window=window,
        action=ControlAction(caps, pools), kv_budget_blocked=draw(st.booleans()),
        oldest_wait_s=draw(four_f))


proposals = st.one_of(
    st.none(),
    st.builds(lambda caps, pools, total: ControlAction(caps, pools, total),
              st.tuples(*[st.one_of(st.none(), st.integers(1, 10**9))] * 4),
              st.tuples(*[st.sampled_from(["fp16", "fp8", "fp4", ""])] * 4),
              st.one_of(st.none(), st.integers(1, 10**9))))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(proposals, st.one_of(st.none(), deployment_stats())), min_size=1,
                max_size=6), st.sampled_from(["proportional", "halve", "no_batching"]),
       st.booleans(), st.booleans())
def test_guard_output_is_always_safe_and_deterministic(
        sequence: list[tuple[ControlAction | None, DeploymentStats | None]],
        fallback: str, tpot_fit: bool, per_pool: bool) -> None:
    config = GuardConfig(p99_fallback=fallback, tpot_fit=tpot_fit,  # type: ignore[arg-type]
                         tpot_fit_per_pool=per_pool)
    a, b = Guard(config), Guard(config)
    a.reset(INFO)
    b.reset(INFO)
    for proposed, stats in sequence:
        out_a, over_a = a.check(proposed, stats)
        out_b, over_b = b.check(proposed, stats)
        assert out_a == out_b and over_a == over_b
        assert len(out_a.caps) == 4
        total = out_a.max_num_seqs
        # the proposal's total stays (clamped, only ever lowered); none stays none
        if proposed is None or proposed.max_num_seqs is None:
            assert total is None
        else:
            assert total is not None and 1 <= total <= min(proposed.max_num_seqs,
                                                           config.max_total_cap)
        for cap in out_a.caps:  # an uncapped bucket within a total is capped at the total
            assert cap is not None and 1 <= cap <= (config.max_cap if total is None
                                                    else max(config.max_cap, total))
        assert set(out_a.pools) <= {"fp16", "fp8"}
        assert all(o.rule in RULES for o in over_a)
        # a pool's cap only lowers the total, for a pool of the deployment, with the rule on
        assert all(pool in INFO.pools and total is not None and 1 <= cap < total
                   for pool, cap in out_a.pool_max_num_seqs)
        assert (per_pool and tpot_fit) or not out_a.pool_max_num_seqs


def _stats(t: float, kv: float = 0.1, tpot_p99: float = 0.02, ttft_p99: float = 0.5,
           caps: tuple[int, ...] = (32, 32, 32, 32), recomputed: int = 0,
           computed: int = 1000) -> DeploymentStats:
    nan4 = (float("nan"),) * 4
    engine = EngineStats(0, "fp16", t - 1, t, (0,) * 4, (0,) * 4, kv, kv, 0, 1000, 100, 0, 1,
                         10, 1.0, computed // 2, computed - computed // 2, 0, recomputed, 0,
                         256, ())
    window = WindowStats(30.0, nan4, nan4, ttft_p99, tpot_p99, 1.0, (0,) * 4, (0,) * 4)
    return DeploymentStats(t, 1.0, (engine,), (0,) * 4, (0,) * 4, (0,) * 4, window,
                           ControlAction(caps, ("fp16",) * 4))


PROPOSED = ControlAction((64, 64, 64, 64), ("fp16",) * 4)


def test_warmup_ramp_4_plus_4_per_minute() -> None:
    guard = Guard()
    guard.reset(INFO)
    caps = {t: guard.check(PROPOSED, _stats(t))[0].caps[0] for t in (1, 59, 60, 130, 299, 300)}
    assert caps == {1: 4, 59: 4, 60: 8, 130: 12, 299: 20, 300: 64}


def test_kv_high_for_10s_halves_then_releases() -> None:
    guard = Guard(GuardConfig(warmup=False))
    guard.reset(INFO)
    caps = []
    for t in range(1, 25):
        caps.append(guard.check(PROPOSED, _stats(t, kv=0.9, caps=(32,) * 4))[0].caps[0])
    assert caps[:9] == [64] * 9  # high for less than 10 s
    assert caps[9] == 16 and caps[19] == 8  # halved at 10 s, again at 20 s
    assert guard.check(PROPOSED, _stats(30, kv=0.5))[0].caps[0] == 64


@pytest.mark.parametrize("tick_s", [-1e292, float("nan"), float("inf"), 1e300])
def test_kv_high_with_an_odd_tick_counts_from_now(tick_s: float) -> None:
    # found by the property test above (the largest float as time, a tick of -1e292: the
    # rule's start at -inf, the halvings due at NaN); a tick outside (0, t] counts as none
    guard = Guard(GuardConfig(warmup=False))
    guard.reset(INFO)
    caps = [guard.check(PROPOSED, replace(_stats(100.0, kv=0.9), tick_s=tick_s))[0].caps[0]]
    caps += [guard.check(PROPOSED, _stats(t, kv=0.9, caps=(32,) * 4))[0].caps[0]
             for t in range(101, 111)]
    assert caps == [64] * 10 + [16]  # halved 10 s after the first high reading, not before
    extreme = replace(_stats(1.7976931348623157e308, kv=1.0), tick_s=tick_s)
    fresh = Guard(GuardConfig(warmup=False))
    fresh.reset(INFO)
    out = fresh.check(PROPOSED, extreme)[0]  # raised ValueError (NaN halvings) before
    assert all(c is not None and 1 <= c <= 64 for c in out.caps)


@pytest.mark.parametrize("fallback,expected", [("halve", 16), ("no_batching", 1)])
def test_p99_breach_falls_back_and_holds(fallback: str, expected: int) -> None:
    guard = Guard(GuardConfig(warmup=False, p99_fallback=fallback, p99_hold_s=5))  # type: ignore[arg-type]
    guard.reset(INFO)
    action, overrides = guard.check(PROPOSED, _stats(10, tpot_p99=0.5))
    assert action.caps[0] == expected and overrides[0].rule == "p99"
    for t in range(11, 16):  # recovered, but held for 5 s
        assert guard.check(PROPOSED, _stats(t))[0].caps[0] == expected
    assert guard.check(PROPOSED, _stats(16))[0].caps[0] == 64


def test_ttft_breach_ignored_by_default_watched_when_asked() -> None:
    default = Guard(GuardConfig(warmup=False))
    default.reset(INFO)
    assert default.check(PROPOSED, _stats(10, ttft_p99=9.0))[0].caps[0] == 64
    strict = Guard(GuardConfig(warmup=False, p99_metrics=("ttft", "tpot"), p99_fallback="halve"))
    strict.reset(INFO)
    assert strict.check(PROPOSED, _stats(10, ttft_p99=9.0))[0].caps[0] == 16
    # proportional: nothing arrived, nothing occupied, iterations fast: no bucket to blame
    proportional = Guard(GuardConfig(warmup=False, p99_metrics=("ttft", "tpot")))
    proportional.reset(INFO)
    action, overrides = proportional.check(PROPOSED, _stats(10, ttft_p99=9.0))
    assert action.caps == PROPOSED.caps and not overrides


def test_low_efficiency_shrinks_caps() -> None:
    guard = Guard(GuardConfig(warmup=False))
    guard.reset(INFO)
    action, overrides = guard.check(PROPOSED, _stats(5, recomputed=400, computed=1000))
    assert action.caps == (24, 24, 24, 24) and {o.rule for o in overrides} == {"efficiency"}


def test_every_rule_can_be_switched_off() -> None:
    guard = Guard(GuardConfig(warmup=False, kv_high=False, p99=False, efficiency=False,
                              kv_budget=None))
    guard.reset(INFO)
    for t in range(1, 30):
        action, overrides = guard.check(PROPOSED, _stats(t, kv=0.99, tpot_p99=9.0,
                                                         recomputed=900))
        assert action.caps == PROPOSED.caps and not overrides
    assert DecisionPipeline(guard.config).discipline == AdmissionDiscipline("fifo", None)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_guard_keeps_random_policy_free_of_kv_overflow_on_scenarios(scenario: str) -> None:
    # 3x the scenario's load: well past saturation.
    workload = make_scenario(scenario, seed=0, duration_s=300, rate_scale=3.0)
    row = run(workload, make_controller("random:1"), DeploymentSpec(), drain_s=60).row
    assert row["kv_overflows"] == 0 and row["preemptions"] == 0
    assert row["completed"] + row["rejected"] + row["unfinished"] == len(workload)


@pytest.mark.parametrize("trace,model,rate", [("azure_conv_2023.csv", "llama-2-7b", 2.0),
                                              ("mooncake_synthetic.jsonl", "llama-3.1-8b", 1.0)])
def test_guard_keeps_random_policy_free_of_kv_overflow_on_traces(
        trace: str, model: str, rate: float, azure_trace: Path) -> None:
    workload = load_trace(azure_trace.parent / trace, rate_scale=rate, window_s=(0, 600))
    spec = DeploymentSpec(model=model)
    guarded = run(workload, make_controller("random:2"), spec, drain_s=60).row
    assert guarded["kv_overflows"] == 0
    unguarded = run(workload, make_controller("vllm-default"), spec, drain_s=60).row
    if trace.startswith("azure"):
        assert unguarded["kv_overflows"] > 0  # the load does overflow without the guard


class HoldThenRelease(GuardedController):
    """A policy that holds a total of 8 for the first 30 s of every 300 s and proposes 256
    the rest of the time, in deadline order: the queue it builds is released at once."""

    def __init__(self) -> None:
        super().__init__("hold-then-release", order="deadline")

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        n = len(self.info.buckets)
        held = stats is None or stats.time_s % 300 < 30
        return ControlAction((None,) * n, (balanced_route(self.info.pool_names),) * n,
                             8 if held else 256)


@pytest.mark.parametrize("forget_on_shift", [True, False])
def test_guard_keeps_a_held_queue_released_after_a_turn_to_longer_outputs_in_the_pool(
        forget_on_shift: bool) -> None:
    """Code completion (tens of output tokens) turns to chat (hundreds) every 300 s; the
    queue held through the turn enters at once, counted by outputs seen before it."""
    workload = resolve_workload("drift:families=code/chat,load=1,duration=1200,segment=300",
                                7002, rate_scale=1.2)
    spec = DeploymentSpec(sla=SLA(1.0, 0.05), kv_reserve_shift=forget_on_shift,
                          admission=AdmissionConfig(over_length="truncate"))
    row = run(workload, HoldThenRelease(), spec, drain_s=60).row
    if forget_on_shift:
        assert row["kv_overflows"] == 0 and row["preemptions"] == 0
    else:  # the run does outgrow the pool when the reserve keeps its whole window
        assert row["kv_overflows"] > 0


def test_p99_decrease_waits_for_the_window_to_show_its_effect() -> None:
    guard = Guard(GuardConfig(warmup=False, p99_cooldown_s=10, p99_fallback="halve"))
    guard.reset(INFO)
    caps = [guard.check(PROPOSED, _stats(t, tpot_p99=0.5, caps=(64,) * 4))[0].caps[0]
            for t in range(10, 31)]
    assert caps[0] == 32 and set(caps[1:10]) == {32}  # one decrease per 10 s of breach
    assert caps[10] == 16 and caps[20] == 8
