"""``profile-check``: the step-time model's linear ops against measured layer timings.

For every row of a vidur-format CSV (any model: the shape is read from the row's own
``n_head``, ``n_kv_head``, ``n_embd``, ``n_expanded_embd``, ``use_gated_mlp`` columns), the
per-layer time of the four GEMMs (``attn_pre_proj + attn_post_proj + mlp_up_proj +
mlp_down_proj``, medians) is predicted with the very GEMM cost the simulator uses
(:func:`~rlbatch.profiles.roofline.linear_op_time_s`) and compared with the measurement.

Command line: ``rlbatch profile-check`` (:mod:`rlbatch.commands.profile_check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rlbatch.profiles.relative_error import RelativeErrors
from rlbatch.profiles.specs import GpuSpec, load_gpu
from rlbatch.profiles.vidur import LINEAR_OPS, predict_linear_ops, read_vidur_csv

__all__ = ["profile_check"]


def _stats(pred: npt.NDArray[np.float64], meas: npt.NDArray[np.float64]) -> dict[str, float]:
    e = RelativeErrors.of(meas, pred)
    return {"median_rel_err": e.median, "p90_rel_err": e.p90, "max_rel_err": e.max,
            "median_signed_err": e.median_signed}


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
