"""Scenario library: named workloads (the tuning guide's case study among them) and the
domain-randomised sampler the environment draws training episodes from.

Rates are set for the default deployment (Llama-2-7B on one A100-80G); ``rate_scale``
multiplies every rate for bigger or smaller deployments.

Case study (guide: financial customer service), reproduced on the simulator:

* ``day``: uniform short chat requests at 4 req/s. ``static:16`` meets the SLA (TTFT P99
  about 1.2 s).
* ``night``: a lower rate (2.25 req/s) of short chats mixed with long reports (11%: about
  0.25 req/s of 2.5-3.5k-token prompts with 500-1000-token answers). With ``static:16``
  TTFT P99 rises 2-6x (2.4-7 s over seeds) although traffic is lower: each long report holds
  a batch slot for ~20 s and short questions queue behind them. Routing by length (short ->
  cap 32, long -> cap 8: the ``playbook`` controller) brings it back within SLA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlbatch.workload import (
    Workload,
    azure_like_mix,
    build_workload,
    bursty,
    day_mix,
    diurnal,
    load_trace,
    night_mix,
    poisson,
)


@dataclass(frozen=True)
class Scenario:
    """A named, seeded workload.

    :param name: short name (``day``, ``night``, ...).
    :param description: one line for reports.
    :param make: ``(seed, duration_s, rate_scale) -> Workload``.
    """

    name: str
    description: str
    make: Callable[[int, float, float], Workload]


def _day(seed: int, duration_s: float, load: float) -> Workload:
    return poisson(4.0 * load, duration_s, day_mix(), seed=seed)


def _night(seed: int, duration_s: float, load: float) -> Workload:
    return poisson(2.25 * load, duration_s, night_mix(0.11), seed=seed)


def _bursty(seed: int, duration_s: float, load: float) -> Workload:
    return bursty(3.0 * load, duration_s, azure_like_mix(), seed=seed)


def _diurnal(seed: int, duration_s: float, load: float) -> Workload:
    return diurnal(3.0 * load, duration_s, night_mix(0.15), seed=seed, amplitude=0.6)


SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (
        Scenario("day", "guide case study, day: short chats, Poisson 4 req/s", _day),
        Scenario("night", "guide case study, night: 2.25 req/s, 89% short chats + 11% long "
                          "reports", _night),
        Scenario("bursty", "on/off bursts (MMPP), Azure-like lengths, mean 3 req/s", _bursty),
        Scenario("diurnal", "sinusoidal rate around 3 req/s, 15% long reports", _diurnal),
    )
}


def make_scenario(name: str, *, seed: int = 0, duration_s: float = 900.0,
                  rate_scale: float = 1.0) -> Workload:
    """Build a named scenario's workload."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; available: {', '.join(SCENARIOS)}")
    if not duration_s > 0 or not rate_scale > 0:
        raise ValueError(f"duration_s and rate_scale must be > 0, got {duration_s}, "
                         f"{rate_scale}")
    return SCENARIOS[name].make(seed, duration_s, rate_scale)


def slice_trace(trace: Workload, start_s: float, duration_s: float, rate_scale: float,
                name: str | None = None) -> Workload:
    """Arrivals of ``trace`` in ``[start_s, start_s + duration_s * rate_scale)``, time-
    compressed by ``rate_scale`` so the slice lasts about ``duration_s``."""
    end_s = start_s + duration_s * rate_scale
    rows = [(r.arrival_s / rate_scale, r.prompt_tokens, r.max_output_tokens, r.prefix_ids)
            for r in trace.requests if start_s <= r.arrival_s < end_s]
    if not rows:
        raise ValueError(f"no arrivals in [{start_s}, {end_s}) s of {trace.name}")
    return build_workload(rows, name=name or f"{trace.name}[{start_s:.0f}s+]",
                          source=trace.source,
                          transforms=(*trace.transforms,
                                      f"slice [{start_s:.0f}, {end_s:.0f}) s",
                                      f"rate_scale x{rate_scale:g}"))


class ScenarioSampler:
    """Draws a training episode's workload: domain randomisation over load and length mix.

    With probability ``trace_fraction`` (when traces are given) a random slice of a training
    trace at a log-uniform random rate scale; otherwise a generator (Poisson, bursty, diurnal)
    with a random rate and a random share of long reports. Traces are read on first use and
    kept (no I/O in the constructor).

    :param traces: training trace files (never the evaluation trace when measuring
        generalisation).
    :param trace_rate_scale: range of rate scales for trace slices.
    :param gen_rate_rps: range of mean rates for generators.
    :param long_fraction: range of the long-report share in generated mixes.
    :param trace_fraction: probability of drawing a trace slice.
    :param rate_scale: multiplies every rate (bigger / smaller deployments).
    """

    def __init__(self, traces: tuple[str | Path, ...] = (), *,
                 trace_rate_scale: tuple[float, float] = (0.25, 1.0),
                 gen_rate_rps: tuple[float, float] = (1.0, 8.0),
                 long_fraction: tuple[float, float] = (0.0, 0.4),
                 trace_fraction: float = 0.5, rate_scale: float = 1.0) -> None:
        for name, (lo, hi) in (("trace_rate_scale", trace_rate_scale),
                               ("gen_rate_rps", gen_rate_rps)):
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be 0 < lo <= hi, got {(lo, hi)}")
        if not 0 <= long_fraction[0] <= long_fraction[1] < 1:
            raise ValueError(f"long_fraction must be within [0, 1), got {long_fraction}")
        if not 0 <= trace_fraction <= 1:
            raise ValueError(f"trace_fraction must be in [0, 1], got {trace_fraction}")
        self.traces = tuple(str(t) for t in traces)
        self.trace_rate_scale = trace_rate_scale
        self.gen_rate_rps = gen_rate_rps
        self.long_fraction = long_fraction
        self.trace_fraction = trace_fraction if traces else 0.0
        self.rate_scale = rate_scale
        self._loaded: dict[str, Workload] = {}

    def _trace(self, path: str) -> Workload:
        if path not in self._loaded:
            self._loaded[path] = load_trace(path)
        return self._loaded[path]

    def sample(self, rng: np.random.Generator, duration_s: float) -> Workload:
        """One episode's workload, all randomness from ``rng``."""
        if self.traces and rng.random() < self.trace_fraction:
            trace = self._trace(self.traces[int(rng.integers(len(self.traces)))])
            lo, hi = self.trace_rate_scale
            scale = float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) * self.rate_scale
            span = duration_s * scale
            latest = max(trace.duration_s - span, 0.0)
            start = float(rng.uniform(0.0, latest)) if latest > 0 else 0.0
            return slice_trace(trace, start, duration_s, scale)
        lo, hi = self.gen_rate_rps
        rate = float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) * self.rate_scale
        long_share = float(rng.uniform(*self.long_fraction))
        lengths = night_mix(long_share) if long_share > 0 else day_mix()
        seed = int(rng.integers(2**31))
        kind = int(rng.integers(3))
        if kind == 0:
            return poisson(rate, duration_s, lengths, seed=seed)
        if kind == 1:
            return bursty(rate, duration_s, lengths, seed=seed)
        return diurnal(rate, duration_s, lengths, seed=seed,
                       amplitude=float(rng.uniform(0.2, 0.8)))
