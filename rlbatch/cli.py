"""Command line: ``python -m rlbatch {evaluate,simulate,profile-check}``.

The contract (DESIGN.md) other tools rely on:

* ``evaluate --trace FILE... --controllers static:16,playbook --gpu a100-80g --model llama-2-7b
  --rate-scale 1,2 --json OUT``: one JSON row per (controller, trace, rate_scale);
* ``simulate --trace FILE --controller static:16 --json OUT``: one run, same row fields;
* ``profile-check --gpu a100-80g FILE.csv... --json OUT``: step-time model vs measured timings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from rlbatch.buckets import Buckets
from rlbatch.commands.argtypes import checked, parse_window, positive_floats
from rlbatch.control.controllers import controller_specs, make_controller
from rlbatch.control.types import SLA
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec, parse_pools
from rlbatch.tools.evaluate import EvalJob, load_job_workload, run_job, run_jobs
from rlbatch.tools.report import format_buckets, format_table, write_json


def _add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="the simulator, or real in-process vLLM engines (--model tiny or a "
                        "checkpoint folder; runs in wall-clock time)")
    g.add_argument("--profile", default=None,
                   help="calibrated step-time profile for the simulator (rlbatch calibrate)")
    g.add_argument("--gpu", default="a100-80g",
                   help="GPU profile name or JSON file (a100-80g, h100-80g, h200-141g)")
    g.add_argument("--model", default="llama-2-7b",
                   help="model profile name or JSON file (llama-2-7b, llama-3.1-8b, "
                        "llama-2-70b, deepseek-v3)")
    g.add_argument("--pools", default="fp16", type=checked(parse_pools),
                   help="pools and engines per pool, e.g. fp16 or fp16:1,fp8:1 (default fp16)")
    g.add_argument("--tp", type=int, default=None, help="tensor parallel degree "
                   "(default: the model profile's)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine max_num_seqs (default: vLLM's default for the GPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine token budget per iteration (default: vLLM's for the GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt+output accepted (default: the model's context)")
    g.add_argument("--over-length", choices=("reject", "truncate"), default="reject",
                   help="requests longer than max-model-len: reject (vLLM) or truncate the "
                        "prompt; either way counted")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="per-bucket admission queue bound (default unbounded)")
    g.add_argument("--buckets", type=checked(Buckets.parse), default=Buckets(),
                   help="prompt-length bucket edges in tokens (default 1024,2048,4096)")
    g.add_argument("--no-event-skipping", action="store_true",
                   help="step every iteration (same results, slower; for checking)")
    s = p.add_argument_group("control and SLA")
    s.add_argument("--cold-start", action="store_true",
                   help="runs start right after an engine start: the guard's warm-up ramp "
                        "applies (simulated engines are otherwise warm from t=0)")
    s.add_argument("--tick-s", type=float, default=1.0, help="control interval (engine s)")
    s.add_argument("--sla-ttft-s", type=float, default=2.0, help="TTFT limit per request")
    s.add_argument("--sla-tpot-s", type=float, default=0.1, help="TPOT limit per request")
    s.add_argument("--drain-s", type=float, default=600.0,
                   help="how long after the last arrival a run may go on; what is left "
                        "counts as unfinished")
    w = p.add_argument_group("workload")
    w.add_argument("--window", type=parse_window, default=None, metavar="START:END",
                   help="use only arrivals in [START, END) seconds of the trace")
    w.add_argument("--max-requests", type=int, default=None, help="first N requests only")
    w.add_argument("--seed", type=int, default=0, help="seed for generators and jitter")


def _spec(args: argparse.Namespace) -> DeploymentSpec:
    return DeploymentSpec(
        gpu=args.gpu, model=args.model, pools=args.pools, tp=args.tp,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        buckets=args.buckets,
        admission=AdmissionConfig(over_length=args.over_length,
                                  max_queue_len=args.max_queue_len),
        event_skipping=not args.no_event_skipping,
        sla=SLA(ttft_s=args.sla_ttft_s, tpot_s=args.sla_tpot_s), tick_s=args.tick_s,
        cold_start=args.cold_start, engine=args.engine, profile=args.profile)


def cmd_evaluate(args: argparse.Namespace) -> int:
    names = controller_specs(args.controllers)
    for name in names:  # fail fast on a bad name, before any run
        make_controller(name)
    spec = _spec(args)
    jobs = [EvalJob(c, t, r, spec, args.window, args.max_requests, args.seed, args.drain_s)
            for t in args.trace for r in args.rate_scale for c in names]
    # Live engines run in wall-clock time and share the CPU: one run at a time.
    n_jobs = 1 if args.engine == "vllm" else args.jobs
    rows = run_jobs(jobs, n_jobs=n_jobs, quiet=args.quiet)
    print(format_table(rows))
    if args.json:
        write_json(Path(args.json), rows)
        print(f"\nwrote {len(rows)} rows to {args.json}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    make_controller(args.controller)
    job = EvalJob(args.controller, args.trace, args.rate_scale, _spec(args), args.window,
                  args.max_requests, args.seed, args.drain_s)
    workload = load_job_workload(job)
    with tqdm(total=round(workload.duration_s, 1), unit="sim-s", desc=workload.name,
              file=sys.stderr, disable=args.quiet) as bar:
        row = run_job(job, bar)
    print(format_table([row]))
    print()
    print(format_buckets(row))
    if args.engine == "vllm":
        print(f"\nran {row['sim_seconds']:.0f} s of traffic on live vLLM engines in "
              f"{row['wall_seconds']:.1f} s wall (engine start-up included)")
    else:
        print(f"\nsimulated {row['sim_seconds']:.0f} s in {row['wall_seconds']:.2f} s wall "
              f"({row['speedup_x']:.0f}x real time)")
    if args.json:
        write_json(Path(args.json), row)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlbatch",
        description="rlbatch: batch-size control for LLM serving on vLLM. Simulate and "
                    "evaluate controllers on real traces.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ev = sub.add_parser(
        "evaluate", help="compare controllers on traces at several rate scales",
        description="Run every controller on every trace at every rate scale on the "
                    "simulator; print a table and write one JSON row per run.")
    ev.add_argument("--trace", nargs="+", required=True,
                    help="trace files (Azure CSV / Mooncake JSONL), generator specs "
                         "(poisson:rate=5,duration=600,mix=night) or scenarios "
                         "(scenario:night, scenario:day:600; rate scale multiplies the load)")
    ev.add_argument("--controllers", default="static:{4,8,16,32},vllm-default",
                    help="comma-separated controllers; static:{8,16} expands "
                         "(default static:{4,8,16,32},vllm-default)")
    ev.add_argument("--rate-scale", type=positive_floats, default=[1.0],
                    help="comma-separated time-compression factors (2 = twice the rate)")
    ev.add_argument("--json", default=None, help="write the rows to this JSON file")
    ev.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_run_options(ev)
    ev.set_defaults(func=cmd_evaluate)

    si = sub.add_parser("simulate", help="one controller on one trace",
                        description="Simulate one run and print its row and per-bucket "
                                    "figures.")
    si.add_argument("--trace", required=True, help="trace file or generator spec")
    si.add_argument("--controller", default="static:16", help="controller (default static:16)")
    si.add_argument("--rate-scale", type=float, default=1.0, help="time-compression factor")
    si.add_argument("--json", default=None, help="write the row to this JSON file")
    si.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_run_options(si)
    si.set_defaults(func=cmd_simulate)

    from rlbatch.profiles import check as profile_check_mod

    pc = sub.add_parser("profile-check", help="step-time model vs measured layer timings",
                        description="Predict the per-layer time of the linear ops for every "
                                    "row of vidur-format profiling CSVs and report the error.")
    profile_check_mod.add_arguments(pc)
    pc.set_defaults(func=profile_check_mod.run)

    from rlbatch.tools import calibrate as calibrate_mod
    from rlbatch.tools import fidelity as fidelity_mod

    ca = sub.add_parser("calibrate", help="fit the simulator's step-time model to a live vLLM "
                        "engine", description="Profiling sweep on a live vLLM engine (batch x "
                        "prompt x output lengths), fit of the simulator's step-time model, "
                        "written as a profile file (--profile FILE).")
    calibrate_mod.add_arguments(ca)
    ca.set_defaults(func=calibrate_mod.run)
    fi = sub.add_parser("fidelity", help="replay workloads on the live engine and the "
                        "calibrated simulator", description="Per-request TTFT/e2e error, "
                        "throughput error and preemptions of the simulator against a live "
                        "vLLM engine on the same workloads.")
    fidelity_mod.add_arguments(fi)
    fi.set_defaults(func=fidelity_mod.run)

    from rlbatch.tools import sweep as sweep_mod

    sw = sub.add_parser("sweep", help="throughput-latency sweep over batch x sequence length",
                        description="The tuning guide's benchmark checklist: tokens/s, latency "
                                    "percentiles, KV peak and memory breakdown per (batch, "
                                    "seq_len), plots, and the guide's configurations checked.")
    sweep_mod.add_arguments(sw)
    sw.set_defaults(func=sweep_mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"rlbatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return rc
