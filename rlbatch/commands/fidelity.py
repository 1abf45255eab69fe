"""``rlbatch fidelity``: the calibrated simulator against a live vLLM engine, request by request.

``python -m rlbatch fidelity --profile PROFILE.json`` (or without ``--profile``: calibrate
first) replays, per pool, each workload given (default: a slice of the Azure conversation
trace and a Poisson generator, lengths scaled to the tiny model's context) on the live
engine and on its simulated stand-in (:func:`rlbatch.tools.fidelity.run_fidelity`) and prints
the errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlbatch.commands.argtypes import parse_window
from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import add_live_engine_options, live_engine_config_from_args
from rlbatch.engine.vllm import kv_cache_dtype_for_pool, start_vllm_engine
from rlbatch.profiles.calibrated import load_profile, save_profile
from rlbatch.tools.calibrate import calibrate
from rlbatch.tools.fidelity import (
    DEFAULT_GENERATOR,
    FidelityReport,
    default_trace,
    run_fidelity,
    scale_workload,
)
from rlbatch.workload import Workload, load_trace, resolve_workload

__all__ = ["add_arguments", "register", "run"]


def register(sub: Any) -> None:
    """Add the ``fidelity`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    fi = sub.add_parser("fidelity", help=HELP["fidelity"],
                        description="Per-request TTFT/e2e error, throughput error and "
                                    "preemptions of the simulator against a live vLLM engine "
                                    "on the same workloads.")
    add_arguments(fi)
    fi.set_defaults(func=run)


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


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Calibrate (or load), replay, compare, report.

    :param args: parsed options of :func:`add_arguments`.
    """
    config = live_engine_config_from_args(args)
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
                                    log=_stderr)
                if args.save_profile:
                    save_profile(profile, args.save_profile)
            for workload in _workloads(args, engine.max_model_len):
                rep = run_fidelity(profile, engine, workload, tick_s=args.tick_s,
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
