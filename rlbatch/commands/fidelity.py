"""``rlbatch fidelity``: the calibrated simulator against a live vLLM engine, request by request.

``python -m rlbatch fidelity --profile PROFILE.json`` (or without ``--profile``: calibrate
first) replays, per pool, each scenario (default: light, knee and overload Poisson traffic at
0.25 / 0.85 / 1.3 times the capacity the calibrated simulator predicts, and a conversation
workload with shared prefixes on an engine with prefix caching:
:mod:`rlbatch.tools.fidelity_scenarios`), plus any trace slice or generator given, on the
live engine and on its simulated stand-in (:func:`rlbatch.tools.fidelity.run_fidelity_models`)
and prints the errors against the live engine's own run-to-run floor. ``--baseline`` also
fits the batch-only step model (profile version 2's) on the same measurements and reports it
beside the full one: before and after the engine-overhead terms, on the same live replays.

``--bracket`` (on when calibrating here) calibrates the same engine again after the replays
and compares the simulator with that calibration too, against the same live replays (model
``after``), and with one fit on both sweeps' iterations (``both``): the live engine's speed
on a shared CPU moves between processes and over minutes, and a verdict that holds under one
calibration and not under the other says so. Every row also charges the step-time model
with the replays' own iterations (``step_time``: the model's total over the measured one),
which separates a calibration that is off from how queueing amplifies it.
``--level-on-warmup`` also runs each profile scaled by one factor to the speed the engine
showed in the workload's unmeasured warm-up replay (``<model>@warm``): the calibrated shape
at the level of the minutes being scored.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlbatch.commands.argtypes import parse_window
from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import add_live_engine_options, live_engine_config_from_args
from rlbatch.engine.vllm import (
    IterationRecord,
    VllmEngine,
    VllmEngineConfig,
    kv_cache_dtype_for_pool,
    start_vllm_engine,
)
from rlbatch.engine.vllm.capability import check_pools
from rlbatch.profiles.calibrated import CalibratedProfile, load_profile, save_profile
from rlbatch.tools.calibrate import calibrate
from rlbatch.tools.calibrate_fit import StepFit, fit_step_model
from rlbatch.tools.fidelity import (
    FidelityReport,
    LiveReplays,
    compare_replays,
    model_label,
    replay_live,
)
from rlbatch.tools.fidelity_outcomes import leveled
from rlbatch.tools.fidelity_scenarios import (
    SCENARIOS,
    Scenario,
    capacity,
    default_trace,
    scale_workload,
    scenario_workload,
)
from rlbatch.workload import Workload, load_trace, resolve_workload

__all__ = ["CALIBRATION_BATCHES", "add_arguments", "register", "run"]

CALIBRATION_BATCHES = [1, 4, 8, 16, 24, 32, 48]
"""Batch sizes of the calibration sweep run here, then the engine's ``max_num_seqs``: the
knee and the overload run batches up to it, where a fit on small batches extrapolates."""


def register(sub: Any) -> None:
    """Add the ``fidelity`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    fi = sub.add_parser("fidelity", help=HELP["fidelity"],
                        description="Per-request TTFT/e2e error, bias, throughput error and "
                                    "preemptions of the simulator against a live vLLM engine "
                                    "at light, knee and overload and on shared prefixes.")
    add_arguments(fi)
    fi.set_defaults(func=run)


def _scenario_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in SCENARIOS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; known: "
                                         f"{', '.join(SCENARIOS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """fidelity's options: the live engine group, the profile, the workloads.

    :param parser: the sub-command's parser.
    """
    add_live_engine_options(parser)
    parser.add_argument("--profile", default=None,
                        help="calibrated profile JSON (default: calibrate first with a small "
                             "sweep; --save-profile keeps it)")
    parser.add_argument("--save-profile", default=None,
                        help="where to write the profile calibrated here")
    parser.add_argument("--baseline", action="store_true",
                        help="also fit the batch-only step model (profile version 2) on the "
                             "same sweep, without the probes, and report it beside the full "
                             "one (needs calibrating here)")
    parser.add_argument("--bracket", action=argparse.BooleanOptionalAction, default=None,
                        help="calibrate the same engine again after the replays and compare "
                             "the simulator with that calibration (model 'after') and with "
                             "one fit on both sweeps (model 'both') too, on the same live "
                             "replays (default: on when calibrating here)")
    parser.add_argument("--level-on-warmup", action="store_true",
                        help="also simulate each profile scaled to the speed the live engine "
                             "showed in the workload's last unmeasured replay (model "
                             "'<model>@warm'; needs --warmup >= 1): tells a calibration whose "
                             "level drifted from one whose shape is off")
    w = parser.add_argument_group("workloads")
    w.add_argument("--scenarios", type=_scenario_list, default=list(SCENARIOS),
                   help=f"scenarios replayed ('' = none; default {','.join(SCENARIOS)}: "
                        f"loads relative to the simulated capacity, and conversations with "
                        f"shared prefixes on an engine with prefix caching)")
    w.add_argument("--trace", default="",
                   help=f"a trace slice replayed too ('' = none; e.g. {default_trace()})")
    w.add_argument("--window", type=parse_window, default=(0.0, 60.0), metavar="START:END",
                   help="trace window in trace seconds (default 0:60)")
    w.add_argument("--rate-scale", type=float, default=4.0,
                   help="time compression of the trace slice (default 4)")
    w.add_argument("--generator", default="",
                   help="a generator spec replayed too ('' = none; e.g. "
                        "poisson:rate=8,duration=20,mix=azure-like)")
    w.add_argument("--prompt-scale", type=float, default=0.25,
                   help="factor on prompt lengths (default 0.25: the Azure trace's prompts "
                        "scaled to the tiny model's context)")
    w.add_argument("--output-scale", type=float, default=1.0,
                   help="factor on output lengths of --trace and --generator (default 1)")
    w.add_argument("--repeats", type=int, choices=(1, 2), default=2,
                   help="measured live replays per workload; 2 (default) also measures the "
                        "live engine's own repeatability, the floor of any simulator's error")
    w.add_argument("--warmup", type=int, default=1,
                   help="unmeasured live replays before those (default 1: the engine has run "
                        "the workload's iteration sizes, as a server that has run a while)")
    w.add_argument("--max-requests", type=int, default=None, help="first N requests only")
    w.add_argument("--tick-s", type=float, default=1.0)
    w.add_argument("--json", default=None, help="write the report rows here")


def _extra_workloads(args: argparse.Namespace, max_model_len: int) -> list[Workload]:
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
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _print_report(rep: FidelityReport, rate: str) -> None:
    met = rep.floor_targets()
    floor_t = rep.ttft_floor.median if rep.ttft_floor else None
    floor_e = rep.e2e_floor.median if rep.e2e_floor else None
    hits = "" if rep.prefix_hit_rate_live is None and rep.prefix_hit_rate_sim is None else (
        f"  prefix hits live/sim {_pct(rep.prefix_hit_rate_live)}/"
        f"{_pct(rep.prefix_hit_rate_sim)}")
    step = "-" if rep.step_time is None else f"{rep.step_time.time_ratio:.3f}"
    print(f"{rep.workload:14s} {rep.pool:4s} {rate:>10s} {rep.model:8s} "
          f"TTFT {rep.ttft.median:6.1%} (floor {_pct(floor_t)}) bias {rep.ttft.median_signed:+6.1%}"
          f" | e2e {rep.e2e.median:6.1%} (floor {_pct(floor_e)}) bias "
          f"{rep.e2e.median_signed:+6.1%} | thr {rep.throughput_rel_err:5.1%} "
          f"(floor {_pct(rep.throughput_floor)}) | preempt {rep.preemptions_live}/"
          f"{rep.preemptions_sim} | step model/live {step} | live TTFT p50 "
          f"{rep.ttft_p50_live_s * 1e3:.1f} ms, e2e p50 "
          f"{rep.e2e_p50_live_s * 1e3:.0f} ms, cpu wait {_pct(rep.live_cpu_wait)}{hits}")
    if met is not None:
        print("    targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}"
                                           for k, v in met.items()))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _calibrate(config: VllmEngineConfig, pool: str, engine: VllmEngine,
               records: dict[str, list[IterationRecord]] | None = None) -> CalibratedProfile:
    return calibrate(config, pools=[pool], batches=[*CALIBRATION_BATCHES, config.max_num_seqs],
                     prompt_lens=[16, 256, 1024], output_lens=[32], engines={pool: engine},
                     log=_stderr, records_out=records)


def _profiles(args: argparse.Namespace, config: VllmEngineConfig, pool: str,
              engine: VllmEngine,
              records: dict[str, list[IterationRecord]]) -> dict[str, CalibratedProfile]:
    """The profile(s) to simulate: loaded, or calibrated on ``engine`` (and with
    ``--baseline`` the batch-only fit of the same measurements); ``records`` is filled with
    the calibration's iterations."""
    if args.profile:
        if args.baseline:
            raise ValueError("--baseline needs calibrating here (no --profile)")
        loaded = load_profile(args.profile)
        return {model_label(loaded, pool): loaded}
    profile = _calibrate(config, pool, engine, records)
    if args.save_profile:
        save_profile(profile, args.save_profile)
    out = {"all": profile}
    if args.baseline:
        # the earlier step model: batch terms only, fitted on the sweep without the probes
        base = _with_fit(profile, pool, fit_step_model(records[f"{pool}:sweep"], terms="batch"))
        out = {"batch": base, **out}
    return out


@dataclass
class _Job:
    """One workload replayed on one engine (its scenario and simulated capacity, if any)."""

    engine: VllmEngine
    workload: Workload
    label: str
    scenario: Scenario | None = None
    cap: float | None = None
    replays: LiveReplays | None = None


def _with_fit(profile: CalibratedProfile, pool: str, fit: StepFit) -> CalibratedProfile:
    """``profile`` with ``pool``'s step-time model replaced by ``fit``."""
    return profile.with_pool(pool, coefficients=fit.coefficients, fit=fit.report,
                             wake=fit.wake, shape_cache=fit.shape_cache)


def _bracket(args: argparse.Namespace, config: VllmEngineConfig, pool: str,
             engine: VllmEngine, jobs: list[_Job],
             before: dict[str, list[IterationRecord]]) -> list[dict[str, Any]]:
    """Calibrate ``engine`` again and compare that calibration (``after``), and one fit on
    both sweeps' iterations (``both``), with the same live replays."""
    _stderr(f"calibrating {pool} again after the replays (--bracket) ...")
    records: dict[str, list[IterationRecord]] = {}
    after = _calibrate(config, pool, engine, records)
    models = {"after": after,
              "both": _with_fit(after, pool, fit_step_model(before[pool] + records[pool]))}
    rows: list[dict[str, Any]] = []
    for job in jobs:
        assert job.replays is not None
        caps = {} if job.scenario is None else {
            label: capacity(p, job.engine, job.scenario, prompt_scale=args.prompt_scale,
                            seed=args.seed) for label, p in models.items()}
        for rep in compare_replays(models, job.engine, job.replays):
            _print_report(rep, job.label)
            rows.append({**rep.to_row(), "rate": job.label,
                         "capacity_sim": caps.get(rep.model)})
        if job.cap is not None and caps:
            _stderr(f"    {job.workload.name}: simulated capacity {job.cap:.2f} before the "
                    f"replays, {caps['after']:.2f} after, {caps['both']:.2f} on both sweeps")
    return rows


def run(args: argparse.Namespace) -> int:
    """Calibrate (or load), replay, compare, report.

    :param args: parsed options of :func:`add_arguments`.
    """
    config = live_engine_config_from_args(args)
    bracket = not args.profile if args.bracket is None else args.bracket
    if bracket and args.profile:
        raise ValueError("--bracket needs calibrating here (no --profile)")
    if args.level_on_warmup and args.warmup < 1:
        raise ValueError("--level-on-warmup needs --warmup >= 1")
    check_pools(args.pools)  # every pool before the first is replayed
    rows: list[dict[str, Any]] = []
    for pool in args.pools:
        pool_config = replace(config, kv_cache_dtype=kv_cache_dtype_for_pool(pool))
        engine = start_vllm_engine(pool_config, pool=pool, num_buckets=4)
        cached: VllmEngine | None = None
        try:
            print(f"{pool} engine ready in {engine.startup_s:.1f} s ({engine.num_kv_blocks} KV "
                  f"blocks of {engine.block_size} tokens)", file=sys.stderr)
            records: dict[str, list[IterationRecord]] = {}
            profiles = _profiles(args, config, pool, engine, records)
            main = profiles[next(reversed(profiles))]
            jobs: list[_Job] = []
            for name in args.scenarios:
                scenario = SCENARIOS[name]
                target = engine
                if scenario.prefix_caching:
                    if cached is None:
                        cached = start_vllm_engine(replace(pool_config,
                                                           enable_prefix_caching=True),
                                                   pool=pool, num_buckets=4)
                    target = cached
                cap = capacity(main, target, scenario, prompt_scale=args.prompt_scale,
                               seed=args.seed)
                rate = scenario.load * cap
                unit = "conv/s" if scenario.prefix_caching else "req/s"
                jobs.append(_Job(target, scenario_workload(
                    scenario, rate, target.max_model_len, prompt_scale=args.prompt_scale,
                    seed=args.seed), f"{rate:.2f} {unit}", scenario, cap))
                _stderr(f"  {name}: capacity {cap:.2f} {unit} (simulated), rate {rate:.2f}")
            jobs += [_Job(engine, w, "-") for w in _extra_workloads(args, engine.max_model_len)]
            for job in jobs:
                job.replays = replay_live(job.engine, job.workload, tick_s=args.tick_s,
                                          repeats=args.repeats, warmup=args.warmup)
                models = dict(profiles)
                if args.level_on_warmup:
                    models |= {f"{k}@warm": lv for k, p in profiles.items()
                               if (lv := leveled(p, pool, job.replays.warmup_iterations))}
                for rep in compare_replays(models, job.engine, job.replays):
                    _print_report(rep, job.label)
                    rows.append({**rep.to_row(), "rate": job.label, "capacity_sim": job.cap})
            if bracket and jobs:
                rows += _bracket(args, config, pool, engine, jobs, records)
        finally:
            engine.close()
            if cached is not None:
                cached.close()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0
