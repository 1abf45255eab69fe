"""Engine backends a sweep can run on, by name.

A backend is a factory from an :class:`EngineSetup` (GPU, model, precision, batch) to a
fresh engine implementing :class:`rlbatch.engine.base.Engine` with the batch cap in force.
``sim`` builds the simulator through :func:`rlbatch.deployment.build_deployment` and applies
the ``static:N`` controller's action, exactly as ``python -m rlbatch simulate --controller
static:N`` does. ``vllm`` is reserved for the live-engine backend, which plugs in with
:func:`register_engine` (same protocol, nothing else in the sweep changes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlbatch.buckets import Buckets
from rlbatch.control import make_controller
from rlbatch.deployment import DeploymentSpec, build_deployment
from rlbatch.engine.base import Engine
from rlbatch.engine.config import Precision


@dataclass(frozen=True)
class EngineSetup:
    """What one sweep point needs from an engine.

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
    """A fresh engine for one point and how to bucket its requests.

    :param engine: the engine, batch cap in force, clock at its start.
    :param buckets: the engine's prompt-length buckets (``add_request`` takes an index).
    """

    engine: Engine
    buckets: Buckets


EngineFactory = Callable[[EngineSetup], SweepEngine]

#: Backends known by name whose implementation is not available (yet): name -> message.
_UNAVAILABLE: dict[str, str] = {
    "vllm": "engine 'vllm' needs the live-engine backend, which is not built yet; "
            "run the sweep with --engine sim",
}


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


_FACTORIES: dict[str, EngineFactory] = {"sim": sim_engine}


def engine_names() -> tuple[str, ...]:
    """Every backend name the sweep accepts (available or not)."""
    return tuple(sorted(set(_FACTORIES) | set(_UNAVAILABLE)))


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make a backend available under ``name`` (the live vLLM backend registers ``vllm``).

    :param name: the ``--engine`` name.
    :param factory: builds a fresh engine per point.
    """
    _FACTORIES[name] = factory
    _UNAVAILABLE.pop(name, None)


def engine_factory(name: str) -> EngineFactory:
    """The factory of backend ``name``.

    :param name: ``sim`` or a registered backend.
    :raises ValueError: unknown name, or a known backend that is not available yet.
    """
    if name in _FACTORIES:
        return _FACTORIES[name]
    if name in _UNAVAILABLE:
        raise ValueError(_UNAVAILABLE[name])
    raise ValueError(f"unknown engine {name!r}; engines: {', '.join(engine_names())}")
