"""Simulator fidelity: one workload on a live engine and on its calibrated stand-in, compared.

The workload is replayed on a live vLLM engine and on the simulator with the engine's
calibrated profile, and the two are compared request by request.

:func:`run_fidelity` replays a workload through the same admission layer and control loop
(a :class:`~rlbatch.serving.loop.ControlLoop` under a fixed action) on both engines, then
reports (:class:`FidelityReport`):

* per-request relative error of TTFT and e2e latency, ``|sim - live| / live``: median, P90
  and P99, plus the mean signed error (bias), as :class:`~rlbatch.profiles.relative_error.
  RelativeErrors`;
* throughput (output tokens / makespan) of both and its relative error;
* preemptions of both.

Targets (DESIGN): median per-request latency error <= 5 %, P99 <= 10 %, throughput <= 5 %.
What limits them on the CPU engine: step times on a shared 2-core machine jitter by tens of
percent from one iteration to the next (the calibration fits their mean), and a TTFT of one
or two iterations inherits that jitter, while e2e (a sum of many iterations) averages it out.

Command line: ``rlbatch fidelity`` (:mod:`rlbatch.commands.fidelity`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction, DeploymentStats
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.vllm import VllmEngine
from rlbatch.paths import traces_dir
from rlbatch.profiles.calibrated import CalibratedProfile
from rlbatch.profiles.relative_error import RelativeErrors, relative_error
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.builders import profile_sim_engine
from rlbatch.serving.deployment import Deployment, assemble_deployment
from rlbatch.serving.loop import ControlLoop
from rlbatch.workload import Workload, build_workload

__all__ = [
    "DEFAULT_GENERATOR",
    "TARGETS",
    "FidelityReport",
    "PercentileComparison",
    "RunOutcome",
    "compare",
    "default_trace",
    "replay",
    "run_fidelity",
    "scale_workload",
]


def default_trace() -> Path:
    """The Azure conversation trace: ``$RLBATCH_TRACES_DIR`` or ``../shared/data/traces``
    beside the repository."""
    return traces_dir() / "azure_conv_2023.csv"


DEFAULT_GENERATOR = "poisson:rate=8,duration=20,mix=azure-like"

TARGETS = {"latency_median": 0.05, "latency_p99": 0.10, "throughput": 0.05}

FloatArray = npt.NDArray[np.float64]


# --------------------------------------------------------------------------- results


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
    """

    records: list[FinishedRequest]
    preemptions: int
    makespan_s: float
    output_tokens: int
    wall_s: float

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


@dataclass(frozen=True)
class FidelityReport:
    """Live vs simulated replay of one workload on one pool.

    :param workload: workload name.
    :param pool: pool replayed.
    :param requests: requests in the workload.
    :param completed_live: requests finished on the live engine.
    :param completed_sim: requests finished in the simulator.
    :param ttft: TTFT errors.
    :param e2e: e2e latency errors.
    :param tpot: TPOT errors.
    :param throughput_live_tok_s: live output tokens per second over the makespan.
    :param throughput_sim_tok_s: simulated output tokens per second.
    :param throughput_rel_err: ``|sim - live| / live`` of throughput.
    :param preemptions_live: live preemptions.
    :param preemptions_sim: simulated preemptions.
    :param makespan_live_s: live makespan.
    :param makespan_sim_s: simulated makespan.
    :param ttft_p50_live_s: live median TTFT (scale of the errors).
    :param e2e_p50_live_s: live median e2e.
    :param wall_s: wall time of the live replay.
    :param ttft_pct: TTFT percentiles, live vs simulated.
    :param e2e_pct: e2e percentiles, live vs simulated.
    :param ttft_floor: TTFT differences between two live replays of the same workload (the
        live engine's own repeatability: no simulator can do better), or ``None``.
    :param e2e_floor: the same for e2e.
    :param throughput_floor: the same for throughput.
    """

    workload: str
    pool: str
    requests: int
    completed_live: int
    completed_sim: int
    ttft: RelativeErrors
    e2e: RelativeErrors
    tpot: RelativeErrors
    throughput_live_tok_s: float
    throughput_sim_tok_s: float
    throughput_rel_err: float
    preemptions_live: int
    preemptions_sim: int
    makespan_live_s: float
    makespan_sim_s: float
    ttft_p50_live_s: float
    e2e_p50_live_s: float
    wall_s: float
    ttft_pct: PercentileComparison | None = None
    e2e_pct: PercentileComparison | None = None
    ttft_floor: RelativeErrors | None = None
    e2e_floor: RelativeErrors | None = None
    throughput_floor: float | None = None

    def targets_met(self) -> dict[str, bool]:
        """Which DESIGN targets hold (latency = TTFT and e2e both)."""
        return {
            "latency_median": max(self.ttft.median, self.e2e.median)
            <= TARGETS["latency_median"],
            "latency_p99": max(self.ttft.p99, self.e2e.p99) <= TARGETS["latency_p99"],
            "throughput": self.throughput_rel_err <= TARGETS["throughput"],
        }

    def to_row(self) -> dict[str, Any]:
        """Flat JSON row."""
        row = asdict(self)
        row["targets_met"] = self.targets_met()
        return row


