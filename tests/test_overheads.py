"""Engine overheads of calibrated profiles (issue 12, fidelity): what the simulator charges,
that event skipping stays exact with them, what the fit recovers, the live probe's counts, and
the fidelity scenarios' plumbing. No live engine."""

from __future__ import annotations

import itertools
import math
import types
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.vllm import IterationRecord
from rlbatch.engine.vllm.probe import SchedulerProbe, StepTimer
from rlbatch.engine.vllm.prompts import PromptTokens
from rlbatch.profiles import RooflineStepTimeModel, load_gpu, load_model
from rlbatch.profiles.calibrated import (
    CalibratedProfile,
    CalibratedStepTimeModel,
    FitReport,
    PoolProfile,
    StepCoefficients,
    WakeShape,
    profile_from_dict,
    shape_miss,
    wake_penalty_s,
)
from rlbatch.profiles.relative_error import RelativeErrors
from rlbatch.request import PREFIX_BLOCK_TOKENS, Request
from rlbatch.serving.builders import profile_sim_engine
from rlbatch.tools.calibrate_fit import fit_step_model, predict_durations
from rlbatch.tools.fidelity import FidelityReport, RunOutcome, _deployment, compare, replay
from rlbatch.tools.fidelity_outcomes import leveled, step_time_check
from rlbatch.tools.fidelity_scenarios import SCENARIOS, capacity, scenario_workload
from rlbatch.workload import conversations

OH = StepCoefficients(fixed_s=1e-3, prefill_fixed_s=2e-3, per_token_s=1e-5, per_seq_s=0.0,
                      per_attn_work_s=0.0, per_kv_token_s=0.0, per_kv_token_seq_s=0.0,
                      per_new_seq_s=4e-4, per_finished_s=3e-4, wake_s=2e-3,
                      new_shape_s=5e-3, new_shape_per_token_s=1e-6, first_shape_s=1.5e-3)
SHAPE = WakeShape(decay=0.5, tau_s=0.01)


def _profile(coefficients: StepCoefficients = OH, wake: WakeShape = SHAPE,
             blocks: int = 64) -> CalibratedProfile:
    errors = RelativeErrors(n=1, median=0.0, p90=0.0, p99=0.0, max=0.0, bias=0.0,
                            median_signed=0.0)
    fit = FitReport(rows=1, dropped=0, errors=errors, total_rel_err=0.0, measured_s=1.0)
    return CalibratedProfile(
        name="t", engine="vllm", model="tiny", device="cpu", vllm_version="0",
        block_size=32, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512,
        gpu_memory_total_bytes=2**30,
        pools={"fp16": PoolProfile(coefficients, blocks, "auto", fit, wake)})


def _run(engine: Any, requests: list[Request]) -> dict[int, FinishedRequest]:
    pending = list(requests)
    while pending or not engine.is_idle():
        while pending and pending[0].arrival_s <= engine.now_s:
            r = pending.pop(0)
            engine.add_request(r, 0, r.prompt_tokens, False)
        bound = pending[0].arrival_s if pending else math.inf
        if engine.is_idle():
            engine.advance_idle(bound)
        else:
            engine.step(bound)
    return {r.request_id: r for r in engine.snapshot().finished}


def test_wake_shape() -> None:
    assert SHAPE.iterations == 7  # 0.5 ** 6 = 0.0156 >= 0.01 > 0.5 ** 7
    assert WakeShape().iterations == 1 and WakeShape(0.9).iterations == 44
    assert SHAPE.scale(0.0) == 0.0 and SHAPE.scale(math.inf) == 1.0
    assert math.isclose(SHAPE.scale(0.01), 1 - math.exp(-1))
    assert wake_penalty_s(2e-3, SHAPE, math.inf, 2) == 5e-4
    assert wake_penalty_s(2e-3, SHAPE, math.inf, 7) == 0.0
    for bad in (dict(decay=1.0), dict(decay=-0.1), dict(tau_s=0.0)):
        with pytest.raises(ValueError):
            WakeShape(**bad)  # type: ignore[arg-type]


