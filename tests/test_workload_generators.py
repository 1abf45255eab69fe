"""Tests for rlbatch.workload: the Workload type, generators, length mixtures and specs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rlbatch.request import Request
from rlbatch.workload import (
    LengthMixture,
    LogNormalLengths,
    Workload,
    azure_like_mix,
    build_workload,
    bursty,
    day_mix,
    diurnal,
    load_trace,
    night_mix,
    poisson,
    resolve_workload,
)

AZURE = "azure_conv_2023.csv"
MOONCAKE = "mooncake_synthetic.jsonl"


@pytest.fixture(scope="module")
def azure(trace_path: Callable[[str], Path]) -> Workload:
    return load_trace(trace_path(AZURE))


def arrivals(workload: Workload) -> list[float]:
    return [r.arrival_s for r in workload.requests]






# --- Workload ---------------------------------------------------------------------------------

def test_build_workload_sorts_rebases_numbers() -> None:
    workload = build_workload([(12.0, 5, 6, None), (10.0, 1, 2, (1, 2)), (11.5, 3, 4, None)],
                              name="toy", source="test")
    assert workload.requests == [Request(0, 0.0, 1, 2, (1, 2)), Request(1, 1.5, 3, 4),
                                 Request(2, 2.0, 5, 6)]
    assert workload.duration_s == 2.0
    assert workload.mean_rate_rps == 1.5
    assert "\n" not in workload.describe() and workload.describe().startswith("toy: 3 requests")


@pytest.mark.parametrize("requests", [
    [Request(1, 0.0, 1, 1)],
    [Request(0, 1.0, 1, 1)],
    [Request(0, 0.0, 1, 1), Request(1, 2.0, 1, 1), Request(2, 1.0, 1, 1)],
])
def test_workload_rejects_broken_invariants(requests: list[Request]) -> None:
    with pytest.raises(ValueError):
        Workload(name="bad", requests=requests, source="test")


def test_empty_workload_properties() -> None:
    workload = build_workload([], name="none", source="test")
    assert (len(workload), workload.duration_s, workload.mean_rate_rps) == (0, 0.0, 0.0)


# --- generators -------------------------------------------------------------------------------

Generator = Callable[..., Workload]
GENERATORS: list[Generator] = [poisson, bursty, diurnal]


@pytest.mark.parametrize("generate", GENERATORS)
def test_generator_is_deterministic(generate: Generator) -> None:
    first = generate(5.0, 300.0, night_mix(), 3)
    assert first.requests == generate(5.0, 300.0, night_mix(), 3).requests
    assert first.requests != generate(5.0, 300.0, night_mix(), 4).requests
    assert first.requests[0].arrival_s == 0.0
    assert first.source.startswith(generate.__name__ + "(") and "night_mix" in first.source


@pytest.mark.parametrize(("generate", "tolerance"), [(poisson, 0.02), (bursty, 0.06),
                                                     (diurnal, 0.02)])
def test_generator_mean_rate(generate: Generator, tolerance: float) -> None:
    workload = generate(5.0, 20_000.0, day_mix(), 0)
    assert workload.mean_rate_rps == pytest.approx(5.0, rel=tolerance)


def bin_counts(workload: Workload, width_s: float) -> np.ndarray:
    times = np.asarray(arrivals(workload))
    return np.bincount((times // width_s).astype(int))


def test_bursty_is_burstier_than_poisson() -> None:
    def dispersion(workload: Workload) -> float:
        counts = bin_counts(workload, 10.0)
        return float(counts.var() / counts.mean())
    assert dispersion(poisson(5.0, 5000.0, day_mix(), 0)) < 1.3
    assert dispersion(bursty(5.0, 5000.0, day_mix(), 0)) > 3.0


def test_diurnal_peaks_mid_period() -> None:
    counts = bin_counts(diurnal(5.0, 4000.0, day_mix(), 0, amplitude=0.8), 1000.0)
    assert counts[1] + counts[2] > 2 * (counts[0] + counts[3])


@pytest.mark.parametrize(("generate", "kwargs"), [
    (poisson, {"rate_rps": 0.0}), (poisson, {"rate_rps": -1.0}), (poisson, {"rate_rps": math.nan}),
    (poisson, {"duration_s": 0.0}), (poisson, {"rate_rps": 1e6, "duration_s": 1e6}),
    (bursty, {"burst_factor": 0.5}), (bursty, {"mean_on_s": 0.0}), (bursty, {"mean_off_s": -1.0}),
    (diurnal, {"amplitude": 1.0}), (diurnal, {"amplitude": -0.1}), (diurnal, {"period_s": 0.0}),
])
def test_generator_argument_validation(generate: Generator, kwargs: dict[str, float]) -> None:
    first = "rate_rps" if generate is poisson else "mean_rate_rps"
    args: dict[str, float] = {first: 5.0, "duration_s": 60.0}
    args.update({first if key == "rate_rps" else key: value for key, value in kwargs.items()})
    with pytest.raises(ValueError):
        generate(**args)


# --- lengths ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dist", [day_mix(), night_mix(), azure_like_mix()],
                         ids=["day", "night", "azure-like"])
def test_presets_fit_4k_context(dist: LogNormalLengths | LengthMixture) -> None:
    prompts, outputs = dist.sample(np.random.default_rng(0), 20_000)
    assert prompts.min() >= 1 and outputs.min() >= 1
    assert (prompts + outputs).max() <= 4096


def test_day_mix_is_short_chats() -> None:
    prompts, outputs = day_mix().sample(np.random.default_rng(0), 5_000)
    assert prompts.min() >= 200 and prompts.max() <= 800
    assert outputs.min() >= 100 and outputs.max() <= 300


def test_night_mix_has_short_and_long() -> None:
    prompts, outputs = night_mix().sample(np.random.default_rng(0), 10_000)
    long = prompts >= 2048
    assert np.all((prompts < 1024) | long)
    assert long.mean() == pytest.approx(0.25, abs=0.02)
    assert outputs[long].min() >= 500 and outputs[~long].max() <= 300


def test_lengths_are_seeded_by_caller() -> None:
    dist = night_mix()
    first = dist.sample(np.random.default_rng(5), 100)
    second = dist.sample(np.random.default_rng(5), 100)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("kwargs", [
    {"prompt_median": 0.0}, {"prompt_sigma": -0.1}, {"output_max": 10},
    {"prompt_min": 0}, {"total_max": 40},
])
def test_lognormal_validation(kwargs: dict[str, float]) -> None:
    params: dict[str, float] = {"prompt_median": 500, "prompt_sigma": 0.5, "output_median": 100,
                                "output_sigma": 0.5, "prompt_max": 2000, "output_max": 500,
                                "prompt_min": 50}
    params.update(kwargs)
    with pytest.raises(ValueError):
        LogNormalLengths(**params)  # type: ignore[arg-type]


def test_mixture_validation() -> None:
    with pytest.raises(ValueError):
        LengthMixture([])
    with pytest.raises(ValueError):
        LengthMixture([(0.0, day_mix())])


# --- specs ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "prefix"), [
    ("poisson:rate=5,duration=600,mix=night", "poisson("),
    ("bursty:rate=5,duration=600,mix=day", "bursty("),
    ("diurnal:rate=5,duration=3600,mix=night", "diurnal("),
    ("bursty:rate=2,duration=100,burst=8,on=5,off=20", "bursty("),
    ("diurnal:rate=2,duration=100,period=50,amplitude=0.3", "diurnal("),
])
def test_resolve_generator_specs(spec: str, prefix: str) -> None:
    workload = resolve_workload(spec, seed=1)
    assert workload.source.startswith(prefix)
    assert workload.requests == resolve_workload(spec, seed=1).requests


def test_resolve_spec_rate_scale_and_mix() -> None:
    workload = resolve_workload("poisson:rate=5,duration=2000,mix=day", 0, rate_scale=2.0)
    assert workload.mean_rate_rps == pytest.approx(10.0, rel=0.05)
    assert "day_mix" in workload.source
    assert "azure_like" in resolve_workload("poisson:rate=1,duration=10", 0).source


def test_resolve_trace_path(trace_path: Callable[[str], Path]) -> None:
    assert len(resolve_workload(str(trace_path(MOONCAKE)), 0)) == 3_993


@pytest.mark.parametrize(("spec", "error"), [
    ("possion:rate=5,duration=60", ValueError),
    ("poisson:rate=5", ValueError),
    ("poisson:rate=5,duration=60,mix=evening", ValueError),
    ("poisson:rate=5,duration=60,burst=2", ValueError),
    ("poisson:rate=fast,duration=60", ValueError),
    ("poisson:rate=0,duration=60", ValueError),
    ("no/such/trace.csv", FileNotFoundError),
])
def test_resolve_bad_specs(spec: str, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        resolve_workload(spec, 0)
    if "rate=0" not in spec and "fast" not in spec and "evening" not in spec:
        assert "poisson:rate=R,duration=D" in str(info.value)
