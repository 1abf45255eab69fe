"""``rlbatch evaluate``: every controller on every trace at every rate scale, one row each."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlbatch.commands.argtypes import positive_floats
from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import (
    CONTROLLER_HELP,
    add_deployment_options,
    add_settings_option,
    add_workload_options,
    controllers_from_args,
    deployment_spec_from_args,
)
from rlbatch.scale.cluster import add_ray_option
from rlbatch.tools.evaluate import EvalJob, error_rows, run_jobs
from rlbatch.tools.report import format_table, write_json


def register(sub: Any) -> None:
    """Add the ``evaluate`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    ev = sub.add_parser(
        "evaluate", help=HELP["evaluate"],
        description="Run every controller on every trace at every rate scale on the "
                    "simulator; print a table and write one JSON row per run.")
    ev.add_argument("--trace", nargs="+", required=True,
                    help="trace files (Azure CSV / Mooncake JSONL), generator specs "
                         "(poisson:rate=5,duration=600,mix=night) or scenarios "
                         "(scenario:night, scenario:day:600; rate scale multiplies the load)")
    ev.add_argument("--controllers", default="static:{4,8,16,32},vllm-default",
                    help=f"comma-separated controllers, each {CONTROLLER_HELP}; "
                         f"static:{{8,16}} expands (default static:{{4,8,16,32}},vllm-default)")
    add_settings_option(ev)
    ev.add_argument("--rate-scale", type=positive_floats, default=[1.0],
                    help="comma-separated time-compression factors (2 = twice the rate)")
    ev.add_argument("--json", default=None, help="write the rows to this JSON file")
    ev.add_argument("--jobs", type=int, default=1,
                    help="runs in parallel (processes; not with --ray)")
    add_ray_option(ev, "grid's runs")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    add_deployment_options(ev)
    add_workload_options(ev)
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the grid; print the table; write the rows.

    :param args: parsed options.
    :returns: 0, or 1 when a run failed (``--ray``: its row carries the error).
    """
    names = controllers_from_args(args.controllers, args.settings)
    spec = deployment_spec_from_args(args)
    jobs = [EvalJob(c, t, r, spec, args.window, args.max_requests, args.seed, args.drain_s,
                    args.max_tokens)
            for t in args.trace for r in args.rate_scale for c in names]
    # Live engines run in wall-clock time and share the CPU: one run at a time.
    n_jobs = 1 if args.engine == "vllm" else args.jobs
    if args.ray is not None and args.engine == "vllm":
        raise ValueError("--ray runs simulator grids; a live engine (--engine vllm) runs on "
                         "this machine, one run at a time")
    rows = run_jobs(jobs, n_jobs=n_jobs, quiet=args.quiet, ray=args.ray)
    failures = error_rows(rows)
    print(format_table([r for r in rows if "error" not in r]))
    for r in failures:
        print(f"FAILED ({r['attempts']} attempts): {r['controller']} on {r['trace']} at rate "
              f"{r['rate_scale']:g}: {r['error']}")
    if args.json:
        write_json(Path(args.json), rows)
        print(f"\nwrote {len(rows)} rows to {args.json}")
    return 1 if failures else 0
