"""What a fidelity comparison is made of: replays, their pooled totals, the live replays of
one workload kept for comparing with any number of calibrations, and the step-time check.

:class:`LiveReplays` holds the measured live replays of a workload (outcomes, the engine's
state before each, their iterations), so that the simulator can be run against them with
another calibration later (``rlbatch fidelity --bracket``: a second calibration after the
replays, in the same process). :func:`step_time_check` charges the model with the replays'
own iterations: how far the calibrated step time is from what the live engine took, apart
from how queueing amplifies it; :func:`leveled` scales a calibration to the speed an
unmeasured replay showed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rlbatch.buckets import Buckets
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.vllm import IterationRecord
from rlbatch.profiles.calibrated import CalibratedProfile, StepCoefficients
from rlbatch.profiles.relative_error import relative_error
from rlbatch.request import Request
from rlbatch.tools.calibrate_fit import predict_durations

__all__ = ["LiveReplays", "PercentileComparison", "RunOutcome", "StepTimeCheck", "leveled",
           "pooled", "step_time_check"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PercentileComparison:
    """Distribution-level comparison of one latency: the live and simulated percentiles
    (what a controller's P50/P99 signals read) and their relative errors.

    :param live: live (P50, P90, P99) in seconds.
    :param sim: simulated (P50, P90, P99) in seconds.
    :param rel_err: ``|sim - live| / live`` per percentile.
    """

    live: tuple[float, float, float]
    sim: tuple[float, float, float]
    rel_err: tuple[float, float, float]

    @classmethod
    def of(cls, live: FloatArray, sim: FloatArray) -> PercentileComparison:
        """Percentiles of both samples (NaN when empty).

        :param live: measured values.
        :param sim: simulated values.
        """
        if live.size == 0 or sim.size == 0:
            nan3 = (math.nan, math.nan, math.nan)
            return cls(nan3, nan3, nan3)
        lv = tuple(float(v) for v in np.percentile(live, [50, 90, 99]))
        sv = tuple(float(v) for v in np.percentile(sim, [50, 90, 99]))
        err = tuple(relative_error(v, s) for v, s in zip(lv, sv, strict=True))
        return cls((lv[0], lv[1], lv[2]), (sv[0], sv[1], sv[2]), (err[0], err[1], err[2]))


@dataclass(frozen=True)
class RunOutcome:
    """One replay of a workload on one deployment.

    :param records: requests that finished or were rejected.
    :param preemptions: requests preempted (engine counters).
    :param makespan_s: first arrival to last finish.
    :param output_tokens: tokens generated.
    :param wall_s: wall time of the replay.
    :param prefix_queries: prompt tokens looked up in the prefix cache (first lookups).
    :param prefix_hits: of those, tokens found cached.
    """

    records: list[FinishedRequest]
    preemptions: int
    makespan_s: float
    output_tokens: int
    wall_s: float
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prefix-cache hits per prompt token looked up (``None``: nothing looked up)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def pooled(runs: Sequence[RunOutcome]) -> RunOutcome:
    """Several replays as one: totals summed (throughput = all tokens over all makespans)."""
    if len(runs) == 1:
        return runs[0]
    return RunOutcome([r for run in runs for r in run.records],
                      sum(run.preemptions for run in runs),
                      sum(run.makespan_s for run in runs),
                      sum(run.output_tokens for run in runs), sum(run.wall_s for run in runs),
                      sum(run.prefix_queries for run in runs),
                      sum(run.prefix_hits for run in runs))


@dataclass(frozen=True)
class LiveReplays:
    """The measured live replays of one workload on one engine, with what a simulated run
    needs to stand in for each.

    :param workload: workload name.
    :param pool: the engine's pool.
    :param requests: the workload's requests.
    :param buckets: prompt-length buckets of the replays.
    :param cap: static per-bucket cap (``None``: none).
    :param tick_s: snapshot interval.
    :param drain_s: how long after the last arrival the replays gave up.
    :param outcomes: the measured replays, in order.
    :param token_counts: per replay, the iteration sizes the engine had run before it.
    :param iterations: the measured replays' iterations, in order.
    :param warmup_iterations: the iterations of the last unmeasured replay before them.
    """

    workload: str
    pool: str
    requests: tuple[Request, ...]
    buckets: Buckets
    cap: int | None
    tick_s: float
    drain_s: float
    outcomes: tuple[RunOutcome, ...]
    token_counts: tuple[tuple[int, ...], ...]
    iterations: tuple[IterationRecord, ...]
    warmup_iterations: tuple[IterationRecord, ...] = ()

    @property
    def cpu_wait(self) -> float | None:
        """Share of the iterations' time the engine thread waited for a CPU, or ``None``."""
        busy = sum(r.duration_s for r in self.iterations)
        cpu = sum(r.cpu_s for r in self.iterations if math.isfinite(r.cpu_s))
        return 1.0 - cpu / busy if busy > 0 else None


@dataclass(frozen=True)
class StepTimeCheck:
    """The calibrated step time charged with the live replays' own iterations.

    :param time_ratio: the model's total over the measured total (stalls included): 1.0 when
        the model charges the replays what the live engine took.
    :param median_bias: median over iterations of model / measured - 1.
    :param iterations: iterations compared.
    """

    time_ratio: float
    median_bias: float
    iterations: int


def step_time_check(profile: CalibratedProfile, pool: str,
                    iterations: Sequence[IterationRecord]) -> StepTimeCheck | None:
    """Charge ``profile``'s step-time model of ``pool`` with measured ``iterations``
    (``None`` without any of positive duration).

    :param profile: a calibrated profile holding ``pool``.
    :param pool: the pool measured.
    :param iterations: measured live iterations.
    """
    rows = [r for r in iterations if r.end_s > r.prev_end_s]
    if not rows:
        return None
    cal = profile.pool(pool)
    predicted = predict_durations(rows, cal.coefficients, cal.wake, cal.shape_cache)
    measured = np.array([r.end_s - r.prev_end_s for r in rows], dtype=np.float64)
    return StepTimeCheck(float(predicted.sum() / measured.sum()),
                         float(np.median(predicted / measured) - 1.0), len(rows))


def leveled(profile: CalibratedProfile, pool: str,
            iterations: Sequence[IterationRecord]) -> CalibratedProfile | None:
    """``profile`` with ``pool``'s step-time coefficients all scaled by one factor, so that
    the model charges ``iterations`` what they took (``None`` without any): the calibrated
    shape at the speed the engine showed on them. Used with an unmeasured replay's
    iterations, to tell a calibration whose level drifted from one whose shape is off.

    :param profile: a calibrated profile holding ``pool``.
    :param pool: the pool measured.
    :param iterations: measured live iterations (not those the comparison then scores).
    """
    check = step_time_check(profile, pool, iterations)
    if check is None or not check.time_ratio > 0:
        return None
    scaled = StepCoefficients.from_vector([v / check.time_ratio for v in
                                           profile.pool(pool).coefficients.as_vector()])
    return profile.with_pool(pool, coefficients=scaled)
