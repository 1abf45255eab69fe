"""A live engine's overheads outside the forward pass, as the simulator charges them
(:class:`EngineOverheads`), and their shapes that are not linear in a coefficient: how the
wake-up penalty fades over the iterations after an idle wait and grows with the wait
(:class:`WakeShape`, :func:`wake_penalty_s`), and when an iteration size has lost its matmul
primitives (:func:`shape_miss`). The calibration fit (:mod:`rlbatch.tools.calibrate`) and the
simulator (:class:`~rlbatch.profiles.calibrated.CalibratedStepTimeModel`) share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WAKE_FLOOR", "EngineOverheads", "WakeShape", "shape_miss", "wake_penalty_s"]

WAKE_FLOOR = 0.01
"""The wake penalty stops at the first iteration whose decay factor falls below this (the
fit and the simulator use the same cut)."""


@dataclass(frozen=True)
class WakeShape:
    """How the wake penalty depends on the idle wait and fades over the iterations after it:
    ``(1 - exp(-idle_s / tau_s)) * decay ** k`` times ``wake_s`` at the k-th iteration (k = 0
    the first), while ``decay ** k >= WAKE_FLOOR`` (:func:`wake_penalty_s`).

    :param decay: per-iteration factor, in ``[0, 1)`` (0: only the first iteration).
    :param tau_s: idle time scale (> 0): a wait of a few ``tau_s`` costs the full penalty.
    """

    decay: float = 0.0
    tau_s: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"WakeShape.decay must be in [0, 1), got {self.decay!r}")
        if not (math.isfinite(self.tau_s) and self.tau_s > 0.0):
            raise ValueError(f"WakeShape.tau_s must be a finite number > 0, got "
                             f"{self.tau_s!r}")

    @property
    def iterations(self) -> int:
        """Iterations a wake lasts: those with ``decay ** k >= WAKE_FLOOR``."""
        if self.decay <= 0.0:
            return 1
        return math.floor(math.log(WAKE_FLOOR) / math.log(self.decay) + 1e-9) + 1

    def scale(self, idle_s: float) -> float:
        """Fraction of the full penalty a wait of ``idle_s`` seconds costs.

        :param idle_s: the idle wait (``inf``: an engine that never ran).
        """
        if idle_s <= 0.0:
            return 0.0
        return 1.0 - math.exp(-idle_s / self.tau_s)


def wake_penalty_s(wake_s: float, shape: WakeShape, idle_s: float, k: int) -> float:
    """Extra seconds of the k-th iteration (0 = the first) after an idle wait of ``idle_s``.

    :param wake_s: the full penalty (:attr:`StepCoefficients.wake_s`).
    :param shape: its shape.
    :param idle_s: the wait.
    :param k: iterations since the wait ended.
    """
    if k < 0 or k >= shape.iterations:
        return 0.0
    return wake_s * shape.scale(idle_s) * shape.decay ** k


def shape_miss(distance: int, shape_cache: int) -> bool:
    """Whether an iteration size run ``distance`` other sizes ago (-1: never) has lost its
    matmul primitives from an LRU of ``shape_cache`` sizes (0: none is ever lost).

    :param distance: :attr:`~rlbatch.engine.vllm.probe.IterationRecord.shape_distance`.
    :param shape_cache: sizes the cache holds.
    """
    return distance < 0 or 0 < shape_cache <= distance


@dataclass(frozen=True, slots=True)
class EngineOverheads:
    """Engine time outside the batch's forward pass that depends on the engine's history, as
    measured on a live engine (:mod:`rlbatch.profiles.calibrated`); the simulated engine adds
    it to its iterations (:mod:`rlbatch.engine.sim_exact`).

    :param per_new_seq_s: per request scheduled for the first time (admission, input
        processing, the model runner's request state), in that iteration.
    :param per_finished_s: per finished request, in the next iteration (output processing
        after its finish time); an idle wait absorbs it.
    :param wake: extra seconds of the k-th iteration after a long idle wait (k = 0, 1, ...):
        the engine's working set left the caches while it waited.
    :param wake_tau_s: idle time scale: a wait of ``idle`` seconds costs
        ``1 - exp(-idle / wake_tau_s)`` of :attr:`wake`.
    :param new_shape_s: extra seconds of an iteration whose token count the engine has not
        run recently (vLLM's CPU backend builds its matmul primitives per row count).
    :param new_shape_per_token_s: the same, per token of that count.
    :param shape_cache: token counts whose primitives the engine keeps, least recently run
        dropped first (0: all).
    :param first_shape_s: extra seconds the first time the engine runs a token count.
    """

    per_new_seq_s: float = 0.0
    per_finished_s: float = 0.0
    wake: tuple[float, ...] = ()
    wake_tau_s: float = 0.01
    new_shape_s: float = 0.0
    new_shape_per_token_s: float = 0.0
    shape_cache: int = 0
    first_shape_s: float = 0.0

    @property
    def tracks_shapes(self) -> bool:
        """The engine must remember the token counts it ran."""
        return bool(self.new_shape_s or self.new_shape_per_token_s or self.first_shape_s)
