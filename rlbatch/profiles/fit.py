"""Fit a GPU's efficiency factors to measured operator timings (vidur CSVs).

Linear ops: ``eff_compute``, ``eff_mem``, ``op_overhead_s`` and ``blend_exponent`` of
:func:`~rlbatch.profiles.roofline.roofline_time_s` are fitted JOINTLY over every row and
every GEMM (QKV, out-proj, MLP up, MLP down) of every given file, i.e. over several models and
TP degrees at once, so the factors describe the GPU rather than one model. The residual is
the log of predicted / measured time (a relative error, symmetric in over/under-prediction),
minimised with :func:`scipy.optimize.least_squares` under a soft-L1 loss (scale 0.1) so that
the few kernels cuBLAS picks badly do not drag the fit. Elementwise kernels (RMSNorm, rope,
activation) get their own two-parameter fit (``eff_elementwise``, ``elementwise_overhead_s``).

Command line: ``rlbatch profile-fit`` (:mod:`rlbatch.commands.profile_fit`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rlbatch.profiles.roofline import elementwise_time_s
from rlbatch.profiles.specs import Efficiency, GpuSpec, ProfileError, load_gpu
from rlbatch.profiles.vidur import (
    ELEMENTWISE_OPS,
    LINEAR_OPS,
    VidurTable,
    elementwise_bytes,
    predict_linear_ops,
    read_vidur_csv,
)

__all__ = ["FitResult", "fit_gpu_efficiency", "write_fit"]

_MIN_EFF, _MAX_EFF = 0.05, 1.0
_MIN_OVERHEAD_S, _MAX_OVERHEAD_S = 1e-8, 1e-3
_MAX_BLEND = 64.0


@dataclass(frozen=True, slots=True)
class FitResult:
    """Fitted efficiency parameters of one GPU and how well they fit.

    :param gpu: GPU profile name.
    :param files: the CSV files fitted (as given).
    :param rows: CSV rows used (each contributes one residual per op).
    :param eff_compute: fitted fraction of peak FLOP/s of GEMMs.
    :param eff_mem: fitted fraction of HBM bandwidth of GEMMs.
    :param op_overhead_s: fitted per-GEMM overhead, seconds.
    :param blend_exponent: fitted smooth-roofline exponent.
    :param eff_elementwise: fitted fraction of HBM bandwidth of elementwise kernels.
    :param elementwise_overhead_s: fitted per-elementwise-kernel overhead, seconds.
    :param linear_median_rel_err: median |pred/meas - 1| over all rows and GEMMs.
    :param linear_p90_rel_err: its 90th percentile.
    :param elementwise_median_rel_err: median |pred/meas - 1| of the elementwise kernels;
        ``None`` when the files lack their columns (the GPU's current values are kept).
    """

    gpu: str
    files: tuple[str, ...]
    rows: int
    eff_compute: float
    eff_mem: float
    op_overhead_s: float
    blend_exponent: float
    eff_elementwise: float
    elementwise_overhead_s: float
    linear_median_rel_err: float
    linear_p90_rel_err: float
    elementwise_median_rel_err: float | None

    def efficiency(self, base: Efficiency) -> Efficiency:
        """``base`` with the fitted fields replaced (attention / all-reduce kept).

        :param base: the GPU's current efficiency parameters.
        """
        return dataclasses.replace(
            base, eff_compute=self.eff_compute, eff_mem=self.eff_mem,
            op_overhead_s=self.op_overhead_s, blend_exponent=self.blend_exponent,
            eff_elementwise=self.eff_elementwise,
            elementwise_overhead_s=self.elementwise_overhead_s)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


def _with_eff(gpu: GpuSpec, **changes: float) -> GpuSpec:
    return dataclasses.replace(gpu, efficiency=dataclasses.replace(gpu.efficiency, **changes))


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def fit_gpu_efficiency(gpu: GpuSpec | str, csv_paths: Sequence[Path | str]) -> FitResult:
    """Fit ``gpu``'s efficiency factors to vidur timing CSVs measured on that GPU.

    The elementwise pair is fitted only when every file has the norm / rope / activation
    columns; otherwise the GPU's current elementwise values are returned unchanged.

    :param gpu: GPU profile (or its name / JSON path); its peak FLOP/s and bandwidth are used,
        its current efficiency is only the starting point.
    :param csv_paths: vidur ``mlp.csv`` files of one or more models on that GPU.
    :raises ProfileError: no files, or a file is missing / lacks a column.
    """
    spec = load_gpu(gpu) if isinstance(gpu, str) else gpu
    if not csv_paths:
        raise ProfileError("fit needs at least one CSV file")
    # scipy costs ~0.4 s to import; only the fit needs it, not every command-line start.
    from scipy.optimize import least_squares

    tables: list[VidurTable] = [read_vidur_csv(p, LINEAR_OPS) for p in csv_paths]
    try:  # the elementwise fit needs those columns in every file; else keep current values
        ew_tables: list[VidurTable] | None = [read_vidur_csv(p, ELEMENTWISE_OPS)
                                              for p in csv_paths]
    except ProfileError:
        ew_tables = None
    measured_lin = np.concatenate([t.times_s[op] for t in tables for op in LINEAR_OPS])

    # fitted values rounded to 4 significant digits: the errors reported are those of the
    # rounded numbers the JSON file will hold
    def unpack(theta: npt.NDArray[np.float64]) -> dict[str, float]:
        return {"eff_compute": _round(math.exp(theta[0])),
                "eff_mem": _round(math.exp(theta[1])),
                "op_overhead_s": _round(math.exp(theta[2])),
                "blend_exponent": _round(1.0 + math.exp(theta[3]))}

    def lin_pred(params: dict[str, float]) -> npt.NDArray[np.float64]:
        g = _with_eff(spec, **params)
        preds = [predict_linear_ops(t, g) for t in tables]
        return np.concatenate([p[op] for p in preds for op in LINEAR_OPS])

    def lin_resid(theta: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        g = _with_eff(spec, eff_compute=math.exp(theta[0]), eff_mem=math.exp(theta[1]),
                      op_overhead_s=math.exp(theta[2]),
                      blend_exponent=1.0 + math.exp(theta[3]))
        preds = [predict_linear_ops(t, g) for t in tables]
        pred = np.concatenate([p[op] for p in preds for op in LINEAR_OPS])
        return np.asarray(np.log(pred / measured_lin), dtype=np.float64)

    eff0 = spec.efficiency
    x0 = np.array([math.log(min(max(eff0.eff_compute, 0.1), 0.99)),
                   math.log(min(max(eff0.eff_mem, 0.1), 0.99)),
                   math.log(min(max(eff0.op_overhead_s, 1e-7), 1e-4)),
                   math.log(max(eff0.blend_exponent - 1.0, 0.01))])
    lo = [math.log(_MIN_EFF), math.log(_MIN_EFF), math.log(_MIN_OVERHEAD_S), math.log(1e-3)]
    hi = [math.log(_MAX_EFF), math.log(_MAX_EFF), math.log(_MAX_OVERHEAD_S),
          math.log(_MAX_BLEND - 1.0)]
    lin = least_squares(lin_resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1)
    lin_params = unpack(lin.x)
    lin_rel = np.abs(lin_pred(lin_params) / measured_lin - 1.0)

    eff_ew, ew_oh = eff0.eff_elementwise, eff0.elementwise_overhead_s
    ew_err: float | None = None
    if ew_tables is not None:
        ew_bytes = np.concatenate([elementwise_bytes(t)[op] for t in ew_tables
                                   for op in ELEMENTWISE_OPS])
        measured_ew = np.concatenate([t.times_s[op] for t in ew_tables
                                      for op in ELEMENTWISE_OPS])

        def ew_pred(eff: float, overhead: float) -> npt.NDArray[np.float64]:
            g = _with_eff(spec, eff_elementwise=eff, elementwise_overhead_s=overhead)
            return elementwise_time_s(ew_bytes, g)

        def ew_resid(theta: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
            pred = ew_pred(math.exp(theta[0]), math.exp(theta[1]))
            return np.asarray(np.log(pred / measured_ew), dtype=np.float64)

        ew = least_squares(ew_resid, np.array([math.log(0.5), math.log(2e-6)]),
                           bounds=([math.log(_MIN_EFF), math.log(_MIN_OVERHEAD_S)],
                                   [math.log(_MAX_EFF), math.log(_MAX_OVERHEAD_S)]),
                           loss="soft_l1", f_scale=0.1)
        eff_ew, ew_oh = _round(math.exp(ew.x[0])), _round(math.exp(ew.x[1]))
        ew_err = float(np.median(np.abs(ew_pred(eff_ew, ew_oh) / measured_ew - 1.0)))

    return FitResult(
        gpu=spec.name,
        files=tuple(str(p) for p in csv_paths),
        rows=sum(len(t) for t in tables),
        eff_elementwise=eff_ew,
        elementwise_overhead_s=ew_oh,
        linear_median_rel_err=float(np.median(lin_rel)),
        linear_p90_rel_err=float(np.percentile(lin_rel, 90)),
        elementwise_median_rel_err=ew_err,
        **lin_params,
    )


def write_fit(json_path: Path | str, result: FitResult) -> None:
    """Write fitted values into a GPU profile JSON file (other fields kept) and record the
    fit's provenance under ``"fit"``. The file is re-validated before it is written.

    :param json_path: the GPU profile to update.
    :param result: the fit.
    """
    path = Path(json_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("efficiency"), dict):
        raise ProfileError(f"{path}: not a GPU profile (no 'efficiency' object)")
    base = GpuSpec.from_dict(data, str(path), path.stem)
    data["efficiency"] = result.efficiency(base.efficiency).to_dict()
    data["fit"] = {
        "method": "rlbatch.profiles.fit: scipy least_squares, soft-L1 on log(pred/measured), "
                  "all rows x {QKV, out-proj, MLP up, MLP down} jointly",
        "files": [Path(f).name for f in result.files],
        "rows": result.rows,
        "linear_median_rel_err": round(result.linear_median_rel_err, 4),
        "linear_p90_rel_err": round(result.linear_p90_rel_err, 4),
    }
    if result.elementwise_median_rel_err is not None:
        data["fit"]["elementwise_median_rel_err"] = round(result.elementwise_median_rel_err, 4)
    else:
        data["fit"]["elementwise"] = "not fitted (columns missing); previous values kept"
    GpuSpec.from_dict(data, str(path), path.stem)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
