"""The calibration fit: the step-time model's coefficients from measured live iterations.

:func:`fit_step_model` fits :class:`~rlbatch.profiles.calibrated.StepCoefficients` by
iteratively reweighted non-negative least squares on the relative error (weights 1 /
predicted time, so the fit is unbiased in the mean: the simulator sums iterations, and CPU
step times have a long right tail), after dropping stalls (> 5x the model); the wake-up's
shape and the size of the engine's matmul primitive cache by a grid search around it.
The sweep's probes (:func:`rlbatch.tools.calibrate.run_sweep`) give the rows that tell those
overheads from the prefill's own cost: prefills of sizes cached, dropped and never run, after
idle waits of every length. :mod:`rlbatch.tools.calibrate` runs the sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rlbatch.engine.vllm import IterationRecord
from rlbatch.profiles.calibrated import (
    FitReport,
    StepCoefficients,
    WakeShape,
    shape_miss,
    step_features,
    wake_penalty_s,
)
from rlbatch.profiles.relative_error import RelativeErrors

__all__ = [
    "BATCH_TERMS",
    "SHAPE_CACHES",
    "WAKE_COLUMN",
    "WAKE_DECAYS",
    "WAKE_TAUS_S",
    "StepFit",
    "fit_step_model",
    "predict_durations",
]

FloatArray = npt.NDArray[np.float64]

WAKE_DECAYS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
WAKE_TAUS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
"""The grid the wake-up's shape is chosen from."""

BATCH_TERMS = 7
"""The first coefficients, which depend on the batch alone (profile version 2's model)."""

WAKE_COLUMN = 9
"""Index of ``wake_s`` among the coefficients."""


SHAPE_CACHES = (0, 64, 128, 256, 512, 1024)
"""Sizes of the matmul primitive cache (iteration sizes kept, LRU; 0: all) the fit chooses
from."""



def _durations(records: Sequence[IterationRecord]) -> FloatArray:
    return np.array([r.end_s - r.prev_end_s for r in records], dtype=np.float64)


def _design(records: Sequence[IterationRecord], shape_cache: int = 0) -> FloatArray:
    """Regressors of every record, the wake column 0 (:func:`_wake_column` fills it), sizes
    missing from an LRU of ``shape_cache`` sizes as new."""
    return np.array([step_features(r.num_prefill_tokens, r.prefill_attn_work,
                                   r.num_decode_seqs, r.decode_kv_tokens, r.num_new_seqs,
                                   r.num_finished, 0.0,
                                   shape_miss(r.shape_distance, shape_cache),
                                   r.shape_distance < 0)
                     for r in records], dtype=np.float64)


def _wake_column(records: Sequence[IterationRecord], shape: WakeShape) -> FloatArray:
    return np.array([wake_penalty_s(1.0, shape, r.idle_s, r.since_wake) for r in records],
                    dtype=np.float64)


def predict_durations(records: Sequence[IterationRecord], coefficients: StepCoefficients,
                      wake: WakeShape, shape_cache: int = 0) -> FloatArray:
    """What the fitted model charges each of ``records`` (their composition, wake-up and
    iteration-size history as measured).

    :param records: measured iterations.
    :param coefficients: fitted coefficients.
    :param wake: the wake-up's shape.
    :param shape_cache: iteration sizes the primitive cache keeps (0: all).
    """
    if not records:
        return np.zeros(0, dtype=np.float64)
    x = _design(records, shape_cache)
    x[:, WAKE_COLUMN] = _wake_column(records, wake)
    return np.asarray(x @ np.array(coefficients.as_vector(), dtype=np.float64))


@dataclass(frozen=True)
class StepFit:
    """A fitted model: its coefficients, the wake-up's shape, the primitive cache's size (0:
    unbounded) and the fit's quality."""

    coefficients: StepCoefficients
    wake: WakeShape
    report: FitReport
    shape_cache: int = 0


