"""``rlbatch profile-fit``: fit a GPU profile's efficiency factors to vidur layer timings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import GPU_HELP
from rlbatch.profiles.fit import fit_gpu_efficiency, write_fit
from rlbatch.profiles.specs import ProfileError


def register(sub: Any) -> None:
    """Add the ``profile-fit`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    pf = sub.add_parser("profile-fit", help=HELP["profile-fit"],
                        description="Fit a GPU's efficiency factors (roofline) to vidur "
                                    "per-layer timing CSVs; optionally write them into a GPU "
                                    "profile JSON.")
    pf.add_argument("--gpu", required=True, help=GPU_HELP)
    pf.add_argument("files", nargs="+", type=Path, metavar="FILE.csv",
                    help="vidur mlp.csv files")
    pf.add_argument("--write", type=Path, default=None, metavar="GPU.json",
                    help="update this GPU profile file with the fitted values")
    pf.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fit, print the factors and the fit error, optionally write the profile.

    :param args: parsed options.
    :returns: process exit status (2 on bad input).
    """
    try:
        result = fit_gpu_efficiency(args.gpu, args.files)
        if args.write is not None:
            write_fit(args.write, result)
    except (ProfileError, OSError) as exc:
        print(f"rlbatch profile-fit: error: {exc}", file=sys.stderr)
        return 2
    print(f"gpu {result.gpu}: {result.rows} rows from {len(result.files)} file(s)")
    for name in ("eff_compute", "eff_mem", "op_overhead_s", "blend_exponent",
                 "eff_elementwise", "elementwise_overhead_s"):
        print(f"  {name:24s} {getattr(result, name):.6g}")
    print(f"  linear ops:  median rel err {result.linear_median_rel_err:.3f}, "
          f"p90 {result.linear_p90_rel_err:.3f}")
    if result.elementwise_median_rel_err is None:
        print("  elementwise: not fitted (columns missing), current values kept")
    else:
        print(f"  elementwise: median rel err {result.elementwise_median_rel_err:.3f}")
    if args.write is not None:
        print(f"wrote {args.write}")
    return 0
