"""The TPOT fit's largest total, the traffic it reads, and the guard's ``tpot_fit`` rule."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import pytest

from rlbatch.control.controllers import make_controller
from rlbatch.control.guard import Guard, GuardConfig
from rlbatch.control.guard_record import guard_from_record, guard_record, record_mismatch
from rlbatch.control.stats_metrics import MetricContext, guard_readings, tensorboard_scalars
from rlbatch.control.tpot_fit import (
    FitCalibration,
    TpotFit,
    TrafficMeans,
    quantised_slowdown,
    spread_slowdown,
)
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.engine.stats import FinishedRequest
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.builders import build_sim_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.families import family_workload
from tests.factories import BUCKETS, deployment_stats, engine_stats


def _info(tpot_s: float = 0.05, gpu: str = "a100-80g") -> DeploymentInfo:
    return DeploymentInfo(buckets=BUCKETS, pools={"fp16": 1}, gpu=gpu, model="llama-2-7b",
                          default_max_num_seqs=256, max_num_batched_tokens=2048,
                          num_kv_blocks={"fp16": 4096}, block_size=16, max_model_len=4096,
                          tick_s=1.0, sla=SLA(ttft_s=1.0, tpot_s=tpot_s), capacity_rps=4.0)


def _finished(prompt: int, output: int, n: int) -> tuple[FinishedRequest, ...]:
    return tuple(FinishedRequest(request_id=i, bucket=2, pool="fp16", arrival_s=0.0,
                                 prompt_tokens=prompt, output_tokens=output, ttft_s=0.5,
                                 tpot_s=0.04, e2e_s=5.0, finish_s=1.0) for i in range(n))


def _long_context_tick(t: float) -> DeploymentStats:
    """A tick of RAG-like traffic: 3000-token prompts, 200-token answers, 600 prompt tokens a
    second to compute."""
    engine = engine_stats(prefill=600, decode=400, finished=_finished(3000, 200, 2))
    return replace(deployment_stats((engine,)), time_s=t,
                   action=ControlAction((None,) * 3, ("fp16",) * 3, 256))


@pytest.mark.parametrize("prefill, prompt, output", [
    (0.0, 1000.0, 300.0), (600.0, 3000.0, 200.0), (8000.0, 2000.0, 30.0), (0.0, 200.0, 50.0)])
def test_largest_total_is_the_largest_that_meets_the_limit(prefill: float, prompt: float,
                                                           output: float) -> None:
    fit = TpotFit.for_deployment(_info(0.05))
    largest = fit.largest_total(prefill, prompt, output, 256)
    meets = [fit.tpot_s_at(n, prefill, prompt, output) <= 0.05 for n in range(1, 257)]
    assert meets == sorted(meets, reverse=True)  # the time grows with the total
    assert largest == sum(meets)


def test_largest_total_ends() -> None:
    assert TpotFit.for_deployment(_info(1e-4)).largest_total(0.0, 1000.0, 300.0, 256) == 0
    assert TpotFit.for_deployment(_info(10.0)).largest_total(0.0, 1000.0, 300.0, 256) == 256
    assert TpotFit.for_deployment(_info(10.0)).largest_total(0.0, 1000.0, 300.0, 0) == 0
    # the margin: a lower limit holds fewer
    tight = TpotFit.for_deployment(_info(0.05), tpot_s=0.045)
    assert 0 < tight.largest_total(600.0, 3000.0, 200.0, 256) < TpotFit.for_deployment(
        _info(0.05)).largest_total(600.0, 3000.0, 200.0, 256)


def test_traffic_means_smooth_and_start_at_the_reference_lengths() -> None:
    means = TrafficMeans(tau_s=30.0)
    assert means.fit_inputs() == (0.0, 1024.0, 256.0)
    for _ in range(200):
        means.update(_long_context_tick(1.0), 1.0)
    prefill, prompt, output = means.fit_inputs(engines=2)
    assert prefill == pytest.approx(300.0 * (1 - math.exp(-200 / 30)))
    assert prompt == pytest.approx(3000.0)
    assert output == pytest.approx(200.0)
    means.reset()
    assert means.fit_inputs() == (0.0, 1024.0, 256.0)
    one = TrafficMeans(tau_s=30.0)
    one.update(_long_context_tick(1.0), 1.0)
    assert one.prefill_per_s == pytest.approx(600.0 * (1 - math.exp(-1 / 30)))


def test_the_rule_holds_the_total_at_the_largest_that_fits() -> None:
    guard = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True,
                              tpot_fit_calibrated=False, tpot_fit_spread=0.0))
    guard.reset(_info(0.05))
    proposal = ControlAction((None,) * 3, ("fp16",) * 3, 256)
    for t in range(1, 120):
        action, overrides = guard.check(proposal, _long_context_tick(float(t)))
    fit = TpotFit.for_deployment(_info(0.05), tpot_s=0.05 * GuardConfig().tpot_fit_margin)
    means = TrafficMeans()
    for _ in range(119):
        means.update(_long_context_tick(1.0), 1.0)
    largest = fit.largest_total(*means.fit_inputs(), 256)
    assert 8 < largest < 256
    assert action.max_num_seqs == largest and guard.state.tpot_fit_total == largest
    assert [(o.rule, o.before, o.after) for o in overrides if o.bucket is None] == [
        ("tpot_fit", 256, largest)]
    assert action.caps == (largest,) * 3  # uncapped buckets go through admission at the total
    assert all(o.bucket is None for o in overrides if o.rule == "tpot_fit")  # the total binds
    # without a total, each bucket's cap is held (the only lever then)
    caps_only, overrides = guard.check(ControlAction((64, None, 8), ("fp16",) * 3),
                                       _long_context_tick(120.0))
    assert caps_only.max_num_seqs is None
    assert caps_only.caps == (largest, largest, 8)
    assert {(o.bucket, o.after) for o in overrides if o.rule == "tpot_fit"} == {
        (0, largest), (1, largest)}
    # a copy (mpc's candidate pipelines) shares the fit and its memo, not the traffic read
    twin = copy.deepcopy(guard)
    assert twin._tpot_fits["fp16"] is guard._tpot_fits["fp16"]
    assert twin._traffic is not guard._traffic
    assert twin._calibrations["fp16"] is not guard._calibrations["fp16"]
    twin.check(proposal, _long_context_tick(121.0))
    assert twin._traffic.prefill_per_s > guard._traffic.prefill_per_s  # one tick more read
    # a smaller proposal is left alone
    smaller, overrides = guard.check(replace(proposal, max_num_seqs=4), _long_context_tick(120.0))
    assert smaller.max_num_seqs == 4 and not [o for o in overrides if o.rule == "tpot_fit"]


def _two_pool_tick(t: float, in_force: ControlAction) -> DeploymentStats:
    """The long-context tick on an FP16 and an FP8 engine, each with half the traffic."""
    base = _long_context_tick(t)
    fp16 = base.engines[0]
    fp8 = replace(fp16, engine_id=1, pool="fp8")
    return replace(base, engines=(fp16, fp8), action=in_force)


@pytest.mark.parametrize("per_pool", [True, False])
def test_two_pools_get_a_ceiling_each_from_their_precision(per_pool: bool) -> None:
    """The total is the largest ceiling of any pool; the others' are lowered per pool, and
    admission runs each engine at its own (an FP8 engine fits a bigger batch)."""
    info = replace(_info(0.05), pools={"fp16": 1, "fp8": 1},
                   num_kv_blocks={"fp16": 4096, "fp8": 8192})
    guard = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True, tpot_fit_calibrated=False,
                              tpot_fit_spread=0.0, tpot_fit_per_pool=per_pool))
    guard.reset(info)
    proposal = ControlAction((None,) * 3, ("any",) * 3, 256)
    action = proposal
    for t in range(1, 120):
        action, _ = guard.check(proposal, _two_pool_tick(float(t), action))
    margin = GuardConfig().tpot_fit_margin
    means = TrafficMeans()
    for _ in range(119):
        means.update(_two_pool_tick(1.0, proposal), 1.0)
    inputs = means.fit_inputs(engines=2)
    fp16, fp8 = (TpotFit.for_deployment(info, 0.05 * margin, pool).largest_total(*inputs, 256)
                 for pool in ("fp16", "fp8"))
    assert 8 < fp16 < fp8 < 256
    if per_pool:
        assert action.max_num_seqs == fp8 and action.pool_max_num_seqs == (("fp16", fp16),)
        assert guard.state.tpot_fit_pool_totals == (("fp16", fp16),)
    else:  # the first pool's ceiling caps both engines
        assert action.max_num_seqs == fp16 and action.pool_max_num_seqs == ()
    # a proposal under both ceilings is left alone, and so is each engine
    small, _ = guard.check(replace(proposal, max_num_seqs=4), _two_pool_tick(120.0, action))
    assert small.max_num_seqs == 4 and small.pool_max_num_seqs == ()
    # admission runs each engine at its pool's cap
    deployment = build_sim_deployment(DeploymentSpec(pools={"fp16": 1, "fp8": 1}))
    n = len(deployment.info.buckets)
    deployment.admission.apply(replace(action, caps=(None,) * n, pools=("any",) * n))
    assert [(e.pool, e.max_num_seqs) for e in deployment.admission.engines] == [
        ("fp16", fp16 if per_pool else action.max_num_seqs), ("fp8", action.max_num_seqs)]


def test_pool_caps_need_a_total_and_a_known_pool() -> None:
    with pytest.raises(ValueError, match="needs a max_num_seqs"):
        ControlAction((None,), ("fp16",), None, (("fp16", 8),))
    with pytest.raises(ValueError, match="each pool once"):
        ControlAction((None,), ("fp16",), 16, (("fp16", 8), ("fp16", 4)))
    with pytest.raises(ValueError, match="each pool once"):
        ControlAction((None,), ("fp16",), 16, (("fp16", 0),))


def test_halvings_scale_the_limit_as_it_stood_before_the_ceiling() -> None:
    """kv_high halves what was in force before the ``tpot_fit`` ceiling, so the two do not
    compound; an action in force that the guard did not give out is scaled as it is."""
    guard = Guard(GuardConfig(warmup=False, p99=False, efficiency=False, tpot_fit=True,
                              tpot_fit_calibrated=False, tpot_fit_spread=0.0))
    guard.reset(_info(0.05))
    proposal = ControlAction((None,) * 3, ("fp16",) * 3, 256)

    def tick(t: float, kv: float, in_force: ControlAction) -> DeploymentStats:
        base = _long_context_tick(t)
        return replace(base, engines=(replace(base.engines[0], kv_cache_usage=kv),),
                       action=in_force)

    in_force = proposal
    for t in range(1, 120):
        in_force, _ = guard.check(proposal, tick(float(t), 0.5, in_force))
    largest = guard.state.tpot_fit_total
    assert largest is not None and 8 < largest < 128 and in_force.max_num_seqs == largest
    assert guard.state.ceiling_lowered == ((largest,) * 3, largest, (256,) * 3, 256)
    for t in range(120, 132):  # KV over the threshold for the rule's 10 s: one halving
        in_force, overrides = guard.check(proposal, tick(float(t), 0.9, in_force))
    assert guard.state.kv_high_total == 128  # 256 halved, not the ceiling's total
    assert in_force.max_num_seqs == largest  # the ceiling, lower, binds
    assert [o.after for o in overrides if o.rule == "kv_high" and o.bucket is None] == [128]
    # another action in force (not what the guard gave out) is halved as it stands
    guard.reset(_info(0.05))
    other = replace(proposal, caps=(40,) * 3, max_num_seqs=40)
    for t in range(1, 12):
        action, _ = guard.check(proposal, tick(float(t), 0.9, other))
    assert guard.state.kv_high_total == 20 and action.max_num_seqs == 20


def _running_tick(t: float, running: int, iterations: int, busy_s: float) -> DeploymentStats:
    """A long-context tick whose engine ran ``running`` sequences in ``iterations`` iterations
    of ``busy_s`` seconds in all."""
    tick = _long_context_tick(t)
    engine = replace(tick.engines[0], running=(0, 0, running), iterations=iterations,
                     busy_s=busy_s)
    return replace(tick, engines=(engine,))


def test_the_calibration_reads_how_much_slower_the_iterations_run() -> None:
    fit = TpotFit.for_deployment(_info(0.05))
    means = TrafficMeans()
    calibration = FitCalibration(tau_s=30.0)
    assert calibration.slowdown == 1.0
    for t in range(1, 200):
        means.update(_long_context_tick(float(t)), 1.0)
        predicted = fit.tpot_s_at(24, *means.fit_inputs())
        calibration.update(fit, _running_tick(float(t), 24, 10, 10 * 1.5 * predicted),
                           means.fit_inputs(), 1.0)
    # log 1.5 smoothed over 199 ticks (0.9987 of it), in 2% steps: exp(20 x 0.02)
    assert calibration.log_ratio == pytest.approx(math.log(1.5) * (1 - math.exp(-199 / 30)))
    assert calibration.slowdown == round(math.exp(0.4), 6)
    before = calibration.log_ratio  # a tick without an iteration or a sequence leaves it
    calibration.update(fit, _running_tick(200.0, 24, 0, 0.0), means.fit_inputs(), 1.0)
    calibration.update(fit, _running_tick(200.0, 0, 10, 1.0), means.fit_inputs(), 1.0)
    assert calibration.log_ratio == before
    for t in range(400):  # one engine 100x slower: clipped to the range's end
        calibration.update(fit, _running_tick(float(t), 24, 1, 100.0), means.fit_inputs(),
                           1.0)
    assert calibration.slowdown == round(math.exp(69 * 0.02), 6)  # log 4 / 0.02 = 69.3
    calibration.reset()
    assert calibration.slowdown == 1.0 and calibration.log_ratio == 0.0
    # two engines: the mean of their log ratios, or one pool's only (the fit models one)
    tick = _running_tick(1.0, 24, 10, 1.0)
    predicted = fit.tpot_s_at(24, *means.fit_inputs(2))
    fp16 = replace(tick.engines[0], busy_s=10 * 2.0 * predicted)
    fp8 = replace(tick.engines[0], engine_id=1, pool="fp8", busy_s=10 * 0.5 * predicted)
    both = replace(tick, engines=(fp16, fp8))
    for pool, log_ratio in ((None, 0.0), ("fp16", math.log(2.0)), ("fp8", math.log(0.5))):
        one = FitCalibration(tau_s=30.0)
        one.update(fit, both, means.fit_inputs(2), 1.0, pool)
        assert one.log_ratio == pytest.approx(log_ratio * (1 - math.exp(-1 / 30)), abs=1e-12)


def test_the_calibrated_rule_holds_less_where_the_engine_runs_slower_than_the_fit() -> None:
    proposal = ControlAction((None,) * 3, ("fp16",) * 3, 256)
    totals: dict[bool, int | None] = {}
    slowdowns: dict[bool, float] = {}
    for calibrated in (False, True):
        guard = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True,
                                  tpot_fit_calibrated=calibrated, tpot_fit_spread=0.0))
        guard.reset(_info(0.05))
        means = TrafficMeans()
        for t in range(1, 120):  # 24 running at 100 ms an iteration: slower than predicted
            tick = _running_tick(float(t), 24, 10, 1.0)
            action, _ = guard.check(proposal, tick)
            means.update(tick, 1.0)
        fit = TpotFit.for_deployment(_info(0.05), tpot_s=0.05 * GuardConfig().tpot_fit_margin)
        slowdown = guard.state.tpot_fit_slowdown
        assert (slowdown > 1.5) if calibrated else (slowdown == 1.0)
        assert action.max_num_seqs == fit.largest_total(*means.fit_inputs(), 256, slowdown)
        totals[calibrated], slowdowns[calibrated] = action.max_num_seqs, slowdown
    assert totals[True] is not None and totals[False] is not None
    assert 0 < totals[True] < totals[False]
    # with the spread too: the two slowdowns multiply (200-token outputs)
    guard = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True, tpot_fit_spread=2.0))
    guard.reset(_info(0.05))
    for t in range(1, 120):
        guard.check(proposal, _running_tick(float(t), 24, 10, 1.0))
    assert guard.state.tpot_fit_slowdown == quantised_slowdown(
        slowdowns[True] * spread_slowdown(200.0, 2.0))
    guard.reset(_info(0.05))  # a new run forgets the engine's speed
    assert guard._calibrations["fp16"].log_ratio == 0.0 and guard.state.tpot_fit_slowdown == 1.0


def test_the_spread_allowance_shrinks_with_the_output_length() -> None:
    assert spread_slowdown(450.0, 0.0) == 1.0
    assert spread_slowdown(100.0, 1.0) == pytest.approx(1 / 0.9)
    assert spread_slowdown(400.0, 1.0) == pytest.approx(1 / 0.95)
    assert spread_slowdown(1.0, 2.0) == 4.0 == spread_slowdown(0.0, 1.0)  # at most 4
    assert quantised_slowdown(1 / 0.9) == round(math.exp(5 * 0.02), 6)  # log 1.11 / 0.02 = 5.3
    proposal = ControlAction((None,) * 3, ("fp16",) * 3, 256)
    totals = {}
    for spread in (0.0, 2.0):  # 200-token outputs: 1 / (1 - 2 / 14.1), 1.16 in 2% steps
        guard = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True,
                                  tpot_fit_calibrated=False, tpot_fit_spread=spread))
        guard.reset(_info(0.05))
        means = TrafficMeans()
        for t in range(1, 60):
            action, _ = guard.check(proposal, _long_context_tick(float(t)))
            means.update(_long_context_tick(float(t)), 1.0)
        slowdown = guard.state.tpot_fit_slowdown
        assert slowdown == quantised_slowdown(spread_slowdown(200.0, spread))
        fit = TpotFit.for_deployment(_info(0.05), tpot_s=0.05 * GuardConfig().tpot_fit_margin)
        assert action.max_num_seqs == fit.largest_total(*means.fit_inputs(), 256, slowdown)
        totals[spread] = action.max_num_seqs
    assert slowdown == round(math.exp(8 * 0.02), 6)
    assert totals[2.0] is not None and totals[0.0] is not None and totals[2.0] < totals[0.0]
    for bad in (-0.1, 11.0, math.nan):
        with pytest.raises(ValueError, match="tpot_fit_spread"):
            GuardConfig(tpot_fit_spread=bad)


def test_the_rule_is_off_by_default_and_holds_nothing_when_nothing_fits() -> None:
    proposal = ControlAction((None,) * 3, ("fp16",) * 3, 256)
    off = Guard(GuardConfig(warmup=False, p99=False))
    off.reset(_info(0.05))
    hopeless = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True))
    hopeless.reset(_info(1e-4))  # not even one sequence decodes in 0.1 ms
    for guard in (off, hopeless):
        for t in range(1, 60):
            action, overrides = guard.check(proposal, _long_context_tick(float(t)))
            assert action.max_num_seqs == 256 and not overrides
        assert guard.state.tpot_fit_total is None


def test_the_rule_needs_real_profiles_and_a_valid_margin() -> None:
    Guard(GuardConfig(tpot_fit=False)).reset(_info(gpu="no-such-gpu"))  # off: not needed
    with pytest.raises(ValueError, match="predicts TPOT from the deployment's GPU and model"):
        Guard(GuardConfig(tpot_fit=True)).reset(_info(gpu="no-such-gpu"))
    for margin in (0.0, -1.0, 2.5, math.nan):
        with pytest.raises(ValueError, match="tpot_fit_margin"):
            GuardConfig(tpot_fit_margin=margin)


def test_a_record_without_the_rule_warns_when_it_is_on() -> None:
    old = guard_record(GuardConfig())
    del old["tpot_fit"], old["tpot_fit_margin"]  # written before the rule existed
    del old["tpot_fit_calibrated"], old["tpot_fit_spread"]
    assert record_mismatch(old, GuardConfig()) == []
    assert guard_from_record(old) == GuardConfig()  # settings of a rule that never acted
    assert record_mismatch(old, GuardConfig(tpot_fit=True)) == [
        "tpot_fit: False recorded, True in force"]
    # written behind the rule before its calibration and spread: rebuilt without them
    trained = {**old, "tpot_fit": True, "tpot_fit_margin": 0.85}
    assert guard_from_record(trained) == GuardConfig(
        tpot_fit=True, tpot_fit_margin=0.85, tpot_fit_calibrated=False, tpot_fit_spread=0.0)
    assert record_mismatch(trained, guard_from_record(trained)) == []
    assert record_mismatch(trained, GuardConfig(tpot_fit=True, tpot_fit_margin=0.85)) == [
        "tpot_fit_calibrated: False recorded, True in force",
        "tpot_fit_spread: 0.0 recorded, 2.5 in force"]
    # trained with the rule off: its recorded settings never acted and give way to today's
    off = {**guard_record(GuardConfig()), "tpot_fit_margin": 0.85, "tpot_fit_spread": 0.0}
    assert guard_from_record(off) == GuardConfig()
    assert record_mismatch(off, GuardConfig()) == []
    assert record_mismatch(off, GuardConfig(tpot_fit=True)) == [
        "tpot_fit: False recorded, True in force",
        "tpot_fit_margin: 0.85 recorded, 1.05 in force",
        "tpot_fit_spread: 0.0 recorded, 2.5 in force"]


def test_the_rule_shrinks_a_big_batch_of_long_contexts_in_a_run() -> None:
    """RAG at 1 s / 50 ms: the guarded constant runs every sequence it can (40 of them at the
    median) and misses the TPOT; with the rule the total in force stays under that, at the
    fit's edge, and more requests meet the SLA."""
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"),
                          sla=SLA(1.0, 0.05))
    workload = family_workload("rag", 1.0, 300.0, 11)
    seen: dict[str, tuple[list[int], list[int]]] = {}
    goodput: dict[str, float] = {}
    for name in ("fixed:256[order=deadline]",
                 "fixed:256[order=deadline,guard.tpot_fit=true]"):
        totals: list[int] = []
        running: list[int] = []

        def on_tick(stats: DeploymentStats, totals: list[int] = totals,
                    running: list[int] = running) -> None:
            totals.append(stats.action.max_num_seqs or 0)
            running.append(stats.running_total)

        result = run(workload, make_controller(name), spec, on_tick=on_tick)
        seen[name] = (totals, running)
        goodput[name] = float(result.row["goodput_rps"])

    def median(xs: list[int]) -> int:
        return sorted(xs)[len(xs) // 2]

    plain, held = seen["fixed:256[order=deadline]"], seen[
        "fixed:256[order=deadline,guard.tpot_fit=true]"]
    assert median(plain[0]) == 256
    assert 16 < median(held[0]) < median(plain[1])
    assert max(held[1][60:]) <= max(held[0][59:])  # the engine runs within the total
    assert goodput["fixed:256[order=deadline,guard.tpot_fit=true]"] > goodput[
        "fixed:256[order=deadline]"]


def test_a_recipe_with_the_rule_puts_teacher_student_and_env_behind_it(tmp_path: Path) -> None:
    from policies.artifact import copy_artifact
    from policies.ppo import PpoController
    from policies.training.command import _recipe_config, parse_args
    from policies.training.finetune import recipe_env_kwargs
    from policies.training.recipe import RecipeConfig, make_labeller

    cfg = _recipe_config(parse_args(["--train-deployments", "none"]), ())  # on by default
    assert cfg.tpot_fit and not _recipe_config(
        parse_args(["--no-tpot-fit", "--train-deployments", "none"]), ()).tpot_fit
    codec = cfg.student_codec()
    assert cfg.teacher_spec() == "mpc[guard.tpot_fit=true]"
    assert replace(cfg, teacher="mpc[trims=false]").teacher_spec() == (
        "mpc[trims=false,guard.tpot_fit=true]")
    assert replace(cfg, teacher="mpc[]").teacher_spec() == "mpc[guard.tpot_fit=true]"
    assert replace(cfg, tpot_fit=False).teacher_spec() == "mpc"
    with pytest.raises(ValueError, match="settings file"):
        replace(cfg, teacher="teacher.toml").teacher_spec()
    teacher = make_labeller(cfg, codec).in_charge
    assert teacher.pipeline is not None and teacher.pipeline.config.tpot_fit
    guard = cfg.student_guard(codec)
    assert guard.tpot_fit and guard.ladder == tuple(codec.totals)
    assert not RecipeConfig(traces=(), tpot_fit=False).student_guard(codec).tpot_fit
    env = recipe_env_kwargs("a100-80g", "llama-2-7b", "fp16", 60.0, 7, 5, guard=guard)
    assert env["guard"] == guard
    # the artifact records the guard, and ppo:PATH serves behind the recorded one
    student = copy_artifact(Path("policies/default"), tmp_path / "student",
                            {"guard": guard_record(guard)})
    served = make_controller(f"ppo:{student}")
    assert isinstance(served, PpoController) and served.guard.config.tpot_fit
    assert served.guard_warnings == []


def test_the_guard_readings_report_the_rules_ceiling_and_slowdown() -> None:
    # What the sidecar's gauges and TensorBoard show: NaN without the rule, the rule's state
    # with it.
    assert all(math.isnan(v) for v in guard_readings(None).values())
    off = Guard(GuardConfig(warmup=False))
    off.reset(_info(0.05))
    off.check(ControlAction((None,) * 3, ("fp16",) * 3, 256), _long_context_tick(1.0))
    assert all(math.isnan(v) for v in guard_readings(off).values())
    guard = Guard(GuardConfig(warmup=False, p99=False, tpot_fit=True))
    guard.reset(_info(0.05))
    for t in range(1, 60):
        guard.check(ControlAction((None,) * 3, ("fp16",) * 3, 256), _long_context_tick(float(t)))
    readings = guard_readings(guard)
    assert guard.state.tpot_fit_total is not None and 8 < guard.state.tpot_fit_total < 256
    assert readings == {"tpot_fit_ceiling": float(guard.state.tpot_fit_total),
                        "tpot_fit_slowdown": guard.state.tpot_fit_slowdown}
    # 200-token answers: the spread alone is 1 / (1 - 2.5 / sqrt(200)) ~ 1.21
    assert readings["tpot_fit_slowdown"] != 1.0
    ctx = MetricContext(BUCKETS.names, ("fp16",), **readings)
    scalars = tensorboard_scalars(_long_context_tick(60.0), ctx)
    assert scalars["guard/tpot_fit_ceiling"] == readings["tpot_fit_ceiling"]
    assert scalars["guard/tpot_fit_slowdown"] == readings["tpot_fit_slowdown"]


def test_the_env_reports_the_rules_readings_in_its_step_info() -> None:
    import envs

    env = gym.make(envs.ENV_ID, scenario="mixed", episode_s=60.0,
                   guard=GuardConfig(warmup=False, tpot_fit=True))
    env.reset(seed=0)
    infos = [env.step(env.action_space.sample())[4] for _ in range(20)]
    assert all(math.isfinite(i["guard_readings"]["tpot_fit_slowdown"]) for i in infos)
    assert any(math.isfinite(i["guard_readings"].get("tpot_fit_ceiling", math.nan))
               for i in infos)
    env = gym.make(envs.ENV_ID, scenario="mixed", episode_s=60.0)  # the rule off: none
    env.reset(seed=0)
    assert env.step(env.action_space.sample())[4]["guard_readings"] == {}
