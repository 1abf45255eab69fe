"""What a sweep needs of an engine backend: :class:`SweepBackend` and the types it returns.

A backend gives a sweep a fresh, idle engine implementing :class:`rlbatch.engine.base.Engine`
with the batch cap in force for every point, the memory plan of a precision, the memory
breakdown of a finished point, and the words the report uses for the device and the
precision. The backends are :class:`rlbatch.tools.sweep.engines.SimBackend` and
:class:`rlbatch.tools.sweep.live.LiveBackend`; :func:`rlbatch.tools.sweep.engines.open_backend`
picks one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType

from rlbatch.buckets import Buckets
from rlbatch.engine.base import Engine
from rlbatch.engine.config import Precision
from rlbatch.tools.sweep.closed_loop import ClosedLoopResult
from rlbatch.tools.sweep.memory import MemoryBreakdown, MemoryPlan

__all__ = ["BackendInfo", "SweepBackend", "SweepEngine", "precision_note"]


@dataclass
class SweepEngine:
    """An engine ready for one point and how to bucket its requests.

    :param engine: the engine, batch cap in force, idle, clock at the start of the point.
    :param buckets: the engine's prompt-length buckets (``add_request`` takes an index).
    """

    engine: Engine
    buckets: Buckets


@dataclass(frozen=True)
class BackendInfo:
    """How a backend describes itself in the JSON, the report and the figure.

    :param gpu: GPU profile name (simulator) or the device a live engine ran on (NVML's
        name, or ``cpu``).
    :param model: model profile name, or the live engine's model.
    :param max_model_len: the model's context limit (longer points are not runnable).
    :param gpu_fp8: whether the GPU has FP8 tensor cores (FP8 weights).
    :param engine_label: the engine in words (e.g. ``vllm 0.32.0 (cpu)``).
    :param notes: caveats the report lists (timing, memory measurement, engine reuse).
    """

    gpu: str
    model: str
    max_model_len: int
    gpu_fp8: bool
    engine_label: str
    notes: tuple[str, ...] = ()


def precision_note(precision: str, gpu_fp8: bool) -> str:
    """What the precision means on a simulated GPU, in words.

    :param precision: ``fp16`` or ``fp8``.
    :param gpu_fp8: whether the GPU has FP8 tensor cores.
    """
    if precision == "fp16":
        return "fp16: bf16/fp16 weights and KV cache"
    if gpu_fp8:
        return "fp8: FP8 weights (FP8 GEMMs) and FP8 KV cache"
    return "fp8: FP8 KV cache only (no FP8 tensor cores on this GPU; weights stay bf16)"


class SweepBackend(ABC):
    """Engines for one sweep. Use as a context manager (or call :meth:`close`): a live
    backend holds engines until it is closed."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The model's context limit."""

    @abstractmethod
    def info(self) -> BackendInfo:
        """The backend in words (call after the points ran: a live backend learns its device
        when its first engine starts)."""

    @abstractmethod
    def precision_note(self, precision: Precision) -> str:
        """What ``precision`` means on this backend, in words.

        :param precision: ``fp16`` or ``fp8``.
        """

    @abstractmethod
    def plan(self, precision: Precision) -> MemoryPlan:
        """The memory plan of ``precision`` (a live backend starts its engine for it).

        :param precision: ``fp16`` or ``fp8``.
        """

    @abstractmethod
    def engine(self, precision: Precision, batch: int) -> SweepEngine:
        """An idle engine of ``precision`` with the batch cap ``batch`` in force, its clock at
        the start of the point.

        :param precision: ``fp16`` or ``fp8``.
        :param batch: the static batch cap.
        """

    @abstractmethod
    def breakdown(self, precision: Precision, result: ClosedLoopResult) -> MemoryBreakdown:
        """The memory breakdown of a finished point.

        :param precision: the point's precision.
        :param result: the point's closed-loop run.
        """

    def close(self) -> None:  # noqa: B027 - the simulator holds nothing
        """Release the engines (idempotent)."""

    def __enter__(self) -> SweepBackend:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
