"""ObservationBuilder: shape, bounds and the meaning of single features."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.control.observation import (
    CLIP,
    GLOBAL_FEATURES,
    PER_BUCKET_FEATURES,
    PREFIX_GLOBAL_FEATURES,
    TPOT_FIT_GLOBAL_FEATURES,
    TRAFFIC_GLOBAL_FEATURES,
    ObservationBuilder,
    feature_names,
    observation_size,
)
from rlbatch.control.tpot_fit import TPOT_FIT_LADDER, TpotFit
from rlbatch.control.types import SLA, DeploymentInfo, DeploymentStats
from tests.factories import (
    BUCKETS,
    deployment_stats,
    engine_stats,
    random_deployment_stats,
    record,
)

INFO = DeploymentInfo(buckets=BUCKETS, pools={"fp16": 1, "fp8": 1}, gpu="g", model="m",
                      default_max_num_seqs=8, max_num_batched_tokens=256,
                      num_kv_blocks={"fp16": 64, "fp8": 64}, block_size=16,
                      max_model_len=512, tick_s=1.0, sla=SLA())
BUILDER = ObservationBuilder(INFO, max_cap=64)
G = len(BUCKETS) * len(PER_BUCKET_FEATURES)


def _feature(obs: np.ndarray, name: str) -> float:
    return float(obs[feature_names(BUCKETS.names).index(name)])


@settings(max_examples=80, deadline=None)
@given(stats=random_deployment_stats(),
       flags=st.tuples(*(st.sampled_from((0.0, 1.0)),) * 5))
def test_observation_is_finite_bounded_and_sized(stats: DeploymentStats,
                                                 flags: tuple[float, ...]) -> None:
    obs = BUILDER.build(stats, flags)
    assert obs.shape == (observation_size(len(BUCKETS)),) == (BUILDER.size,)
    assert obs.dtype == np.float32
    assert np.all(np.isfinite(obs)) and obs.min() >= 0.0 and obs.max() <= CLIP
    assert tuple(obs[-5:]) == flags
    assert len(feature_names(BUCKETS.names)) == BUILDER.size


def test_initial_observation() -> None:
    obs = BUILDER.initial()
    assert obs.shape == (BUILDER.size,)
    assert _feature(obs, "batch_efficiency") == 1.0 and _feature(obs, "sla_attainment") == 1.0
    assert float(obs.sum()) == 2.0


def test_single_features_mean_what_the_docs_say() -> None:
    stats = deployment_stats(
        (engine_stats(0, "fp16", running=(2, 0, 0), waiting=(1, 0, 0), kv=0.25,
                      prefill=100, decode=100, recomputed=50, committed=512, capacity=1024),
         engine_stats(1, "fp8", running=(1, 0, 0), kv=math.nan)),
        queued=(0, 3, 0), caps=(32, None, 4), pools=("fp16", "fp8", "fp16"))
    obs = BUILDER.build(stats, (0.0,) * 5)
    b0, b1, _ = BUCKETS.names
    assert _feature(obs, f"{b0}/running") == np.float32(4 / 64)
    assert _feature(obs, f"{b0}/cap") == np.float32(0.5)
    assert _feature(obs, f"{b1}/cap") == 1.0  # no cap = the ladder's top
    assert _feature(obs, f"{b1}/pool") == 1.0
    assert _feature(obs, f"{b1}/queue_len") == np.float32(math.log1p(3) / math.log1p(1000))
    assert _feature(obs, "batch_efficiency") == 0.75
    assert _feature(obs, "kv_committed") == 0.5
    # max over engines keeps the real reading ahead of a NaN; a lone NaN reading must not
    # look like an empty cache: it counts as full
    assert _feature(obs, "kv_cache_usage") == 0.25
    nan_first = deployment_stats((engine_stats(kv=math.nan),))
    assert _feature(BUILDER.build(nan_first, (0.0,) * 5), "kv_cache_usage") == 1.0
    assert len(GLOBAL_FEATURES) == 13 and obs[G] == np.float32(0.25)


def _info_v3(capacity_rps: float, blocks: int = 64) -> DeploymentInfo:
    return DeploymentInfo(buckets=BUCKETS, pools={"fp16": 1}, gpu="g", model="m",
                          default_max_num_seqs=8, max_num_batched_tokens=256,
                          num_kv_blocks={"fp16": blocks}, block_size=16, max_model_len=512,
                          tick_s=1.0, sla=SLA(), capacity_rps=capacity_rps)


def _run_v3(capacity_rps: float, scale: int) -> np.ndarray:
    """Three ticks of a deployment with capacity ``capacity_rps`` under ``scale`` x a base
    load (arrivals, queues, completions, throughput all scaled)."""
    builder = ObservationBuilder(_info_v3(capacity_rps), max_cap=64, version=3)
    obs = builder.initial()
    for t in range(3):
        stats = deployment_stats(
            (engine_stats(0, "fp16", running=(2, 1, 0), kv=0.5, prefill=40 * scale,
                          decode=100 * scale,
                          finished=tuple(record(100 * t + i, 0, ttft=0.1, tpot=0.01)
                                         for i in range(scale))),),
            queued=(3 * scale * (t + 1), scale, 0), arrived=(4 * scale, 2 * scale, scale))
        obs = builder.build(stats, (0.0,) * 5)
    return obs


def test_v3_states_load_relative_to_capacity() -> None:
    names = feature_names(BUCKETS.names, 3)
    base, doubled = _run_v3(2.0, 1), _run_v3(4.0, 2)
    assert base.shape == (observation_size(len(BUCKETS), 3),) == (len(names),)
    relative = [i for i, n in enumerate(names) if n.split("/")[-1] in (
        "queue_len", "arrival_rate", "arrival_rate_ema", "departure_rate_ema", "queue_growth",
        "throughput", "doomed_rate", "load_ratio")]
    assert len(relative) == 5 * len(BUCKETS) + 3
    # Twice the capacity under twice the load reads the same...
    np.testing.assert_allclose(base[relative], doubled[relative], rtol=1e-6)
    # ...and the load is visible: an arrival rate of 4/s on a capacity of 2/s reads 2.
    assert base[names.index(f"{BUCKETS.names[0]}/arrival_rate")] == np.float32(2.0)
    # Absolute features differ: version 2 reads the doubled load as more load.
    v2 = [ObservationBuilder(_info_v3(c), max_cap=64, version=2) for c in (2.0, 4.0)]
    assert _feature_v(v2[0], 1) != _feature_v(v2[1], 2)


def _feature_v(builder: ObservationBuilder, scale: int) -> float:
    stats = deployment_stats((engine_stats(0, "fp16"),), arrived=(4 * scale, 0, 0))
    return float(builder.build(stats, (0.0,) * 5)[1])


def test_v3_capacity_features_and_initial() -> None:
    names = feature_names(BUCKETS.names, 3)
    obs = ObservationBuilder(_info_v3(9.0, blocks=160), max_cap=64, version=3).initial()
    assert obs[names.index("capacity")] == np.float32(math.log1p(9.0) / math.log1p(100.0))
    assert obs[names.index("kv_reference_seqs")] == np.float32(160 * 16 / 1280 / 256)
    assert obs[names.index("total_cap")] == np.float32(8 / 256)


def test_v3_needs_the_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ObservationBuilder(_info_v3(0.0), max_cap=64, version=3)
    ObservationBuilder(_info_v3(0.0), max_cap=64, version=2)  # earlier versions do not


def _v3_and_v4(stats_seq: list[DeploymentStats]) -> tuple[np.ndarray, np.ndarray]:
    v3, v4 = (ObservationBuilder(_info_v3(2.0), max_cap=64, version=v) for v in (3, 4))
    rows3, rows4 = [v3.initial()], [v4.initial()]
    for stats in stats_seq:
        rows3.append(v3.build(stats, (0.0, 1.0, 0.0, 0.0, 1.0)))
        rows4.append(v4.build(stats, (0.0, 1.0, 0.0, 0.0, 1.0)))
    return np.array(rows3), np.array(rows4)


@settings(max_examples=40, deadline=None)
@given(stats_seq=st.lists(random_deployment_stats(), min_size=1, max_size=4))
def test_v4_is_v3_without_the_action_in_force(stats_seq: list[DeploymentStats]) -> None:
    names3, names4 = feature_names(BUCKETS.names, 3), feature_names(BUCKETS.names, 4)
    assert len(names4) == observation_size(len(BUCKETS), 4) == len(names3) - 2 * len(BUCKETS) - 1
    assert not [n for n in names4 if n.endswith(("/cap", "/pool", "total_cap"))]
    rows3, rows4 = _v3_and_v4(stats_seq)
    keep = [names3.index(n) for n in names4]
    np.testing.assert_array_equal(rows4, rows3[:, keep])


def test_v4_does_not_see_the_action_in_force() -> None:
    def stats(caps: tuple[int | None, ...], pools: tuple[str, ...]) -> DeploymentStats:
        return deployment_stats((engine_stats(0, "fp16", running=(2, 1, 0), kv=0.5,
                                              decode=100),),
                                queued=(3, 1, 0), arrived=(4, 2, 1), caps=caps, pools=pools)

    small, large = stats((4, 4, 4), ("fp16",) * 3), stats((64, None, 32), ("fp16",) * 3)
    rows3 = [_v3_and_v4([s])[0][-1] for s in (small, large)]
    rows4 = [_v3_and_v4([s])[1][-1] for s in (small, large)]
    assert not np.array_equal(*rows3)  # version 3 reads the caps...
    np.testing.assert_array_equal(*rows4)  # ...version 4 does not


@settings(max_examples=40, deadline=None)
@given(stats_seq=st.lists(random_deployment_stats(), min_size=1, max_size=4))
def test_v5_is_v4_plus_the_traffic_and_the_sla(stats_seq: list[DeploymentStats]) -> None:
    names4, names5 = feature_names(BUCKETS.names, 4), feature_names(BUCKETS.names, 5)
    assert names5 == names4 + list(TRAFFIC_GLOBAL_FEATURES)
    assert observation_size(len(BUCKETS), 5) == len(names5)
    v4 = ObservationBuilder(_info_v3(2.0), max_cap=64, version=4)
    v5 = ObservationBuilder(_info_v3(2.0), max_cap=64, version=5)
    np.testing.assert_array_equal(v5.initial()[:len(names4)], v4.initial())
    for stats in stats_seq:
        o4, o5 = v4.build(stats, (0.0,) * 5), v5.build(stats, (0.0,) * 5)
        assert o5.shape == (len(names5),)
        np.testing.assert_array_equal(o5[:len(names4)], o4)
        assert np.all(np.isfinite(o5)) and o5.min() >= 0.0 and o5.max() <= CLIP


def test_v5_reads_prefill_share_output_length_and_the_sla() -> None:
    names = feature_names(BUCKETS.names, 5)
    sla = SLA(ttft_s=1.0, tpot_s=0.05)
    info = _info_v3(2.0)
    builder = ObservationBuilder(
        DeploymentInfo(buckets=info.buckets, pools=info.pools, gpu="g", model="m",
                       default_max_num_seqs=8, max_num_batched_tokens=256,
                       num_kv_blocks=info.num_kv_blocks, block_size=16, max_model_len=512,
                       tick_s=1.0, sla=sla, capacity_rps=2.0), max_cap=64, version=5)
    first = builder.initial()
    assert first[names.index("sla_ttft")] == np.float32(1.0 / 5.0)
    assert first[names.index("sla_tpot")] == np.float32(0.05 / 0.15)
    obs = first
    for t in range(3):  # prefill-heavy: 900 prompt tokens per 100 output tokens
        stats = deployment_stats((engine_stats(0, "fp16", prefill=900, decode=100, finished=(
            record(t, 0, output_tokens=20),)),))
        obs = builder.build(stats, (0.0,) * 5)
    assert obs[names.index("prefill_share")] == pytest.approx(0.9)
    assert obs[names.index("output_tokens")] == pytest.approx(math.log1p(20) / math.log1p(2048))
    assert obs[names.index("sla_tpot")] == np.float32(0.05 / 0.15)
    builder.reset()
    stats = deployment_stats((engine_stats(0, "fp16", prefill=100, decode=900),))
    assert builder.build(stats, (0.0,) * 5)[names.index("prefill_share")] == pytest.approx(0.1)


def test_v6_is_v5_plus_the_smoothed_prefix_hit_rate() -> None:
    names5, names6 = feature_names(BUCKETS.names, 5), feature_names(BUCKETS.names, 6)
    assert names6 == names5 + list(PREFIX_GLOBAL_FEATURES)
    assert observation_size(len(BUCKETS), 6) == len(names6)
    v5 = ObservationBuilder(_info_v3(2.0), max_cap=64, version=5)
    v6 = ObservationBuilder(_info_v3(2.0), max_cap=64, version=6)
    first = v6.initial()
    np.testing.assert_array_equal(first[:-1], v5.initial())
    assert first[-1] == 0.0
    # two engines: 3000 of 4000 tokens found; an idle tick leaves the ratio where it was
    cached = deployment_stats((engine_stats(0, "fp16", prefix=(3000, 2900)),
                               engine_stats(1, "fp8", prefix=(1000, 100))))
    idle = deployment_stats((engine_stats(0, "fp16"), engine_stats(1, "fp8")))
    for stats in (cached, idle, idle):
        o5, o6 = v5.build(stats, (0.0,) * 5), v6.build(stats, (0.0,) * 5)
        np.testing.assert_array_equal(o6[:-1], o5)
        assert o6[-1] == pytest.approx(0.75)
    # smoothed: an uncached stream moves it towards 0 over ticks, not at once
    cold = deployment_stats((engine_stats(0, "fp16", prefix=(4000, 0)),))
    rates = [float(v6.build(cold, (0.0,) * 5)[-1]) for _ in range(60)]
    assert 0.7 > rates[0] > rates[1] > rates[-1] > 0.0 and rates[-1] < 0.2
    v6.reset()
    assert v6.build(idle, (0.0,) * 5)[-1] == 0.0


def _info_v7(tpot_s: float, pools: dict[str, int] | None = None) -> DeploymentInfo:
    # a real deployment's profiles: the TPOT fit needs the step-time model
    return DeploymentInfo(buckets=BUCKETS, pools=pools or {"fp16": 1}, gpu="a100-80g",
                          model="llama-2-7b", default_max_num_seqs=256,
                          max_num_batched_tokens=2048, num_kv_blocks={"fp16": 4096},
                          block_size=16, max_model_len=4096, tick_s=1.0,
                          sla=SLA(ttft_s=1.0, tpot_s=tpot_s), capacity_rps=4.0)


def test_v7_is_v6_plus_the_tpot_fit_and_needs_real_profiles() -> None:
    names6, names7 = feature_names(BUCKETS.names, 6), feature_names(BUCKETS.names, 7)
    assert names7 == names6 + list(TPOT_FIT_GLOBAL_FEATURES)
    assert observation_size(len(BUCKETS), 7) == len(names7)
    # one tick of 5000 prompt tokens smooths to 164 per s; at 15 ms totals up to 32 fit
    v6 = ObservationBuilder(_info_v7(0.015), max_cap=64, version=6)
    v7 = ObservationBuilder(_info_v7(0.015), max_cap=64, version=7)
    np.testing.assert_array_equal(v7.initial()[:-1], v6.initial())
    stats = deployment_stats((engine_stats(0, "fp16", prefill=5000, decode=500, finished=(
        record(0, 0, output_tokens=300),)),))
    o6, o7 = v6.build(stats, (0.0,) * 5), v7.build(stats, (0.0,) * 5)
    np.testing.assert_array_equal(o7[:-1], o6)
    assert o7[-1] == np.float32(6 / len(TPOT_FIT_LADDER))
    with pytest.raises(ValueError, match="predicts TPOT from the deployment's GPU and model"):
        ObservationBuilder(_info_v3(2.0), max_cap=64, version=7)


def test_the_tpot_fit_is_the_fixed_point_of_the_step_time() -> None:
    """The predicted time carries the prefill that arrives during it: t = step(r t, N, N c)."""
    fit = TpotFit.for_deployment(_info_v7(0.05))
    model = fit.step_model
    t = fit.tpot_s_at(32, 5000.0, 3000.0, 200.0)
    chunk = int(5000.0 * t)
    assert 0 < chunk < 2048 - 32
    assert t == pytest.approx(model.step_time_s(chunk, chunk * 1500.0, 32, 32 * 3100), rel=1e-3)
    assert t > model.step_time_s(0, 0.0, 32, 32 * 3100)  # the prefill costs time
    # the token budget bounds the prefill of one iteration
    assert fit.tpot_s_at(32, 1e9, 3000.0, 200.0) == pytest.approx(
        model.step_time_s(2048 - 32, (2048 - 32) * 1500.0, 32, 32 * 3100))


@pytest.mark.parametrize("tpot_s, prefill, prompt, output, fewer", [
    (0.03, 0.0, 1000.0, 300.0, "a tighter TPOT"),
    (0.05, 8000.0, 1000.0, 300.0, "more prefill to compute"),
    (0.05, 0.0, 3000.0, 300.0, "longer prompts"),
    (0.05, 0.0, 1000.0, 1500.0, "longer outputs"),
])
def test_the_tpot_fit_admits_fewer_totals_under(tpot_s: float, prefill: float, prompt: float,
                                                output: float, fewer: str) -> None:
    base = TpotFit.for_deployment(_info_v7(0.05)).share(0.0, 1000.0, 300.0)
    fit = TpotFit.for_deployment(_info_v7(tpot_s))
    assert 0.0 < fit.share(prefill, prompt, output) < base < 1.0, fewer
    # the share counts exactly the ladder's totals whose prediction meets the limit
    share = fit.share(prefill, prompt, output)
    meets = [fit.tpot_s_at(n, prefill, prompt, output) <= tpot_s for n in TPOT_FIT_LADDER]
    assert share == sum(meets) / len(TPOT_FIT_LADDER) and meets == sorted(meets, reverse=True)


def test_the_tpot_fit_predicts_the_simulated_tpot() -> None:
    """On long-context traffic at a fixed total, the prediction from the smoothed readings
    is within 10% of the TPOT the simulator measures (median over requests)."""
    from rlbatch.control.controllers import make_controller
    from rlbatch.serving.admission import AdmissionConfig
    from rlbatch.serving.deployment import DeploymentSpec
    from rlbatch.serving.run import run
    from rlbatch.workload.families import family_workload

    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"),
                          sla=SLA(1.0, 0.05))
    controller = make_controller("fixed:48[order=deadline]")
    built: list[ObservationBuilder] = []
    predicted: list[float] = []
    measured: list[float] = []

    def on_tick(stats: DeploymentStats) -> None:
        if not built:
            built.append(ObservationBuilder(controller.info, 256, version=7))  # type: ignore[attr-defined]
        builder = built[0]
        builder.build(stats, (0.0,) * 5)
        if stats.time_s > 60:
            fit = builder.tpot_fit
            assert fit is not None
            predicted.append(fit.tpot_s_at(max(stats.running_total, 1),
                                           *builder.tpot_fit_inputs(len(stats.engines))))
        measured.extend(r.tpot_s for r in stats.finished
                        if not r.rejected and r.output_tokens > 1)

    run(family_workload("report", 1.0, 300.0, 7001), controller, spec, on_tick=on_tick)
    assert len(predicted) > 100 and len(measured) > 100
    assert float(np.median(predicted)) == pytest.approx(float(np.median(measured)), rel=0.1)
