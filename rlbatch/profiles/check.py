"""``profile-check``: the step-time model's linear ops against measured layer timings.

For every row of a vidur-format CSV (any model: the shape is read from the row's own
``n_head``, ``n_kv_head``, ``n_embd``, ``n_expanded_embd``, ``use_gated_mlp`` columns), the
per-layer time of the four GEMMs (``attn_pre_proj + attn_post_proj + mlp_up_proj +
mlp_down_proj``, medians) is predicted with the very GEMM cost the simulator uses
(:func:`~rlbatch.profiles.step_time.linear_op_time_s`) and compared with the measurement.

Command line (the project CLI exposes it as ``python -m rlbatch profile-check``; stand-alone
it is ``python -m rlbatch.profiles check``)::

    python -m rlbatch.profiles check --gpu a100-80g FILE.csv [FILE.csv ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rlbatch.profiles.specs import GpuSpec, ProfileError, load_gpu
from rlbatch.profiles.vidur import LINEAR_OPS, predict_linear_ops, read_vidur_csv

__all__ = ["add_arguments", "profile_check", "profile_check_main", "run"]


def _stats(pred: npt.NDArray[np.float64], meas: npt.NDArray[np.float64]) -> dict[str, float]:
    ratio = pred / meas
    rel = np.abs(ratio - 1.0)
    return {
        "median_rel_err": float(np.median(rel)),
        "p90_rel_err": float(np.percentile(rel, 90)),
        "max_rel_err": float(np.max(rel)),
        "median_signed_err": float(np.median(ratio - 1.0)),
    }


def profile_check(gpu: GpuSpec | str, csv_paths: Sequence[Path | str]) -> list[dict[str, Any]]:
    """Compare predicted and measured per-layer linear-op time for each CSV file.

    :param gpu: GPU profile the files were measured on (or its name / JSON path).
    :param csv_paths: vidur-format timing CSVs.
    :returns: one dict per file: ``file``, ``gpu``, ``rows``, ``shapes`` (model shapes and TP
        degrees found), ``median_rel_err``, ``p90_rel_err``, ``max_rel_err``,
        ``median_signed_err`` (positive: model too slow) of the four-op sum, and ``per_op``:
        the same statistics for each op alone. Relative error is ``|pred / measured - 1|``.
    :raises ProfileError: unknown GPU, missing file, missing column (named) or bad value.
    """
    spec = load_gpu(gpu) if isinstance(gpu, str) else gpu
    results: list[dict[str, Any]] = []
    for path in csv_paths:
        table = read_vidur_csv(path, LINEAR_OPS)
        preds = predict_linear_ops(table, spec)
        pred_total = np.sum([preds[op] for op in LINEAR_OPS], axis=0)
        meas_total = np.sum([table.times_s[op] for op in LINEAR_OPS], axis=0)
        shapes = sorted({f"heads={k[0]} kv_heads={k[1]} hidden={k[2]} ff={k[3]} "
                         f"gated={k[4]}" for k, _ in table.shape_groups()})
        row: dict[str, Any] = {
            "file": str(path),
            "gpu": spec.name,
            "rows": len(table),
            "shapes": shapes,
            "tp": sorted({int(x) for x in table.tp}),
            **_stats(pred_total, meas_total),
            "per_op": {op: _stats(preds[op], table.times_s[op]) for op in LINEAR_OPS},
        }
        results.append(row)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add profile-check's arguments to ``parser`` (for the project CLI's subcommand).

    :param parser: the (sub)parser to extend.
    """
    parser.add_argument("--gpu", required=True,
                        help="GPU profile the files were measured on (name or JSON path)")
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
    """Run profile-check with parsed arguments; print a table, optionally write JSON.

    :param args: namespace from a parser built with :func:`add_arguments`.
    :returns: 0 on success, 1 if ``--max-median-rel-err`` is exceeded, 2 on bad input.
    """
    try:
        results = profile_check(args.gpu, list(args.files))
    except (ProfileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
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


def profile_check_main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``--gpu NAME FILE.csv [FILE.csv ...] [--json OUT]``.

    :param argv: arguments (default ``sys.argv[1:]``).
    :returns: process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="profile-check",
        description="Compare the step-time model's linear-op times with measured vidur "
                    "per-layer timings.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
