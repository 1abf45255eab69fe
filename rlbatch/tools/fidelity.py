"""Simulator fidelity: replay one workload on a live vLLM engine and on the simulator with
the engine's calibrated profile, and compare request by request.

``python -m rlbatch fidelity --profile PROFILE.json`` (or without ``--profile``: calibrate
first) replays, per pool, each workload given (default: a slice of the Azure conversation
trace and a Poisson generator, lengths scaled to the tiny model's context) through the same
admission layer and control loop on both engines, then reports:

* per-request relative error of TTFT and e2e latency, ``|sim - live| / live``: median, P90
  and P99, plus the mean signed error (bias);
* throughput (output tokens / makespan) of both and its relative error;
* preemptions of both.

Targets (DESIGN): median per-request latency error <= 5 %, P99 <= 10 %, throughput <= 5 %.
What limits them on the CPU engine: step times on a shared 2-core machine jitter by tens of
percent from one iteration to the next (the calibration fits their mean), and a TTFT of one
or two iterations inherits that jitter, while e2e (a sum of many iterations) averages it out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlbatch.buckets import Buckets
from rlbatch.commands.argtypes import parse_window
from rlbatch.control.types import ControlAction
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.vllm_engine import VllmEngine, kv_cache_dtype_for_pool, start_vllm_engine
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import Deployment, assemble_deployment
from rlbatch.tools.calibrate import (
    CalibratedProfile,
    add_engine_arguments,
    calibrate,
    engine_config_from_args,
    load_profile,
    save_profile,
)
from rlbatch.workload import Workload, build_workload, load_trace, resolve_workload

__all__ = [
    "ErrorStats",
    "FidelityReport",
    "PercentileErrors",
    "RunOutcome",
    "add_arguments",
    "compare",
    "default_trace",
    "drive",
    "run",
    "run_fidelity",
    "scale_workload",
]



def default_trace() -> Path:
    """The Azure conversation trace: ``$RLBATCH_TRACES_DIR`` or ``../shared/data/traces``
    beside the repository."""
    folder = os.environ.get("RLBATCH_TRACES_DIR")
    root = Path(folder) if folder else \
        Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
    return root / "azure_conv_2023.csv"

DEFAULT_GENERATOR = "poisson:rate=8,duration=20,mix=azure-like"

TARGETS = {"latency_median": 0.05, "latency_p99": 0.10, "throughput": 0.05}


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ErrorStats:
    """Per-request relative errors ``|sim - live| / live`` of one latency.

    :param median: median.
    :param p90: 90th percentile.
    :param p99: 99th percentile.
    :param bias: mean signed error ``(sim - live) / live`` (negative: the simulator is fast).
    :param n: requests compared.
    """

    median: float
    p90: float
    p99: float
    bias: float
    n: int

    @classmethod
    def of(cls, live: np.ndarray, sim: np.ndarray) -> ErrorStats:
        """Errors of ``sim`` against ``live`` (same order, live > 0).

        :param live: measured values.
        :param sim: simulated values.
        """
        if live.size == 0:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        signed = (sim - live) / np.maximum(live, 1e-9)
        rel = np.abs(signed)
        return cls(float(np.median(rel)), float(np.percentile(rel, 90)),
                   float(np.percentile(rel, 99)), float(signed.mean()), int(live.size))


@dataclass(frozen=True)
class PercentileErrors:
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
    def of(cls, live: np.ndarray, sim: np.ndarray) -> PercentileErrors:
        """Percentiles of both samples (NaN when empty).

        :param live: measured values.
        :param sim: simulated values.
        """
        if live.size == 0 or sim.size == 0:
            nan3 = (math.nan, math.nan, math.nan)
            return cls(nan3, nan3, nan3)
        lv = tuple(float(v) for v in np.percentile(live, [50, 90, 99]))
        sv = tuple(float(v) for v in np.percentile(sim, [50, 90, 99]))
        err = tuple(abs(s - v) / v if v > 0 else math.nan for v, s in zip(lv, sv, strict=True))
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
    ttft: ErrorStats
    e2e: ErrorStats
    tpot: ErrorStats
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
    ttft_pct: PercentileErrors | None = None
    e2e_pct: PercentileErrors | None = None
    ttft_floor: ErrorStats | None = None
    e2e_floor: ErrorStats | None = None
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
                block_size: int, max_num_batched_tokens: int) -> Deployment:
    return assemble_deployment(
        engines, buckets=buckets, admission=AdmissionConfig(), gpu="fidelity",
        model="fidelity", max_model_len=max_model_len, block_size=block_size,
        default_max_num_seqs=engines[0].max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens)


def drive(deployment: Deployment, requests: Sequence[Request], action: ControlAction, *,
          tick_s: float = 1.0, drain_s: float = 120.0,
          on_tick: Callable[[float], None] | None = None) -> RunOutcome:
    """Replay ``requests`` on ``deployment`` under a fixed ``action`` (the runner's loop
    without a controller): run to each tick, snapshot, stop when everything finished or
    ``drain_s`` after the last arrival.

    :param deployment: a fresh deployment (live or simulated).
    :param requests: arrivals, sorted.
    :param action: caps and routes in force throughout.
    :param tick_s: snapshot interval (engine seconds).
    :param drain_s: give up this long after the last arrival.
    :param on_tick: called with the tick time after each snapshot.
    """
    started = time.monotonic()
    deployment.load(requests)
    deployment.apply(action)
    records: list[FinishedRequest] = []
    preemptions = 0
    deadline = deployment.last_arrival_s + drain_s
    tick = 0
    while True:
        tick += 1
        t = tick * tick_s
        deployment.run_until(t)
        for stats in deployment.snapshot():
            records.extend(stats.finished)
            preemptions += stats.preemptions
        records.extend(deployment.admission.rejected)
        deployment.admission.rejected.clear()
        if on_tick is not None:
            on_tick(t)
        if deployment.done() or t >= deadline:
            break
    done = [r for r in records if not r.rejected]
    first = min((r.arrival_s for r in requests), default=0.0)
    last = max((r.finish_s for r in done), default=first)
    return RunOutcome(records, preemptions, last - first,
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

    def pair(attr: str) -> tuple[np.ndarray, np.ndarray]:
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
        completed_sim=len(sim_by_id), ttft=ErrorStats.of(ttft_l, ttft_s),
        e2e=ErrorStats.of(e2e_l, e2e_s), tpot=ErrorStats.of(tpot_l[multi], tpot_s[multi]),
        throughput_live_tok_s=tl, throughput_sim_tok_s=ts,
        throughput_rel_err=abs(ts - tl) / tl if tl > 0 else math.nan,
        preemptions_live=live.preemptions, preemptions_sim=sim.preemptions,
        makespan_live_s=live.makespan_s, makespan_sim_s=sim.makespan_s,
        ttft_p50_live_s=float(np.median(ttft_l)) if ids else math.nan,
        e2e_p50_live_s=float(np.median(e2e_l)) if ids else math.nan, wall_s=live.wall_s,
        ttft_pct=PercentileErrors.of(ttft_l, ttft_s), e2e_pct=PercentileErrors.of(e2e_l, e2e_s))


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
        live_dep = _deployment([engine], buckets, m, engine.block_size, budget)
        lives.append(drive(live_dep, workload.requests, action, tick_s=tick_s,
                           drain_s=drain_s))
    live = lives[0]
    sim_engine = profile.sim_engine(
        engine.pool, 0, n, max_num_seqs=engine.configured_max_num_seqs,
        max_num_batched_tokens=budget, num_kv_blocks=engine.num_kv_blocks)
    sim_dep = _deployment([sim_engine], buckets, m, engine.block_size, budget)
    sim = drive(sim_dep, workload.requests, action, tick_s=tick_s, drain_s=drain_s)
    report = compare(workload.name, engine.pool, len(workload.requests), live, sim)
    if repeats == 2:
        floor = compare(workload.name, engine.pool, len(workload.requests), live, lives[1])
        report = replace(report, ttft_floor=floor.ttft, e2e_floor=floor.e2e,
                         throughput_floor=floor.throughput_rel_err)
    return report


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m rlbatch fidelity``.

    :param parser: the sub-command's parser.
    """
    add_engine_arguments(parser)
    parser.add_argument("--profile", default=None,
                        help="calibrated profile JSON (default: calibrate first with a small "
                             "sweep; --save-profile keeps it)")
    parser.add_argument("--save-profile", default=None,
                        help="where to write the profile calibrated here")
    w = parser.add_argument_group("workloads")
    w.add_argument("--trace", default=str(default_trace()),
                   help="trace file replayed (a slice; '' = none); default the Azure "
                        "conversation trace")
    w.add_argument("--window", type=parse_window, default=(0.0, 60.0), metavar="START:END",
                   help="trace window in trace seconds (default 0:60)")
    w.add_argument("--rate-scale", type=float, default=4.0,
                   help="time compression of the trace slice (default 4)")
    w.add_argument("--generator", default=DEFAULT_GENERATOR,
                   help=f"generator spec replayed too ('' = none; default {DEFAULT_GENERATOR})")
    w.add_argument("--prompt-scale", type=float, default=0.25,
                   help="factor on prompt lengths (default 0.25: the Azure trace's prompts "
                        "scaled to the tiny model's context)")
    w.add_argument("--output-scale", type=float, default=1.0,
                   help="factor on output lengths (default 1)")
    w.add_argument("--repeats", type=int, choices=(1, 2), default=2,
                   help="live replays per workload; 2 (default) also measures the live "
                        "engine's own repeatability, the floor of any simulator's error")
    w.add_argument("--max-requests", type=int, default=None, help="first N requests only")
    w.add_argument("--cap", type=int, default=None,
                   help="static per-bucket cap (default: no admission control)")
    w.add_argument("--tick-s", type=float, default=1.0)
    w.add_argument("--json", default=None, help="write the report rows here")


