"""Engine backends a sweep can run on, by name: ``sim`` and ``vllm``.

A backend (:class:`SweepBackend`) gives a sweep what it needs of an engine: a fresh, idle
engine implementing :class:`rlbatch.engine.base.Engine` with the batch cap in force for every
point, the memory plan of a precision, the memory breakdown of a finished point, and the
words the report uses for the device and the precision.

* ``sim`` (:class:`SimBackend`) builds the simulator through
  :func:`rlbatch.serving.deployment.build_deployment` for every point and applies the ``static:N``
  controller's action, exactly as ``python -m rlbatch simulate --controller static:N`` does;
  the memory breakdown comes from the profiles.
* ``vllm`` (:class:`rlbatch.tools.sweep.live.LiveBackend`) runs a real in-process vLLM engine
  (``--model tiny`` or a checkpoint folder); imported only when asked for, so the simulator
  sweep never imports the live-engine code.

:func:`open_backend` is the lookup from name to backend; there is no registry to mutate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType

from rlbatch.buckets import Buckets
from rlbatch.control.controllers import make_controller
from rlbatch.engine.base import Engine
from rlbatch.engine.config import Precision
from rlbatch.profiles import load_gpu, load_model
from rlbatch.serving.deployment import DeploymentSpec, build_deployment
from rlbatch.tools.sweep.closed_loop import ClosedLoopResult
from rlbatch.tools.sweep.memory import MemoryBreakdown, MemoryPlan, memory_plan
from rlbatch.tools.sweep.spec import SweepSpec

ENGINE_NAMES: tuple[str, ...] = ("sim", "vllm")
"""Every ``--engine`` the sweep accepts."""


@dataclass(frozen=True)
class EngineSetup:
    """What one sweep point needs from a simulated engine.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param precision: ``fp16`` or ``fp8`` (FP8 KV cache; FP8 weights where the GPU has FP8).
    :param batch: the static batch cap (vLLM ``--max-num-seqs``).
    :param gpu_memory_utilization: vLLM ``--gpu-memory-utilization``.
    :param max_num_batched_tokens: token budget per iteration (``None``: vLLM's default).
    """

    gpu: str
    model: str
    precision: Precision
    batch: int
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None


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


def sim_engine(setup: EngineSetup) -> SweepEngine:
    """The simulated vLLM V1 engine under ``static:<batch>``.

    :param setup: GPU, model, precision and batch.
    """
    spec = DeploymentSpec(gpu=setup.gpu, model=setup.model, pools={setup.precision: 1},
                          max_num_batched_tokens=setup.max_num_batched_tokens,
                          gpu_memory_utilization=setup.gpu_memory_utilization)
    deployment = build_deployment(spec)
    deployment.apply(make_controller(f"static:{setup.batch}").reset(deployment.info))
    return SweepEngine(engine=deployment.engines[0], buckets=spec.buckets)


class SimBackend(SweepBackend):
    """The simulator: a fresh simulated engine per point, memory from the profiles.

    :param spec: the sweep (``gpu`` and ``model`` are profile names or JSON paths).
    :raises ValueError: unknown profile.
    """

    def __init__(self, spec: SweepSpec) -> None:
        self.spec = spec
        self._gpu = load_gpu(spec.gpu)
        self._model = load_model(spec.model)
        self._plans: dict[str, MemoryPlan] = {}

    @property
    def max_model_len(self) -> int:
        return self._model.max_model_len

    def info(self) -> BackendInfo:
        return BackendInfo(gpu=self._gpu.name, model=self._model.name,
                           max_model_len=self.max_model_len,
                           gpu_fp8=self._gpu.fp8_supported, engine_label="sim")

    def precision_note(self, precision: Precision) -> str:
        return precision_note(precision, self._gpu.fp8_supported)

    def plan(self, precision: Precision) -> MemoryPlan:
        if precision not in self._plans:
            self._plans[precision] = memory_plan(self.spec.gpu, self.spec.model, precision,
                                                 self.spec.gpu_memory_utilization,
                                                 self.spec.max_num_batched_tokens)
        return self._plans[precision]

    def engine(self, precision: Precision, batch: int) -> SweepEngine:
        return sim_engine(EngineSetup(
            gpu=self.spec.gpu, model=self.spec.model, precision=precision, batch=batch,
            gpu_memory_utilization=self.spec.gpu_memory_utilization,
            max_num_batched_tokens=self.spec.max_num_batched_tokens))

    def breakdown(self, precision: Precision, result: ClosedLoopResult) -> MemoryBreakdown:
        return self.plan(precision).breakdown(result.kv_cache_usage_peak, result.num_kv_blocks)


def engine_names() -> tuple[str, ...]:
    """Every backend name the sweep accepts."""
    return ENGINE_NAMES


def open_backend(spec: SweepSpec, max_batch: int | None = None) -> SweepBackend:
    """The backend ``spec.engine`` names, ready to run ``spec``.

    :param spec: the sweep.
    :param max_batch: the largest batch any point will ask for (a live engine is started
        with room for it); ``None``: the grid's largest.
    :raises ValueError: unknown engine name or profile, or a live setup that cannot work.
    """
    if spec.engine == "sim":
        return SimBackend(spec)
    if spec.engine == "vllm":
        from rlbatch.tools.sweep.live import LiveBackend  # the live-engine code only when asked

        return LiveBackend(spec, max_batch or max(spec.batches))
    raise ValueError(f"unknown engine {spec.engine!r}; engines: {', '.join(ENGINE_NAMES)}")
