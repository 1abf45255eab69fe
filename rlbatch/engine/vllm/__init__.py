"""Live vLLM engines in this process: settings, shared clock, scheduler probe, adapter, launch.

``config`` (:class:`VllmEngineConfig`), ``clock`` (:class:`LiveClock`), ``probe`` (what one
iteration holds), ``engine`` (:class:`VllmEngine`, the ``Engine`` adapter) and ``launch``
(:func:`start_vllm_engine`, :func:`start_vllm_pools`). A deployment over live engines is built
by :func:`rlbatch.serving.builders.build_deployment`.
"""

from rlbatch.engine.vllm.clock import LiveClock
from rlbatch.engine.vllm.config import (
    TINY_KV_CACHE_BYTES,
    TINY_MODEL,
    VllmEngineConfig,
    kv_cache_dtype_for_pool,
)
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