def test_overheads_exact_charges() -> None:
    """A cold engine, a request, an idle wait, then two at once: every iteration's charge."""
    engine = profile_sim_engine(_profile(), "fp16", 0, 1)
    a, b = Request(0, 0.0, 40, 3), Request(1, 0.05, 40, 2)
    c, d = Request(2, 0.2, 40, 3), Request(3, 0.2, 40, 2)
    done = _run(engine, [a, b, c, d])
    wake = [2e-3 * 0.5 ** k for k in range(7)]
    # A: the engine starts cold (the full wake-up); sizes 40 and 1 are new
    prefill40 = 1e-3 + 2e-3 + 40e-5 + 0.0  # fixed + prefill_fixed + tokens (+ per_seq 0)
    decode1 = 1e-3 + 1e-5
    t1 = prefill40 + 4e-4 + (5e-3 + 40e-6 + 1.5e-3) + wake[0]
    t2 = decode1 + (5e-3 + 1e-6 + 1.5e-3) + wake[1]
    t3 = decode1 + wake[2]
    assert math.isclose(done[0].ttft_s, t1, rel_tol=1e-12)
    assert math.isclose(done[0].e2e_s, t1 + t2 + t3, rel_tol=1e-12)
    # B: after an idle wait (which absorbs A's 0.3 ms of output processing), sizes known
    s = 1 - math.exp(-(0.05 - (t1 + t2 + t3)) / 0.01)
    b1 = prefill40 + 4e-4 + s * wake[0]
    assert math.isclose(done[1].ttft_s, b1, rel_tol=1e-12)
    assert math.isclose(done[1].e2e_s, b1 + decode1 + s * wake[1], rel_tol=1e-12)
    # C and D together: 80 tokens, two new requests; D finishes at the decode of 2, and its
    # processing lands in the next iteration (C decoding alone)
    s = 1 - math.exp(-(0.2 - (0.05 + done[1].e2e_s)) / 0.01)
    prefill80 = 1e-3 + 2e-3 + 80e-5
    c1 = prefill80 + 2 * 4e-4 + (5e-3 + 80e-6 + 1.5e-3) + s * wake[0]
    c2 = 1e-3 + 2e-5 + (5e-3 + 2e-6 + 1.5e-3) + s * wake[1]
    c3 = decode1 + 3e-4 + s * wake[2]
    assert math.isclose(done[2].ttft_s, c1, rel_tol=1e-12)
    assert math.isclose(done[3].e2e_s, c1 + c2, rel_tol=1e-12)
    assert math.isclose(done[2].e2e_s, c1 + c2 + c3, rel_tol=1e-12)


@pytest.mark.parametrize(("cache", "before", "charged"),
                         [(0, [40, 1, 7], False), (3, [40, 1, 7], False),
                          (2, [40, 1, 7], True), (2, [1, 7, 40], False)])
def test_primitive_cache_is_lru(cache: int, before: list[int], charged: bool) -> None:
    profile = _profile()
    profile = replace(profile, pools={"fp16": replace(profile.pools["fp16"], shape_cache=cache)})
    engine = profile_sim_engine(profile, "fp16", 0, 1)
    engine.assume_token_counts(before)
    done = _run(engine, [Request(0, 0.0, 40, 1)])
    base = 1e-3 + 2e-3 + 40e-5 + 4e-4 + 2e-3  # the prefill, one new request, a cold start
    assert math.isclose(done[0].ttft_s, base + (5e-3 + 40e-6 if charged else 0.0),
                        rel_tol=1e-12)
    fresh = profile_sim_engine(profile, "fp16", 0, 1)  # never run: the first build on top
    first = _run(fresh, [Request(0, 0.0, 40, 1)])
    assert math.isclose(first[0].ttft_s, base + 5e-3 + 40e-6 + 1.5e-3, rel_tol=1e-12)
    assert shape_miss(-1, 0) and not shape_miss(5, 0) and shape_miss(5, 5)


