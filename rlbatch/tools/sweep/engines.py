"""Engine backends a sweep can run on, by name: ``sim`` and ``vllm``.

* ``sim`` (:class:`SimBackend`) builds the simulator through
  :func:`rlbatch.serving.builders.build_deployment` for every point and applies the
  ``static:N`` controller's action, exactly as ``python -m rlbatch simulate --controller
  static:N`` does; the memory breakdown comes from the profiles.
* ``vllm`` (:class:`rlbatch.tools.sweep.live.LiveBackend`) runs a real in-process vLLM engine
  (``--model tiny`` or a checkpoint folder); vLLM itself is imported only when its first
  engine starts.

:func:`open_backend` is the lookup from name to backend; there is no registry to mutate.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.control.controllers import make_controller
from rlbatch.engine.config import Precision
from rlbatch.profiles import load_gpu, load_model
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.sweep.backend import BackendInfo, SweepBackend, SweepEngine, precision_note
from rlbatch.tools.sweep.closed_loop import ClosedLoopResult
from rlbatch.tools.sweep.live import LiveBackend
from rlbatch.tools.sweep.memory import MemoryBreakdown, MemoryPlan, memory_plan
from rlbatch.tools.sweep.spec import SweepSpec

__all__ = ["ENGINE_NAMES", "EngineSetup", "SimBackend", "engine_names", "open_backend",
           "sim_engine"]

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
        return self.plan(precision).breakdown(result.totals.kv_cache_usage_peak,
                                              result.totals.num_kv_blocks)


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
        return LiveBackend(spec, max_batch or max(spec.batches))
    raise ValueError(f"unknown engine {spec.engine!r}; engines: {', '.join(ENGINE_NAMES)}")
