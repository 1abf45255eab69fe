"""Relative-error statistics of predictions against measurements: one type for every check.

The calibration fit (:class:`rlbatch.profiles.calibrated.FitReport`), the fidelity check
(:mod:`rlbatch.tools.fidelity`) and ``profile-check`` all report how far a model's numbers
are from measured ones as :class:`RelativeErrors` of ``(predicted - measured) / measured``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["RelativeErrors", "relative_error"]

_TINY = 1e-9
"""Smallest measured value used as a denominator (a 0 s measurement would divide by 0)."""

FloatArray = npt.NDArray[np.float64]


def relative_error(measured: float, predicted: float) -> float:
    """``|predicted - measured| / measured`` of one pair; NaN when ``measured`` is not > 0.

    :param measured: the reference value.
    :param predicted: the model's value.
    """
    return abs(predicted - measured) / measured if measured > 0 else math.nan


@dataclass(frozen=True)
class RelativeErrors:
    """Distribution of per-item relative errors ``|predicted - measured| / measured``.

    :param n: pairs compared (0: every statistic is NaN).
    :param median: median relative error.
    :param p90: its 90th percentile.
    :param p99: its 99th percentile.
    :param max: its maximum.
    :param bias: mean signed error ``(predicted - measured) / measured`` (negative: the
        model is low / fast).
    :param median_signed: median signed error.
    """

    n: int
    median: float
    p90: float
    p99: float
    max: float
    bias: float
    median_signed: float

    @classmethod
    def of(cls, measured: FloatArray | Sequence[float],
           predicted: FloatArray | Sequence[float]) -> RelativeErrors:
        """Errors of ``predicted`` against ``measured`` (paired, same order).

        :param measured: measured values (> 0; smaller ones count as 1e-9).
        :param predicted: predicted values.
        :raises ValueError: the two have different lengths.
        """
        meas = np.asarray(measured, dtype=np.float64)
        pred = np.asarray(predicted, dtype=np.float64)
        if meas.shape != pred.shape:
            raise ValueError(f"measured and predicted differ in shape: {meas.shape} vs "
                             f"{pred.shape}")
        if meas.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
        signed = (pred - meas) / np.maximum(meas, _TINY)
        rel = np.abs(signed)
        return cls(n=int(meas.size), median=float(np.median(rel)),
                   p90=float(np.percentile(rel, 90)), p99=float(np.percentile(rel, 99)),
                   max=float(rel.max()), bias=float(signed.mean()),
                   median_signed=float(np.median(signed)))