def test_without_overheads_nothing_is_added() -> None:
    batch = replace(OH, per_new_seq_s=0.0, per_finished_s=0.0, wake_s=0.0, new_shape_s=0.0,
                    new_shape_per_token_s=0.0, first_shape_s=0.0)
    assert CalibratedStepTimeModel(batch).overheads() is None
    roofline = RooflineStepTimeModel(load_gpu("a100-80g"), load_model("llama-2-7b"))
    assert roofline.overheads() is None  # the GPU profiles are untouched
    done = _run(profile_sim_engine(_profile(batch), "fp16", 0, 1), [Request(0, 0.0, 40, 3)])
    assert math.isclose(done[0].e2e_s, (1e-3 + 2e-3 + 40e-5) + 2 * (1e-3 + 1e-5),
                        rel_tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_event_skipping_stays_exact_with_overheads(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = 0.0
    requests = []
    for i in range(60):
        t += float(rng.exponential(0.01 if i % 20 else 0.3))  # bursts and idle gaps
        requests.append(Request(i, t, int(rng.integers(5, 300)), int(rng.integers(1, 60))))
    n = 4
    action = ControlAction(caps=(None,) * n, pools=("fp16",) * n)
    rows = []
    for skipping in (True, False):
        engine = profile_sim_engine(_profile(blocks=40), "fp16", 0, n, event_skipping=skipping)
        dep = _deployment([engine], Buckets((128, 256, 512)), 1024, 32, 512, 0.25)
        out = replay(dep, requests, action)
        rows.append(sorted(r.comparable() for r in out.records))
    assert rows[0] == rows[1] and len(rows[0]) == 60


def _synthetic_records(n: int = 3000, seed: int = 0, cache: int = 128) -> list[IterationRecord]:
    model = CalibratedStepTimeModel(OH, wake=SHAPE)
    rng = np.random.default_rng(seed)
    out: list[IterationRecord] = []
    t, since, idle = 0.0, 0, math.inf
    order: OrderedDict[int, None] = OrderedDict()
    for _ in range(n):
        if rng.random() < 0.03:
            since, idle = 0, float(rng.choice([0.001, 0.003, 0.01, 0.05]))
        prefill = 0 if rng.random() < 0.7 else int(rng.integers(1, 400))
        decode = int(rng.integers(0 if prefill else 1, 20))
        new = int(rng.integers(1, 3)) if prefill else 0
        fin = int(rng.integers(0, 2)) if decode else 0
        kv = decode * int(rng.integers(1, 500))
        size = prefill + decode
        keys = list(order)
        distance = len(keys) - 1 - keys.index(size) if size in order else -1
        order[size] = None
        order.move_to_end(size)
        dt = (model.step_time_s(prefill, 0.0, decode, kv) + 4e-4 * new + 3e-4 * fin
              + wake_penalty_s(2e-3, SHAPE, idle, since)
              + (5e-3 + 1e-6 * size if shape_miss(distance, cache) else 0.0)
              + (1.5e-3 if distance < 0 else 0.0))
        out.append(IterationRecord(t, t, t + dt, prefill, 0.0, decode, kv, 0, 1 if prefill
                                   else 0, new, fin, idle, since, distance))
        t += dt
        since += 1
    return out


def test_fit_recovers_overheads_and_the_wake_shape() -> None:
    records = _synthetic_records()
    fit = fit_step_model(records)
    assert fit.wake == SHAPE and fit.shape_cache == 128
    for got, want in zip(fit.coefficients.as_vector(), OH.as_vector(), strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-11)
    assert fit.report.errors.median < 1e-6
    batch = fit_step_model(records, terms="batch")
    assert batch.coefficients.wake_s == batch.coefficients.per_new_seq_s == 0.0
    assert batch.wake == WakeShape()
    with pytest.raises(ValueError, match="terms"):
        fit_step_model(records, terms="some")


def test_profile_versions_and_overheads_round_trip() -> None:
    data = _profile().to_dict()
    assert data["version"] == 3 and data["pools"]["fp16"]["wake"] == {"decay": 0.5,
                                                                      "tau_s": 0.01}
    assert data["pools"]["fp16"]["shape_cache"] == 0
    back = profile_from_dict(data)
    assert back == _profile()
    oh = back.step_time_model("fp16").overheads()
    assert oh is not None and oh.tracks_shapes and len(oh.wake) == 7
    old = dict(data, version=2)
    old["pools"] = {"fp16": {k: v for k, v in data["pools"]["fp16"].items()
                             if k not in ("wake", "shape_cache")}}
    old["pools"]["fp16"]["coefficients"] = {
        k: v for k, v in data["pools"]["fp16"]["coefficients"].items()
        if k not in ("per_new_seq_s", "per_finished_s", "wake_s", "new_shape_s",
                     "new_shape_per_token_s", "first_shape_s")}
    assert profile_from_dict(old).step_time_model("fp16").overheads() is None


def test_probe_counts_prefill_and_new_requests() -> None:
    probe = SchedulerProbe()
    reqs = {"a": types.SimpleNamespace(num_computed_tokens=11, num_tokens=11,
                                       num_output_tokens=1),  # decode
            "b": types.SimpleNamespace(num_computed_tokens=30, num_tokens=30,
                                       num_output_tokens=0),  # whole prompt, new
            "c": types.SimpleNamespace(num_computed_tokens=64, num_tokens=100,
                                       num_output_tokens=0)}  # a chunk, resumed
    out = types.SimpleNamespace(
        num_scheduled_tokens={"a": 1, "b": 30, "c": 64}, total_num_scheduled_tokens=95,
        scheduled_new_reqs=[object()],
        scheduled_cached_reqs=types.SimpleNamespace(resumed_req_ids={"c"}),
        preempted_req_ids=set())
    probe.observe(out, reqs)
    assert (probe.num_decode, probe.prefill_seqs, probe.new_seqs) == (1, 2, 2)
    assert probe.prefill_tokens == 94 and probe.first_token_ids == ["b"]


def test_step_timer_splits_phases() -> None:
    timer = StepTimer()
    owner = types.SimpleNamespace(run=lambda x: x + 1)
    timer.wrap(owner, "run", "forward")
    assert owner.run(1) == 2 and timer.forward_s > 0.0 and timer.schedule_s == 0.0
    timer.clear()
    assert timer.forward_s == 0.0
    with pytest.raises(ValueError, match="phase"):
        timer.wrap(owner, "run", "other")


def test_prompt_tokens_share_what_prefix_ids_share() -> None:
    pool = list(range(1000, 1000 + 4096))
    prompts = PromptTokens(pool, 2048, seed=0)
    b = PREFIX_BLOCK_TOKENS
    first = prompts.for_request(Request(0, 0.0, 700, 4, prefix_ids=(0, 11)), 700)
    later = prompts.for_request(Request(1, 0.0, 1200, 4, prefix_ids=(0, 11, 12)), 1200)
    other = prompts.for_request(Request(2, 0.0, 700, 4, prefix_ids=(0, 21)), 700)
    assert len(first) == 700 and len(later) == 1200
    assert later[:700] == first  # the history is the same tokens
    assert other[:b] == first[:b] and other[b] != first[b]  # only the system block shared
    cut = prompts.for_request(Request(1, 0.0, 1200, 4, prefix_ids=(0, 11, 12)), 300)
    assert cut == later[-300:]  # a truncated prompt keeps its last tokens
    assert prompts.for_request(Request(3, 0.0, 50, 4), 50) == prompts.by_id(3, 50)
    tail = prompts.for_request(Request(4, 0.0, 600, 4, prefix_ids=(0,)), 600)
    assert tail[:b] == first[:b] and tail[b:] == prompts.by_id(4, 600 - b)


def test_conversations_share_their_history() -> None:
    w = conversations(0.5, 30.0, max_model_len=2048, seed=3)
    by_chain: dict[int, list[Request]] = {}
    for r in w.requests:
        assert r.prefix_ids is not None and r.prefix_ids[0] == 0
        assert len(r.prefix_ids) == -(-r.prompt_tokens // PREFIX_BLOCK_TOKENS)
        assert r.prompt_tokens + r.max_output_tokens <= 2048
        if len(r.prefix_ids) > 1:
            by_chain.setdefault(r.prefix_ids[1], []).append(r)
    turns = max(by_chain.values(), key=len)
    assert len(turns) >= 3
    for a, b in itertools.pairwise(turns):  # each turn extends the one before
        assert b.arrival_s > a.arrival_s and b.prompt_tokens > a.prompt_tokens
        assert b.prefix_ids[:len(a.prefix_ids)] == a.prefix_ids  # type: ignore[index]
    with pytest.raises(ValueError):
        conversations(1.0, 10.0, max_model_len=600)


def _stub_engine() -> Any:
    return types.SimpleNamespace(max_model_len=2048, configured_max_num_seqs=32,
                                 num_kv_blocks=2048, block_size=32, pool="fp16",
                                 config=types.SimpleNamespace(max_num_batched_tokens=2048,
                                                              enable_prefix_caching=True))


def test_scenarios_scale_with_the_simulated_capacity() -> None:
    profile = replace(_profile(), max_model_len=2048, max_num_batched_tokens=2048)
    engine = _stub_engine()
    light = SCENARIOS["light"]
    cap = capacity(profile, engine, light)
    assert cap > 0
    w = scenario_workload(light, light.load * cap, 2048, seed=1)
    rate = len(w.requests) / light.duration_s
    assert 0.5 * light.load * cap < rate < 1.5 * light.load * cap
    assert w.name == "light" and all(r.prompt_tokens + r.max_output_tokens <= 2048
                                     for r in w.requests)
    shared = SCENARIOS["shared-prefix"]
    assert shared.prefix_caching and capacity(profile, engine, shared) > 0
    assert all(r.prefix_ids for r in scenario_workload(shared, 0.5, 2048).requests)


def _outcome(e2e: list[float], makespan: float = 1.0) -> RunOutcome:
    records = [FinishedRequest(i, 0, "fp16", 0.0, 10, 5, v / 4, v / 8, v, v, 0, False)
               for i, v in enumerate(e2e)]
    return RunOutcome(records, 0, makespan, 5 * len(e2e), 0.0)


def test_compare_pools_runs_and_floor_targets() -> None:
    live = [_outcome([1.0, 2.0, 4.0]), _outcome([1.2, 2.0, 4.0])]
    sim = [_outcome([1.1, 2.0, 4.0]), _outcome([1.1, 2.0, 4.0])]
    rep = compare("w", "fp16", 3, live, sim)
    assert rep.e2e.n == 6 and rep.throughput_rel_err == 0.0
    assert rep.floor_targets() is None
    floor = compare("w", "fp16", 3, live[0], live[1])
    rep = replace(rep, ttft_floor=floor.ttft, e2e_floor=floor.e2e)
    met = rep.floor_targets()
    assert met is not None and met["e2e_median"] and met["bias"] and met["throughput"]
    worse = replace(rep, e2e=replace(rep.e2e, median=0.3, median_signed=0.3))
    assert worse.floor_targets() == {"ttft_median": True, "e2e_median": False, "bias": False,
                                     "throughput": True}
    assert isinstance(rep, FidelityReport) and rep.to_row()["floor_targets_met"] is not None
    with pytest.raises(ValueError, match="as many"):
        compare("w", "fp16", 3, live, sim[:1])


def test_predict_durations_and_leveled_carry_every_overhead() -> None:
    records = _synthetic_records()
    durations = np.array([r.duration_s for r in records])
    fit = fit_step_model(records)
    assert fit.coefficients.wake_s > 0 and fit.shape_cache == 128
    assert np.allclose(predict_durations(records, fit.coefficients, fit.wake, fit.shape_cache),
                       durations, rtol=1e-4)
    # the wake-up's shape and the primitive cache's size both matter to the charge
    assert not np.allclose(predict_durations(records, fit.coefficients, WakeShape(),
                                             fit.shape_cache), durations, rtol=1e-4)
    assert not np.allclose(predict_durations(records, fit.coefficients, fit.wake, 0),
                           durations, rtol=1e-4)
    profile = _profile(fit.coefficients, fit.wake)
    profile = replace(profile, pools={"fp16": replace(profile.pools["fp16"],
                                                      shape_cache=fit.shape_cache)})
    slow = [replace(r, end_s=r.prev_end_s + 1.5 * r.duration_s) for r in records]
    check = step_time_check(profile, "fp16", slow)
    assert check is not None and math.isclose(check.time_ratio, 1 / 1.5, rel_tol=1e-4)
    level = leveled(profile, "fp16", slow)
    assert level is not None
    check = step_time_check(level, "fp16", slow)
    # every term scaled: each iteration charged what it took, not only the total
    assert check is not None and math.isclose(check.time_ratio, 1.0, rel_tol=1e-4)
    assert abs(check.median_bias) < 1e-4
