"""Live vLLM engines in this process: settings, shared clock, scheduler probe, adapter, launch.

``config`` (:class:`VllmEngineConfig`), ``clock`` (:class:`LiveClock`), ``probe`` (what one
iteration holds), ``engine`` (:class:`VllmEngine`, the ``Engine`` adapter) and ``launch``
(:func:`start_vllm_engine`, :func:`start_vllm_pools`). A deployment over live engines is built
by :func:`rlbatch.serving.builders.build_deployment`.

The settings and the clock load with the package; the adapter and the launcher (numpy, the
tiny model's builder, GPU telemetry) load on first use of their names, so that a command that
only reads live-engine options does not pay for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlbatch.engine.vllm.clock import LiveClock
from rlbatch.engine.vllm.config import (
    TINY_KV_CACHE_BYTES,
    TINY_MODEL,
    VllmEngineConfig,
    kv_cache_dtype_for_pool,
)

if TYPE_CHECKING:
    from rlbatch.engine.vllm.engine import VllmEngine
    from rlbatch.engine.vllm.launch import running_engines, start_vllm_engine, start_vllm_pools
    from rlbatch.engine.vllm.probe import IterationRecord

__all__ = [
    "TINY_KV_CACHE_BYTES",
    "TINY_MODEL",
    "IterationRecord",
    "LiveClock",
    "VllmEngine",
    "VllmEngineConfig",
    "kv_cache_dtype_for_pool",
    "running_engines",
    "start_vllm_engine",
    "start_vllm_pools",
]


def __getattr__(name: str) -> Any:
    """The adapter, launcher and probe names, imported on first use (PEP 562)."""
    if name == "VllmEngine":
        from rlbatch.engine.vllm.engine import VllmEngine
        return VllmEngine
    if name in ("running_engines", "start_vllm_engine", "start_vllm_pools"):
        from rlbatch.engine.vllm import launch
        return getattr(launch, name)
    if name == "IterationRecord":
        from rlbatch.engine.vllm.probe import IterationRecord
        return IterationRecord
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