def _irls(x: FloatArray, y: FloatArray, keep: npt.NDArray[np.bool_], rounds: int,
          outlier_factor: float | None) -> tuple[FloatArray, npt.NDArray[np.bool_], float]:
    """Non-negative IRLS on the relative error; the weights, the rows kept (stalls dropped
    after the third round when ``outlier_factor`` is given) and the mean squared relative
    error over them."""
    from scipy.optimize import nnls  # scipy only when a fit runs

    scale = np.maximum(np.abs(x).max(axis=0), 1.0)
    xs = x / scale
    pred = np.where(keep, y, 1.0)
    w = np.zeros(x.shape[1])
    keep = keep.copy()
    for i in range(max(3, rounds)):
        weight = 1.0 / np.maximum(pred, 1e-7)
        w, _ = nnls(xs[keep] * weight[keep, None], y[keep] * weight[keep], maxiter=50 * len(w))
        pred = xs @ w
        if i == 2 and outlier_factor is not None:
            keep &= y <= outlier_factor * np.maximum(pred, 1e-9)
    rel = (pred[keep] - y[keep]) / y[keep]
    return w / scale, keep, float(np.mean(rel * rel)) if rel.size else math.inf


def fit_step_model(records: Sequence[IterationRecord], outlier_factor: float = 5.0,
                   rounds: int = 6, terms: str = "all") -> StepFit:
    """Fit :class:`StepCoefficients` (and the wake-up's :class:`WakeShape`) to measured
    iterations.

    Non-negative least squares on the relative error, reweighted by the current prediction
    (IRLS with weights ``1 / predicted``), which keeps the fit unbiased in the mean; after
    the third round, iterations measured more than ``outlier_factor`` times the model (stalls)
    are dropped. The wake-up's decay and idle time scale are the grid point
    (:data:`WAKE_DECAYS` x :data:`WAKE_TAUS_S`) with the least squared relative error, the
    stalls being those of a fit without the wake-up.

    :param records: measured iterations (at least 8).
    :param outlier_factor: drop rows whose measurement exceeds the model by this factor.
    :param rounds: reweighting rounds (>= 3).
    :param terms: ``all``, or ``batch``: only the terms of the batch's composition (profile
        version 2's model; the overheads stay 0), for comparisons.
    :raises ValueError: too few rows, or unknown ``terms``.
    """
    if len(records) < 8:
        raise ValueError(f"need at least 8 measured iterations to fit, got {len(records)}")
    if terms not in ("all", "batch"):
        raise ValueError(f"terms must be 'all' or 'batch', got {terms!r}")
    x = _design(records)
    y = _durations(records)
    positive = y > 0
    wake = WakeShape()
    cache = 0
    if terms == "batch":
        x[:, BATCH_TERMS:] = 0.0
        w, keep, _ = _irls(x, y, positive, rounds, outlier_factor)
    else:
        _, keep, _ = _irls(x, y, positive, rounds, outlier_factor)  # stalls
        woke = any(r.idle_s > 0 for r in records)
        wakes = [WakeShape(d, t) for d in WAKE_DECAYS for t in WAKE_TAUS_S] if woke else [wake]
        designs = {c: _design(records, c) for c in SHAPE_CACHES}
        for _ in range(2):  # coordinate search: the wake-up's shape, then the cache's size
            best = math.inf
            for shape in wakes:
                x = designs[cache]
                x[:, WAKE_COLUMN] = _wake_column(records, shape)
                err = _irls(x, y, keep, 3, None)[2]
                if err < best:
                    best, wake = err, shape
            column = _wake_column(records, wake)
            for c in SHAPE_CACHES:
                designs[c][:, WAKE_COLUMN] = column
                err = _irls(designs[c], y, keep, 3, None)[2]
                if err < best:
                    best, cache = err, c
        x = designs[cache]
        x[:, WAKE_COLUMN] = _wake_column(records, wake)
        w, keep, _ = _irls(x, y, keep, rounds, None)
    coefficients = StepCoefficients.from_vector(w.tolist())
    if not coefficients.wake_s:
        wake = WakeShape()
    if not (coefficients.new_shape_s or coefficients.new_shape_per_token_s
            or coefficients.first_shape_s):
        cache = 0
    pred = x[keep] @ np.array(coefficients.as_vector())
    meas = y[keep]
    total = float(meas.sum())
    report = FitReport(
        rows=int(keep.sum()), dropped=int(len(records) - keep.sum()),
        errors=RelativeErrors.of(meas, pred),
        total_rel_err=float(abs(pred.sum() - total) / total), measured_s=total)
    return StepFit(coefficients, wake, report, cache)
