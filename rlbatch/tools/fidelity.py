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
The floor targets hold each scenario to the live engine's own run-to-run floor instead
(:data:`FLOOR_TARGETS`, :meth:`FidelityReport.floor_targets`): median TTFT and e2e error <=
max(5 %, 1.25 x the floor), per-request bias (median of sim / live - 1) within +-5 %,
throughput <= 5 %. What limits them on the CPU engine: step times on a shared 2-core machine
jitter by tens of percent from one iteration to the next (the calibration fits their mean),
and a TTFT of one or two iterations inherits that jitter, while e2e (a sum of many
iterations) averages it out.

With ``repeats=2`` the simulator is compared with both live replays (the pairs pooled), each
simulated run starting from the live engine's state before that replay (the iteration sizes
it has run: :meth:`~rlbatch.engine.sim_exact.ExactScheduler.assume_token_counts`), and the
two live replays with each other (the floor). ``warmup`` replays before them, not measured,
put the live engine in the state of a server that has run a while (vLLM's CPU backend builds
matmul primitives the first time it runs an iteration size).

Command line: ``rlbatch fidelity`` (:mod:`rlbatch.commands.fidelity`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction, DeploymentStats
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.vllm import IterationRecord, VllmEngine
from rlbatch.profiles.calibrated import CalibratedProfile
from rlbatch.profiles.relative_error import RelativeErrors, relative_error
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.builders import profile_sim_engine
from rlbatch.serving.deployment import Deployment, assemble_deployment
from rlbatch.serving.loop import ControlLoop
from rlbatch.tools.fidelity_outcomes import (
    LiveReplays,
    PercentileComparison,
    RunOutcome,
    StepTimeCheck,
    pooled,
    step_time_check,
)
from rlbatch.workload import Workload

__all__ = [
    "FLOOR_TARGETS",
    "TARGETS",
    "FidelityReport",
    "LiveReplays",
    "PercentileComparison",
    "RunOutcome",
    "compare",
    "compare_replays",
    "model_label",
    "replay",
    "replay_live",
    "run_fidelity",
    "run_fidelity_models",
    "simulate",
]



TARGETS = {"latency_median": 0.05, "latency_p99": 0.10, "throughput": 0.05}

FLOOR_TARGETS = {"latency_median": 0.05, "floor_factor": 1.25, "bias": 0.05,
                 "throughput": 0.05}
"""The floor targets: median TTFT / e2e error <= max(latency_median, floor_factor x the
live-vs-live floor), |bias| <= bias, throughput error <= throughput."""

FloatArray = npt.NDArray[np.float64]


# --------------------------------------------------------------------------- results


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
    :param model: which step-time model the simulator ran (``all`` terms, or ``batch``:
        profile version 2's, for comparison).
    :param prefix_hit_rate_live: live prefix-cache hits per prompt token looked up.
    :param prefix_hit_rate_sim: the simulator's (``None``: it looked nothing up).
    :param live_cpu_wait: share of the live replays' iteration time the engine thread waited
        for a CPU (other processes), or ``None``.
    :param step_time: the step-time model charged with the live replays' own iterations
        (how far the calibration is from the live engine's speed during the replays, before
        queueing amplifies it), or ``None``.
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
    model: str = "all"
    prefix_hit_rate_live: float | None = None
    prefix_hit_rate_sim: float | None = None
    live_cpu_wait: float | None = None
    step_time: StepTimeCheck | None = None

    def floor_targets(self) -> dict[str, bool] | None:
        """The floor targets (:data:`FLOOR_TARGETS`), ``None`` without a floor."""
        if self.ttft_floor is None or self.e2e_floor is None:
            return None
        t = FLOOR_TARGETS
        return {
            "ttft_median": self.ttft.median <= max(t["latency_median"],
                                                   t["floor_factor"] * self.ttft_floor.median),
            "e2e_median": self.e2e.median <= max(t["latency_median"],
                                                 t["floor_factor"] * self.e2e_floor.median),
            "bias": max(abs(self.ttft.median_signed), abs(self.e2e.median_signed)) <= t["bias"],
            "throughput": self.throughput_rel_err <= t["throughput"],
        }

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
        row["floor_targets_met"] = self.floor_targets()
        return row


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
    queries = hits = 0
    while True:
        stats = loop.tick()
        for es in stats.engines:  # engines that count their prefix cache (the simulator's)
            queries += getattr(es, "prefix_cache_queries", 0)
            hits += getattr(es, "prefix_cache_hits", 0)
        if on_tick is not None:
            on_tick(stats)
        if loop.finished:
            break
    done = [r for r in loop.records if not r.rejected]
    first = min((r.arrival_s for r in requests), default=0.0)
    last = max((r.finish_s for r in done), default=first)
    return RunOutcome(loop.records, loop.totals.preemptions, last - first,
                      sum(r.output_tokens for r in done), time.monotonic() - started,
                      queries, hits)


def compare(workload: str, pool: str, n_requests: int, live: RunOutcome | Sequence[RunOutcome],
            sim: RunOutcome | Sequence[RunOutcome]) -> FidelityReport:
    """Match requests by id and compute the errors; with several pairs of runs (live ``i``
    against simulated ``i``) the request pairs of all of them are pooled, and throughput is
    total output tokens over total makespan.

    :param workload: workload name.
    :param pool: pool replayed.
    :param n_requests: requests in the workload.
    :param live: the live replay(s).
    :param sim: the simulated replay(s), as many.
    """
    lives = [live] if isinstance(live, RunOutcome) else list(live)
    sims = [sim] if isinstance(sim, RunOutcome) else list(sim)
    if len(lives) != len(sims) or not lives:
        raise ValueError(f"compare needs as many live as simulated runs (>= 1), got "
                         f"{len(lives)} and {len(sims)}")
    pairs: list[tuple[FinishedRequest, FinishedRequest]] = []
    for lv_run, sim_run in zip(lives, sims, strict=True):
        live_by_id = {r.request_id: r for r in lv_run.records if not r.rejected}
        sim_by_id = {r.request_id: r for r in sim_run.records if not r.rejected}
        pairs += [(live_by_id[i], sim_by_id[i])
                  for i in sorted(set(live_by_id) & set(sim_by_id))]
    ids = pairs
    live = pooled(lives)
    sim = pooled(sims)

    def pair(attr: str) -> tuple[FloatArray, FloatArray]:
        lv = np.array([getattr(a, attr) for a, _ in pairs], dtype=np.float64)
        sv = np.array([getattr(b, attr) for _, b in pairs], dtype=np.float64)
        return lv, sv

    ttft_l, ttft_s = pair("ttft_s")
    e2e_l, e2e_s = pair("e2e_s")
    tpot_l, tpot_s = pair("tpot_s")
    multi = tpot_l > 0
    tl, ts = live.throughput_tok_s, sim.throughput_tok_s
    return FidelityReport(
        workload=workload, pool=pool, requests=n_requests,
        completed_live=sum(1 for r in lives[0].records if not r.rejected),
        completed_sim=sum(1 for r in sims[0].records if not r.rejected),
        ttft=RelativeErrors.of(ttft_l, ttft_s),
        e2e=RelativeErrors.of(e2e_l, e2e_s),
        tpot=RelativeErrors.of(tpot_l[multi], tpot_s[multi]),
        throughput_live_tok_s=tl, throughput_sim_tok_s=ts,
        throughput_rel_err=relative_error(tl, ts),
        preemptions_live=live.preemptions, preemptions_sim=sim.preemptions,
        makespan_live_s=live.makespan_s, makespan_sim_s=sim.makespan_s,
        ttft_p50_live_s=float(np.median(ttft_l)) if ids else math.nan,
        e2e_p50_live_s=float(np.median(e2e_l)) if ids else math.nan, wall_s=live.wall_s,
        ttft_pct=PercentileComparison.of(ttft_l, ttft_s),
        e2e_pct=PercentileComparison.of(e2e_l, e2e_s),
        prefix_hit_rate_live=live.prefix_hit_rate, prefix_hit_rate_sim=sim.prefix_hit_rate)


def run_fidelity(profile: CalibratedProfile, engine: VllmEngine, workload: Workload, *,
                 buckets: Buckets | None = None, cap: int | None = None,
                 tick_s: float = 1.0, drain_s: float = 120.0,
                 repeats: int = 1, warmup: int = 0) -> FidelityReport:
    """Replay ``workload`` on the live ``engine`` and on its simulated stand-in
    (:func:`run_fidelity_models` with this one profile).

    :param profile: the calibrated profile (must hold ``engine.pool``).
    :param engine: an idle live engine (its clock is reset).
    :param workload: requests (lengths already fitting the engine).
    :param buckets: prompt-length buckets (default: quarters of ``max_model_len``).
    :param cap: static per-bucket cap for every bucket (``None``: no admission control).
    :param tick_s: snapshot interval.
    :param drain_s: give up this long after the last arrival.
    :param repeats: live replays; with 2 the report carries the live-vs-live floor.
    :param warmup: live replays before those, not measured.
    """
    return run_fidelity_models({model_label(profile, engine.pool): profile}, engine, workload,
                               buckets=buckets, cap=cap, tick_s=tick_s, drain_s=drain_s,
                               repeats=repeats, warmup=warmup)[0]


def model_label(profile: CalibratedProfile, pool: str) -> str:
    """``all`` for a profile with engine overheads (version 3), ``batch`` without."""
    return "all" if profile.step_time_model(pool).overheads() is not None else "batch"


def run_fidelity_models(profiles: Mapping[str, CalibratedProfile], engine: VllmEngine,
                        workload: Workload, *, buckets: Buckets | None = None,
                        cap: int | None = None, tick_s: float = 1.0, drain_s: float = 120.0,
                        repeats: int = 1, warmup: int = 0) -> list[FidelityReport]:
    """Replay ``workload`` on the live ``engine`` (``warmup`` times unmeasured, then
    ``repeats`` times) and on the simulator with each profile, starting each simulated run
    from the live engine's state before the live replay it is compared with.

    :param profiles: label -> calibrated profile (each must hold ``engine.pool``).
    :param engine: an idle live engine (its clock is reset).
    :param workload: requests (lengths already fitting the engine).
    :param buckets: prompt-length buckets (default: quarters of ``max_model_len``).
    :param cap: static per-bucket cap for every bucket (``None``: no admission control).
    :param tick_s: snapshot interval.
    :param drain_s: give up this long after the last arrival.
    :param repeats: measured live replays; with 2 each report carries the live-vs-live floor.
    :param warmup: live replays before those, not measured.
    :returns: one report per profile, in order.
    """
    return compare_replays(profiles, engine,
                           replay_live(engine, workload, buckets=buckets, cap=cap,
                                       tick_s=tick_s, drain_s=drain_s, repeats=repeats,
                                       warmup=warmup))


def replay_live(engine: VllmEngine, workload: Workload, *, buckets: Buckets | None = None,
                cap: int | None = None, tick_s: float = 1.0, drain_s: float = 120.0,
                repeats: int = 1, warmup: int = 0) -> LiveReplays:
    """Replay ``workload`` on the live ``engine``: ``warmup`` times unmeasured, then
    ``repeats`` times measured (parameters as :func:`run_fidelity_models`)."""
    if not engine.is_idle():
        raise RuntimeError("replay_live needs an idle engine")
    if repeats not in (1, 2):
        raise ValueError(f"repeats must be 1 or 2, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    m = engine.max_model_len
    buckets = buckets or Buckets((m // 8, m // 4, m // 2))
    n = len(buckets)
    action = ControlAction(caps=(cap,) * n, pools=(engine.pool,) * n)
    budget = engine.config.max_num_batched_tokens
    lives: list[RunOutcome] = []
    shapes: list[tuple[int, ...]] = []
    iterations: list[IterationRecord] = []
    warm: list[IterationRecord] = []
    for k in range(warmup + repeats):
        engine.set_max_num_seqs(engine.configured_max_num_seqs)
        engine.snapshot()
        engine.clock.reset()
        before = engine.token_counts()
        queries, hits = engine.prefix_cache_totals()
        engine.start_recording()
        live_dep = _deployment([engine], buckets, m, engine.block_size, budget, tick_s)
        outcome = replay(live_dep, workload.requests, action, drain_s=drain_s)
        records = engine.stop_recording()
        if k < warmup:
            warm = records
            continue
        iterations += records
        q, h = engine.prefix_cache_totals()
        lives.append(replace(outcome, prefix_queries=q - queries, prefix_hits=h - hits))
        shapes.append(before)
    return LiveReplays(workload.name, engine.pool, tuple(workload.requests), buckets, cap,
                       tick_s, drain_s, tuple(lives), tuple(shapes), tuple(iterations),
                       tuple(warm))


def compare_replays(profiles: Mapping[str, CalibratedProfile], engine: VllmEngine,
                    replays: LiveReplays) -> list[FidelityReport]:
    """Run the simulator with each profile against the live ``replays`` of ``engine``
    (each simulated run from the engine's state before the replay it is compared with).

    :param profiles: label -> calibrated profile (each must hold ``engine.pool``).
    :param engine: the live engine replayed (its pool, KV blocks and budgets).
    :param replays: its measured replays (:func:`replay_live`).
    :returns: one report per profile, in order.
    """
    lives = replays.outcomes
    floor = compare(replays.workload, replays.pool, len(replays.requests), lives[0], lives[1]) \
        if len(lives) == 2 else None
    reports = []
    for label, profile in profiles.items():
        sims = [simulate(profile, engine, replays.requests, buckets=replays.buckets,
                         cap=replays.cap, tick_s=replays.tick_s, drain_s=replays.drain_s,
                         token_counts=seen) for seen in replays.token_counts]
        report = replace(compare(replays.workload, replays.pool, len(replays.requests), lives,
                                 sims), model=label, live_cpu_wait=replays.cpu_wait,
                         step_time=step_time_check(profile, replays.pool, replays.iterations))
        if floor is not None:
            report = replace(report, ttft_floor=floor.ttft, e2e_floor=floor.e2e,
                             throughput_floor=floor.throughput_rel_err)
        reports.append(report)
    return reports


def simulate(profile: CalibratedProfile, engine: VllmEngine, requests: Sequence[Request], *,
             buckets: Buckets | None = None, cap: int | None = None, tick_s: float = 1.0,
             drain_s: float = 120.0,
             token_counts: Sequence[int] = ()) -> RunOutcome:
    """Replay ``requests`` on the simulated stand-in of the live ``engine`` (its pool, KV
    blocks, budgets and block size; not run): as :func:`run_fidelity_models` does.

    :param profile: the calibrated profile (must hold ``engine.pool``).
    :param engine: the live engine the simulator stands in for.
    :param requests: arrivals, sorted.
    :param buckets: prompt-length buckets (default: quarters of ``max_model_len``).
    :param cap: static per-bucket cap for every bucket (``None``: no admission control).
    :param tick_s: snapshot interval.
    :param drain_s: give up this long after the last arrival.
    :param token_counts: iteration sizes the simulated engine has run already, least
        recently run first.
    """
    m = engine.max_model_len
    buckets = buckets or Buckets((m // 8, m // 4, m // 2))
    n = len(buckets)
    budget = engine.config.max_num_batched_tokens
    sim_engine = profile_sim_engine(
        profile, engine.pool, 0, n, max_num_seqs=engine.configured_max_num_seqs,
        max_num_batched_tokens=budget, num_kv_blocks=engine.num_kv_blocks,
        enable_prefix_caching=engine.config.enable_prefix_caching)  # as the live engine
    sim_engine.assume_token_counts(token_counts)
    sim_dep = _deployment([sim_engine], buckets, m, engine.block_size, budget, tick_s)
    action = ControlAction(caps=(cap,) * n, pools=(engine.pool,) * n)
    return replay(sim_dep, requests, action, drain_s=drain_s)