# --------------------------------------------------------------------------- workloads


def scale_workload(workload: Workload, prompt_scale: float, max_model_len: int,
                   max_requests: int | None = None, output_scale: float = 1.0) -> Workload:
    """Scale prompt lengths by ``prompt_scale`` and output lengths by ``output_scale`` (at
    least 1 token each; outputs at most half the context) and cut prompts so prompt + output
    fit ``max_model_len``; arrivals unchanged.

    :param workload: the source workload.
    :param prompt_scale: factor on prompt lengths (> 0).
    :param max_model_len: the engine's context.
    :param max_requests: keep only the first N requests.
    :param output_scale: factor on output lengths (> 0).
    """
    if not (prompt_scale > 0 and output_scale > 0):
        raise ValueError(f"length scales must be > 0, got prompt {prompt_scale}, output "
                         f"{output_scale}")
    rows = []
    cut = 0
    for req in workload.requests[:max_requests]:
        output = max(1, min(round(req.max_output_tokens * output_scale), max_model_len // 2))
        prompt = max(1, round(req.prompt_tokens * prompt_scale))
        if prompt + output > max_model_len:
            prompt = max_model_len - output
            cut += 1
        rows.append((req.arrival_s, prompt, output, None))
    transforms = (*workload.transforms, f"prompts x{prompt_scale:g}",
                  f"outputs x{output_scale:g}",
                  f"prompts cut to fit {max_model_len} tokens: {cut}")
    if max_requests is not None:
        transforms = (*transforms, f"first {max_requests} requests")
    return build_workload(rows, name=workload.name, source=workload.source,
                          transforms=transforms)


# --------------------------------------------------------------------------- replay


def _deployment(engines: Sequence[Engine], buckets: Buckets, max_model_len: int,
                block_size: int, max_num_batched_tokens: int, tick_s: float) -> Deployment:
    return assemble_deployment(
        engines, buckets=buckets, admission=AdmissionConfig(), gpu="fidelity",
        model="fidelity", max_model_len=max_model_len, block_size=block_size,
        default_max_num_seqs=engines[0].max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, tick_s=tick_s)


def replay(deployment: Deployment, requests: Sequence[Request], action: ControlAction, *,
           drain_s: float = 120.0,
           on_tick: Callable[[DeploymentStats], None] | None = None) -> RunOutcome:
    """Replay ``requests`` on ``deployment`` under a fixed ``action``: a control loop whose
    controller never changes its mind, ticking every ``deployment.info.tick_s`` until
    everything finished or ``drain_s`` after the last arrival.

    :param deployment: a fresh deployment (live or simulated).
    :param requests: arrivals, sorted.
    :param action: caps and routes in force throughout.
    :param drain_s: give up this long after the last arrival.
    :param on_tick: called with each tick's stats.
    """
    started = time.monotonic()
    loop = ControlLoop(deployment, requests, action, drain_s=drain_s)
    while True:
        stats = loop.tick()
        if on_tick is not None:
            on_tick(stats)
        if loop.finished:
            break
    done = [r for r in loop.records if not r.rejected]
    first = min((r.arrival_s for r in requests), default=0.0)
    last = max((r.finish_s for r in done), default=first)
    return RunOutcome(loop.records, loop.totals.preemptions, last - first,
                      sum(r.output_tokens for r in done), time.monotonic() - started)


def compare(workload: str, pool: str, n_requests: int, live: RunOutcome,
            sim: RunOutcome) -> FidelityReport:
    """Match requests by id and compute the errors.

    :param workload: workload name.
    :param pool: pool replayed.
    :param n_requests: requests in the workload.
    :param live: the live replay.
    :param sim: the simulated replay.
    """
    live_by_id = {r.request_id: r for r in live.records if not r.rejected}
    sim_by_id = {r.request_id: r for r in sim.records if not r.rejected}
    ids = sorted(set(live_by_id) & set(sim_by_id))

    def pair(attr: str) -> tuple[FloatArray, FloatArray]:
        lv = np.array([getattr(live_by_id[i], attr) for i in ids], dtype=np.float64)
        sv = np.array([getattr(sim_by_id[i], attr) for i in ids], dtype=np.float64)
        return lv, sv

    ttft_l, ttft_s = pair("ttft_s")
    e2e_l, e2e_s = pair("e2e_s")
    tpot_l, tpot_s = pair("tpot_s")
    multi = tpot_l > 0
    tl, ts = live.throughput_tok_s, sim.throughput_tok_s
    return FidelityReport(
        workload=workload, pool=pool, requests=n_requests, completed_live=len(live_by_id),
        completed_sim=len(sim_by_id), ttft=RelativeErrors.of(ttft_l, ttft_s),
        e2e=RelativeErrors.of(e2e_l, e2e_s),
        tpot=RelativeErrors.of(tpot_l[multi], tpot_s[multi]),
        throughput_live_tok_s=tl, throughput_sim_tok_s=ts,
        throughput_rel_err=relative_error(tl, ts),
        preemptions_live=live.preemptions, preemptions_sim=sim.preemptions,
        makespan_live_s=live.makespan_s, makespan_sim_s=sim.makespan_s,
        ttft_p50_live_s=float(np.median(ttft_l)) if ids else math.nan,
        e2e_p50_live_s=float(np.median(e2e_l)) if ids else math.nan, wall_s=live.wall_s,
        ttft_pct=PercentileComparison.of(ttft_l, ttft_s),
        e2e_pct=PercentileComparison.of(e2e_l, e2e_s))


def run_fidelity(profile: CalibratedProfile, engine: VllmEngine, workload: Workload, *,
                 buckets: Buckets | None = None, cap: int | None = None,
                 tick_s: float = 1.0, drain_s: float = 120.0,
                 repeats: int = 1) -> FidelityReport:
    """Replay ``workload`` on the live ``engine`` and on its simulated stand-in.

    :param profile: the calibrated profile (must hold ``engine.pool``).
    :param engine: an idle live engine (its clock is reset).
    :param workload: requests (lengths already fitting the engine).
    :param buckets: prompt-length buckets (default: quarters of ``max_model_len``).
    :param cap: static per-bucket cap for every bucket (``None``: no admission control).
    :param tick_s: snapshot interval.
    :param drain_s: give up this long after the last arrival.
    :param repeats: live replays; with 2 the report carries the live-vs-live floor.
    """
    if not engine.is_idle():
        raise RuntimeError("run_fidelity needs an idle engine")
    if repeats not in (1, 2):
        raise ValueError(f"repeats must be 1 or 2, got {repeats}")
    m = engine.max_model_len
    buckets = buckets or Buckets((m // 8, m // 4, m // 2))
    n = len(buckets)
    action = ControlAction(caps=(cap,) * n, pools=(engine.pool,) * n)
    budget = engine.config.max_num_batched_tokens
    lives: list[RunOutcome] = []
    for _ in range(repeats):
        engine.set_max_num_seqs(engine.configured_max_num_seqs)
        engine.snapshot()
        engine.clock.reset()
        live_dep = _deployment([engine], buckets, m, engine.block_size, budget, tick_s)
        lives.append(replay(live_dep, workload.requests, action, drain_s=drain_s))
    live = lives[0]
    sim_engine = profile_sim_engine(
        profile, engine.pool, 0, n, max_num_seqs=engine.configured_max_num_seqs,
        max_num_batched_tokens=budget, num_kv_blocks=engine.num_kv_blocks,
        enable_prefix_caching=False)  # as the live engine (rlbatch.engine.vllm.launch)
    sim_dep = _deployment([sim_engine], buckets, m, engine.block_size, budget, tick_s)
    sim = replay(sim_dep, workload.requests, action, drain_s=drain_s)
    report = compare(workload.name, engine.pool, len(workload.requests), live, sim)
    if repeats == 2:
        floor = compare(workload.name, engine.pool, len(workload.requests), live, lives[1])
        report = replace(report, ttft_floor=floor.ttft, e2e_floor=floor.e2e,
                         throughput_floor=floor.throughput_rel_err)
    return report