def _workloads(args: argparse.Namespace, max_model_len: int) -> list[Workload]:
    out: list[Workload] = []
    if args.trace:
        trace = load_trace(args.trace, rate_scale=args.rate_scale, window_s=args.window,
                           seed=args.seed)
        out.append(scale_workload(trace, args.prompt_scale, max_model_len, args.max_requests,
                                  args.output_scale))
    if args.generator:
        gen = resolve_workload(args.generator, args.seed)
        out.append(scale_workload(gen, args.prompt_scale, max_model_len, args.max_requests,
                                  args.output_scale))
    if not out:
        raise ValueError("no workload: give --trace and/or --generator")
    return out


def _print_report(rep: FidelityReport) -> None:
    met = rep.targets_met()
    print(f"{rep.workload} [{rep.pool}]: {rep.completed_live}/{rep.requests} live, "
          f"{rep.completed_sim} simulated; live median TTFT {rep.ttft_p50_live_s * 1e3:.1f} ms, "
          f"e2e {rep.e2e_p50_live_s * 1e3:.1f} ms")
    for label, e in (("TTFT", rep.ttft), ("e2e", rep.e2e), ("TPOT", rep.tpot)):
        print(f"  {label:5s} error: median {e.median:6.1%}  P90 {e.p90:6.1%}  P99 {e.p99:6.1%}"
              f"  bias {e.bias:+6.1%}")
    for label, pct in (("TTFT", rep.ttft_pct), ("e2e", rep.e2e_pct)):
        if pct is not None:
            print(f"  {label:5s} percentiles live/sim: "
                  + "  ".join(f"P{q} {lv * 1e3:.1f}/{sv * 1e3:.1f} ms ({e:.1%})"
                              for q, lv, sv, e in zip((50, 90, 99), pct.live, pct.sim,
                                                      pct.rel_err, strict=True)))
    for label, f in (("TTFT", rep.ttft_floor), ("e2e", rep.e2e_floor)):
        if f is not None:
            print(f"  {label:5s} live-vs-live floor: median {f.median:6.1%}  P90 {f.p90:6.1%}  "
                  f"P99 {f.p99:6.1%}")
    if rep.throughput_floor is not None:
        print(f"  throughput live-vs-live floor: {rep.throughput_floor:.1%}")
    print(f"  throughput: live {rep.throughput_live_tok_s:.0f} tok/s, sim "
          f"{rep.throughput_sim_tok_s:.0f} tok/s, error {rep.throughput_rel_err:.1%}; "
          f"preemptions live {rep.preemptions_live}, sim {rep.preemptions_sim}")
    print("  targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))


def run(args: argparse.Namespace) -> int:
    """``python -m rlbatch fidelity``: calibrate (or load), replay, compare, report.

    :param args: parsed options of :func:`add_arguments`.
    """
    config = engine_config_from_args(args)
    rows: list[dict[str, Any]] = []
    for pool in args.pools:
        engine = start_vllm_engine(replace(config, kv_cache_dtype=kv_cache_dtype_for_pool(pool)),
                                   pool=pool, num_buckets=4)
        try:
            print(f"{pool} engine ready in {engine.startup_s:.1f} s ({engine.num_kv_blocks} KV "
                  f"blocks of {engine.block_size} tokens)", file=sys.stderr)
            if args.profile:
                profile = load_profile(args.profile)
            else:
                profile = calibrate(config, pools=[pool], batches=[1, 4, 16],
                                    prompt_lens=[16, 256, 1024], output_lens=[32],
                                    engines={pool: engine},
                                    log=lambda *a: print(*a, file=sys.stderr))
                if args.save_profile:
                    save_profile(profile, args.save_profile)
            for workload in _workloads(args, engine.max_model_len):
                rep = run_fidelity(profile, engine, workload, cap=args.cap, tick_s=args.tick_s,
                                   repeats=args.repeats)
                _print_report(rep)
                rows.append(rep.to_row())
        finally:
            engine.close()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0
