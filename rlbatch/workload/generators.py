"""Synthetic arrival processes: Poisson, bursty (2-state MMPP) and diurnal (thinning).

Each generator draws arrivals and then lengths from one ``numpy.random.default_rng(seed)``
made per call, so the same arguments always give the same Workload. Arrival times are
drawn on ``[0, duration_s)`` and then re-based so the first request arrives at 0 (every
Workload starts at 0).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from rlbatch.workload.base import RequestRow, Workload, build_workload
from rlbatch.workload.lengths import (
    LengthDist,
    LengthMixture,
    LogNormalLengths,
    azure_like_mix,
    day_mix,
    night_mix,
)

__all__ = ["LengthDist", "LengthMixture", "LogNormalLengths", "azure_like_mix", "bursty",
           "day_mix", "diurnal", "night_mix", "poisson", "surge"]

FloatArray = npt.NDArray[np.float64]

#: Refuse to generate more than this many requests in expectation (a typo guard).
MAX_EXPECTED_REQUESTS = 20_000_000


def poisson(rate_rps: float, duration_s: float, lengths: LengthDist | None = None,
            seed: int = 0) -> Workload:
    """Homogeneous Poisson arrivals.

    :param rate_rps: arrival rate in requests per second (> 0).
    :param duration_s: length of the arrival window in seconds (> 0).
    :param lengths: length distribution (default :func:`azure_like_mix`).
    :param seed: seed of the per-call generator.
    :raises ValueError: for a non-positive or non-finite rate or duration.
    """
    _check_rate_duration(rate_rps, duration_s)
    dist = lengths if lengths is not None else azure_like_mix()
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate_rps, 0.0, duration_s)
    source = (f"poisson(rate_rps={rate_rps:g}, duration_s={duration_s:g}, "
              f"lengths={dist.describe()}, seed={seed})")
    return _workload(f"poisson-{dist.describe()}", source, arrivals, dist, rng)


def bursty(mean_rate_rps: float, duration_s: float, lengths: LengthDist | None = None,
           seed: int = 0, burst_factor: float = 4.0, mean_on_s: float = 10.0,
           mean_off_s: float = 30.0) -> Workload:
    """On/off bursts: a 2-state Markov-modulated Poisson process.

    The process alternates between an *on* state (rate ``burst_factor`` times the *off*
    rate) and an *off* state, each lasting an exponential time with mean ``mean_on_s`` /
    ``mean_off_s``; the initial state is drawn from the stationary distribution. The rates
    are chosen so the long-run mean is ``mean_rate_rps``:
    ``off = mean * (on_s + off_s) / (burst_factor * on_s + off_s)``, ``on = burst_factor * off``.

    :param mean_rate_rps: long-run mean arrival rate in requests per second (> 0).
    :param duration_s: length of the arrival window in seconds (> 0).
    :param lengths: length distribution (default :func:`azure_like_mix`).
    :param seed: seed of the per-call generator.
    :param burst_factor: on-state rate / off-state rate (>= 1; 1 is plain Poisson).
    :param mean_on_s: mean duration of an on period in seconds (> 0).
    :param mean_off_s: mean duration of an off period in seconds (> 0).
    :raises ValueError: for invalid arguments.
    """
    _check_rate_duration(mean_rate_rps, duration_s)
    if not (math.isfinite(burst_factor) and burst_factor >= 1.0):
        raise ValueError(f"burst_factor must be a finite number >= 1, got {burst_factor}")
    _check_positive("mean_on_s", mean_on_s)
    _check_positive("mean_off_s", mean_off_s)
    dist = lengths if lengths is not None else azure_like_mix()
    rng = np.random.default_rng(seed)
    off_rate = mean_rate_rps * (mean_on_s + mean_off_s) / (burst_factor * mean_on_s + mean_off_s)
    on_rate = burst_factor * off_rate
    pieces: list[FloatArray] = []
    now = 0.0
    on = bool(rng.random() < mean_on_s / (mean_on_s + mean_off_s))
    while now < duration_s:
        end = min(duration_s, now + rng.exponential(mean_on_s if on else mean_off_s))
        pieces.append(poisson_arrivals(rng, on_rate if on else off_rate, now, end))
        now, on = end, not on
    arrivals = np.concatenate(pieces)
    source = (f"bursty(mean_rate_rps={mean_rate_rps:g}, duration_s={duration_s:g}, "
              f"lengths={dist.describe()}, seed={seed}, burst_factor={burst_factor:g}, "
              f"mean_on_s={mean_on_s:g}, mean_off_s={mean_off_s:g})")
    return _workload(f"bursty-{dist.describe()}", source, arrivals, dist, rng)


def surge(rate_rps: float, duration_s: float, lengths: LengthDist | None = None,
          seed: int = 0, surge_factor: float = 3.75, surge_start_s: float = 300.0,
          surge_s: float = 60.0) -> Workload:
    """Steady Poisson arrivals with one surge: ``rate_rps``, then ``surge_factor`` times it
    for ``surge_s`` seconds from ``surge_start_s``, then ``rate_rps`` again (e.g. 0.8x the
    deployment's capacity with a factor of 3.75: 60 s at 3x capacity).

    :param rate_rps: the steady rate in requests per second (> 0).
    :param duration_s: length of the arrival window in seconds (> 0).
    :param lengths: length distribution (default :func:`azure_like_mix`).
    :param seed: seed of the per-call generator.
    :param surge_factor: the surge's rate over the steady one (>= 1).
    :param surge_start_s: when the surge starts (>= 0, before ``duration_s``).
    :param surge_s: how long it lasts (> 0).
    :raises ValueError: for invalid arguments.
    """
    _check_rate_duration(rate_rps * max(surge_factor, 1.0), duration_s)
    if not (math.isfinite(surge_factor) and surge_factor >= 1.0):
        raise ValueError(f"surge_factor must be a finite number >= 1, got {surge_factor}")
    _check_positive("surge_s", surge_s)
    if not 0.0 <= surge_start_s < duration_s:
        raise ValueError(f"surge_start_s must be in [0, duration_s={duration_s:g}), got "
                         f"{surge_start_s}")
    dist = lengths if lengths is not None else azure_like_mix()
    rng = np.random.default_rng(seed)
    end = min(surge_start_s + surge_s, duration_s)
    arrivals = np.concatenate([
        poisson_arrivals(rng, rate_rps, 0.0, surge_start_s),
        poisson_arrivals(rng, rate_rps * surge_factor, surge_start_s, end),
        poisson_arrivals(rng, rate_rps, end, duration_s)])
    source = (f"surge(rate_rps={rate_rps:g}, duration_s={duration_s:g}, "
              f"lengths={dist.describe()}, seed={seed}, surge_factor={surge_factor:g}, "
              f"surge_start_s={surge_start_s:g}, surge_s={surge_s:g})")
    # re-based as every workload is: the surge moves earlier by the first arrival's time
    # (1/rate_rps on average)
    return _workload(f"surge-{dist.describe()}", source, arrivals, dist, rng)


def diurnal(mean_rate_rps: float, duration_s: float, lengths: LengthDist | None = None,
            seed: int = 0, period_s: float | None = None, amplitude: float = 0.5) -> Workload:
    """Non-homogeneous Poisson arrivals with a sinusoidal rate, drawn by thinning.

    ``rate(t) = mean_rate_rps * (1 - amplitude * cos(2 pi t / period_s))``: the run starts at
    the trough ("night"), peaks half a period later. Over whole periods the mean rate is
    ``mean_rate_rps``.

    :param mean_rate_rps: mean arrival rate over a period in requests per second (> 0).
    :param duration_s: length of the arrival window in seconds (> 0).
    :param lengths: length distribution (default :func:`azure_like_mix`).
    :param seed: seed of the per-call generator.
    :param period_s: period of the rate curve in seconds (> 0; default ``duration_s``, one
        full cycle per run).
    :param amplitude: relative swing of the rate, in ``[0, 1)`` (0 is plain Poisson).
    :raises ValueError: for invalid arguments.
    """
    _check_rate_duration(mean_rate_rps, duration_s)
    period = duration_s if period_s is None else period_s
    _check_positive("period_s", period)
    if not 0.0 <= amplitude < 1.0:
        raise ValueError(f"amplitude must be in [0, 1), got {amplitude}")
    dist = lengths if lengths is not None else azure_like_mix()
    rng = np.random.default_rng(seed)
    peak = mean_rate_rps * (1.0 + amplitude)
    candidates = poisson_arrivals(rng, peak, 0.0, duration_s)
    rate = mean_rate_rps * (1.0 - amplitude * np.cos(2.0 * math.pi * candidates / period))
    arrivals = candidates[rng.random(candidates.size) * peak < rate]
    source = (f"diurnal(mean_rate_rps={mean_rate_rps:g}, duration_s={duration_s:g}, "
              f"lengths={dist.describe()}, seed={seed}, period_s={period:g}, "
              f"amplitude={amplitude:g})")
    return _workload(f"diurnal-{dist.describe()}", source, arrivals, dist, rng)


def poisson_arrivals(rng: np.random.Generator, rate: float, start: float,
                      end: float) -> FloatArray:
    """Poisson arrivals on ``[start, end)``: a Poisson count placed uniformly, sorted."""
    count = int(rng.poisson(rate * (end - start)))
    return np.sort(rng.uniform(start, end, count))


def _workload(name: str, source: str, arrivals: FloatArray, dist: LengthDist,
              rng: np.random.Generator) -> Workload:
    prompts, outputs = dist.sample(rng, int(arrivals.size))
    rows: list[RequestRow] = [
        (arrival, prompt, output, None)
        for arrival, prompt, output in zip(arrivals.tolist(), prompts.tolist(),
                                           outputs.tolist(), strict=True)]
    return build_workload(rows, name=name, source=source)


def _check_positive(label: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{label} must be a finite number > 0, got {value}")


def _check_rate_duration(rate_rps: float, duration_s: float) -> None:
    _check_positive("rate (requests per second)", rate_rps)
    _check_positive("duration_s", duration_s)
    if rate_rps * duration_s > MAX_EXPECTED_REQUESTS:
        raise ValueError(f"rate {rate_rps:g} req/s x duration {duration_s:g} s expects "
                         f"{rate_rps * duration_s:.3g} requests, more than the "
                         f"{MAX_EXPECTED_REQUESTS:,} allowed")
