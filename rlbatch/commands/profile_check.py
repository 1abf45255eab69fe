"""``rlbatch profile-check``: the step-time model against measured vidur layer timings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import GPU_HELP
from rlbatch.profiles.check import profile_check
from rlbatch.profiles.specs import ProfileError
from rlbatch.profiles.vidur import LINEAR_OPS


def register(sub: Any) -> None:
    """Add the ``profile-check`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    pc = sub.add_parser("profile-check", help=HELP["profile-check"],
                        description="Predict the per-layer time of the linear ops for every "
                                    "row of vidur-format profiling CSVs and report the error.")
    add_arguments(pc)
    pc.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """profile-check's options.

    :param parser: the (sub)parser to extend.
    """
    parser.add_argument("--gpu", required=True,
                        help=f"GPU profile the files were measured on ({GPU_HELP})")
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE.csv",
                        help="vidur-format per-layer timing CSVs")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="write the per-file results as a JSON list to OUT")
    parser.add_argument("--max-median-rel-err", type=float, default=None, metavar="X",
                        help="exit with status 1 if any file's median relative error > X")


def _format_table(results: list[dict[str, Any]]) -> str:
    head = f"{'file':44s} {'rows':>5s} {'median':>7s} {'p90':>7s} {'max':>7s} {'bias':>7s}  " \
        + " ".join(f"{op[:13]:>13s}" for op in LINEAR_OPS)
    lines = [head, "-" * len(head)]
    for r in results:
        name = Path(r["file"]).name
        name = name if len(name) <= 44 else "..." + name[-41:]
        ops = " ".join(f"{r['per_op'][op]['median_rel_err']:13.3f}" for op in LINEAR_OPS)
        lines.append(f"{name:44s} {r['rows']:5d} {r['median_rel_err']:7.3f} "
                     f"{r['p90_rel_err']:7.3f} {r['max_rel_err']:7.3f} "
                     f"{r['median_signed_err']:+7.3f}  {ops}")
    lines.append("(relative error |pred/measured - 1| of the per-layer sum of the four GEMMs; "
                 "bias: median signed error; op columns: per-op median)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run profile-check; print a table, optionally write JSON.

    :param args: parsed options of :func:`add_arguments`.
    :returns: 0 on success, 1 if ``--max-median-rel-err`` is exceeded, 2 on bad input.
    """
    try:
        results = profile_check(args.gpu, list(args.files))
    except (ProfileError, OSError) as exc:
        print(f"rlbatch profile-check: error: {exc}", file=sys.stderr)
        return 2
    gpu = results[0]["gpu"] if results else args.gpu
    print(f"profile-check on {gpu}")
    print(_format_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    limit = args.max_median_rel_err
    if limit is not None and any(r["median_rel_err"] > limit for r in results):
        print(f"FAILED: median relative error above {limit}", file=sys.stderr)
        return 1
    return 0
