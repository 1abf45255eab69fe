"""Start live vLLM engines in this process: environment, model resolution, pools of engines.

:func:`start_vllm_engine` builds one ``LLMEngine`` (in-process engine core, a stat logger
for rlbatch, prompt token ids from the tokenizer's vocabulary) and wraps it as a
:class:`~rlbatch.engine.vllm.engine.VllmEngine`; :func:`start_vllm_pools` starts the engines
of several pools on one clock. vLLM and torch are imported here only when an engine starts.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.engine.tiny_model import TinyModelSpec, ensure_tiny_model
from rlbatch.engine.vllm.capability import check_kv_cache_dtype, check_pools
from rlbatch.engine.vllm.clock import LiveClock
from rlbatch.engine.vllm.config import TINY_MODEL, VllmEngineConfig, kv_cache_dtype_for_pool
from rlbatch.engine.vllm.engine import VllmEngine
from rlbatch.engine.vllm.probe import StatCollector
from rlbatch.engine.vllm.shutdown import shutdown_core

__all__ = ["running_engines", "start_vllm_engine", "start_vllm_pools"]

_LOG = logging.getLogger(__name__)


def _prepare_environment(config: VllmEngineConfig) -> None:
    """Process settings vLLM reads when an engine starts (in-process core, threads, logs)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.cpu_threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(config.cpu_threads))
        torch: Any = importlib.import_module("torch")
        if not torch.cuda.is_available():
            # torch may have started its thread pool before the variable was set (another
            # import in this process); vLLM's CPU worker freezes the count once it starts.
            torch.set_num_threads(config.cpu_threads)
    if config.quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _resolve_model(model: str, max_model_len: int) -> str:
    if model != TINY_MODEL:
        return model
    spec = TinyModelSpec()
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the tiny model's context "
                         f"{spec.max_position_embeddings}")
    return str(ensure_tiny_model(spec))


def _vocabulary_ids(llm_engine: Any) -> list[int]:
    """Ordinary (non-special) token ids of the engine's tokenizer."""
    tokenizer = llm_engine.get_tokenizer()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = len(tokenizer)
    ids = [i for i in range(size) if i not in special]
    if not ids:
        raise RuntimeError("the tokenizer has no ordinary token ids")
    return ids


def start_vllm_engine(config: VllmEngineConfig, *, engine_id: int = 0, pool: str | None = None,
                      num_buckets: int = 4, clock: LiveClock | None = None,
                      telemetry: MemoryTelemetry | None = None,
                      record_iterations: bool = False) -> VllmEngine:
    """Start a vLLM ``LLMEngine`` in this process and wrap it as a :class:`VllmEngine`.

    Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (and, by default, ``OMP_NUM_THREADS=1`` and
    quiet vLLM logs) in this process's environment first.

    :param config: engine settings.
    :param engine_id: index in the deployment.
    :param pool: pool name (default: from ``config.kv_cache_dtype``).
    :param num_buckets: prompt-length buckets.
    :param clock: shared wall clock (default: a new one starting now).
    :param telemetry: memory readings (default: a new :class:`MemoryTelemetry`).
    :param record_iterations: keep per-iteration records (calibration).
    :raises ValueError: an FP8 KV cache this machine's vLLM cannot hold
        (:func:`~rlbatch.engine.vllm.capability.check_kv_cache_dtype`).
    """
    check_kv_cache_dtype(config.kv_cache_dtype)
    _prepare_environment(config)
    started = time.monotonic()
    model = _resolve_model(config.model, config.max_model_len)
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    llm_engine_mod = importlib.import_module("vllm.v1.engine.llm_engine")
    args = arg_utils.EngineArgs(
        model=model,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_gpu_blocks_override=config.num_kv_blocks,
        block_size=config.block_size,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        async_scheduling=False,
        disable_log_stats=False,
        seed=config.seed,
    )
    collector = StatCollector()

    def factory(vllm_config: Any, engine_index: int = 0) -> StatCollector:
        return collector

    llm_engine = llm_engine_mod.LLMEngine.from_engine_args(args, stat_loggers=[factory])
    if not hasattr(llm_engine.engine_core, "engine_core"):
        llm_engine.engine_core.shutdown()
        raise RuntimeError("vLLM started a multiprocess engine core; VllmEngine needs the "
                           "in-process one (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    try:
        vocab = _vocabulary_ids(llm_engine)
        rng = np.random.default_rng(config.seed)
        prompt_pool = rng.choice(np.asarray(vocab, dtype=np.int64),
                                 size=2 * config.max_model_len)
        startup_s = time.monotonic() - started
        engine = VllmEngine(
            engine_id, pool or config.precision, llm_engine, collector, config,
            clock or LiveClock(), num_buckets, prompt_pool.tolist(), telemetry=telemetry,
            record_iterations=record_iterations, startup_s=startup_s)
    except BaseException:
        # shut the core down now, sparing the groups of the engines still open in this
        # process (vLLM's finalizer would tear them down later)
        shutdown_core(llm_engine.engine_core)
        raise
    _LOG.info("vLLM engine %d (%s) ready in %.1f s: %d KV blocks of %d tokens, max_num_seqs "
              "%d", engine_id, engine.pool, startup_s, engine.num_kv_blocks, engine.block_size,
              engine.configured_max_num_seqs)
    return engine


def start_vllm_pools(pools: dict[str, int], config: VllmEngineConfig, *, num_buckets: int = 4,
                     clock: LiveClock | None = None,
                     record_iterations: bool = False) -> list[VllmEngine]:
    """Start ``pools[pool]`` engines per pool, sharing one clock; each pool's engines get
    the pool's ``kv_cache_dtype`` (``fp16`` -> ``auto``, ``fp8`` -> ``fp8``). On failure the
    engines already started are closed.

    :param pools: engines per pool, e.g. ``{"fp16": 1, "fp8": 1}``.
    :param config: settings shared by every engine (its ``kv_cache_dtype`` is replaced).
    :param num_buckets: prompt-length buckets.
    :param clock: shared wall clock (default: a new one, reset once all engines are up).
    :param record_iterations: keep per-iteration records (calibration).
    :raises ValueError: an fp8 pool this machine's vLLM cannot hold, before any engine starts.
    """
    own_clock = clock is None
    shared = clock or LiveClock()
    telemetry = MemoryTelemetry()
    check_pools(pools)  # before any engine loads its model
    engines: list[VllmEngine] = []
    try:
        for pool, count in pools.items():
            pool_config = replace(config, kv_cache_dtype=kv_cache_dtype_for_pool(pool))
            for _ in range(count):
                engines.append(start_vllm_engine(
                    pool_config, engine_id=len(engines), pool=pool, num_buckets=num_buckets,
                    clock=shared, telemetry=telemetry,
                    record_iterations=record_iterations))
    except BaseException:
        for eng in engines:
            eng.close()
        raise
    if own_clock:
        shared.reset()
    return engines


@contextmanager
def running_engines(engines: list[VllmEngine]) -> Iterator[list[VllmEngine]]:
    """Close ``engines`` when the block ends.

    :param engines: started engines.
    """
    try:
        yield engines
    finally:
        for eng in engines:
            eng.close()
