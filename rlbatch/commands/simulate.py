"""``rlbatch simulate``: one controller on one trace, its row and per-bucket figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import (
    CONTROLLER_HELP,
    add_deployment_options,
    add_settings_option,
    add_workload_options,
    controllers_from_args,
    deployment_spec_from_args,
)
from rlbatch.tools.evaluate import EvalJob, load_job_workload, run_job
from rlbatch.tools.report import format_buckets, format_table, write_json


def register(sub: Any) -> None:
    """Add the ``simulate`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    si = sub.add_parser("simulate", help=HELP["simulate"],
                        description="Simulate one run and print its row and per-bucket "
                                    "figures.")
    si.add_argument("--trace", required=True, help="trace file or generator spec")
    si.add_argument("--controller", default="static:16",
                    help=f"the controller: {CONTROLLER_HELP} (default static:16)")
    add_settings_option(si)
    si.add_argument("--rate-scale", type=float, default=1.0, help="time-compression factor")
    si.add_argument("--json", default=None, help="write the row to this JSON file")
    si.add_argument("--quiet", action="store_true", help="no progress bar")
    add_deployment_options(si)
    add_workload_options(si)
    si.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run once; print the row, the per-bucket table and the speed.

    :param args: parsed options.
    """
    (controller,) = controllers_from_args(args.controller, args.settings)
    job = EvalJob(controller, args.trace, args.rate_scale, deployment_spec_from_args(args),
                  args.window, args.max_requests, args.seed, args.drain_s, args.max_tokens)
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
