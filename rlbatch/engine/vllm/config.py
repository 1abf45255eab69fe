"""How to start a live vLLM engine: :class:`VllmEngineConfig` and the pool -> KV dtype map."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engine.reserve import KvReserveMode, check_kv_reserve

__all__ = ["TINY_KV_CACHE_BYTES", "TINY_MODEL", "VllmEngineConfig", "kv_cache_dtype_for_pool"]

TINY_MODEL = "tiny"
"""Model name that means "the tiny Llama built by :mod:`rlbatch.engine.tiny_model`"."""

#: KV pool of the tiny model when nothing else sizes it: 64 MiB, about 131k tokens at its
#: 512 bytes per token (2 layers x 2 KV heads x 32 dims x K,V x bf16).
TINY_KV_CACHE_BYTES = 64 << 20

_POOL_KV_DTYPE = {"fp16": "auto", "fp8": "fp8"}


def kv_cache_dtype_for_pool(pool: str) -> str:
    """vLLM ``kv_cache_dtype`` of a pool: ``fp16`` -> ``auto`` (the model dtype), ``fp8`` ->
    ``fp8``.

    :param pool: pool name.
    :raises ValueError: unknown pool.
    """
    try:
        return _POOL_KV_DTYPE[pool]
    except KeyError:
        raise ValueError(f"unknown pool {pool!r}; pools are {sorted(_POOL_KV_DTYPE)}") from None


@dataclass(frozen=True)
class VllmEngineConfig:
    """How to start one live vLLM engine (vLLM ``EngineArgs`` names where they exist).

    :param model: checkpoint folder or hub id; ``"tiny"`` builds/uses the tiny Llama.
    :param dtype: weights/activations dtype (``bfloat16``, ``float16``, ``auto``).
    :param kv_cache_dtype: ``auto`` (model dtype) or ``fp8``; :func:`start_vllm_pools` sets it
        from the pool.
    :param max_model_len: longest prompt + output.
    :param max_num_seqs: vLLM ``max_num_seqs`` (model-runner slots; the ceiling of the live
        cap).
    :param max_num_batched_tokens: token budget per iteration.
    :param kv_cache_memory_bytes: KV pool size in bytes; ``None`` lets vLLM size it from
        ``gpu_memory_utilization`` (on CPU vLLM sees one NUMA node and refuses its default:
        give a value there).
    :param gpu_memory_utilization: vLLM ``gpu_memory_utilization``.
    :param num_kv_blocks: force the number of KV blocks (vLLM ``num_gpu_blocks_override``;
        tests use it to make the cache small); ``None`` keeps vLLM's sizing.
    :param block_size: tokens per KV block; ``None`` = vLLM's default for the platform
        (16 on CUDA, 128 on CPU, where it must be a multiple of 32).
    :param enforce_eager: no CUDA graphs / compilation.
    :param seed: vLLM seed, and the seed of the prompt token ids.
    :param cpu_threads: ``OMP_NUM_THREADS`` for the CPU backend (1 avoids the 100 ms step
        stalls seen with more threads on 2 cores); ``None`` leaves the environment alone.
    :param quiet: set ``VLLM_LOGGING_LEVEL=ERROR`` unless the environment sets it.
    :param kv_reserve: how the admission budget counts a request's KV (as the simulator's
        :class:`~rlbatch.engine.config.EngineConfig`).
    :param kv_reserve_quantile: output quantile ``observed`` reserves at admission.
    :param kv_reserve_shift: ``observed`` forgets a bucket's older outputs when its recent
        completions show a turn to longer answers (:mod:`rlbatch.engine.reserve`).
    :param enable_prefix_caching: vLLM's automatic prefix caching. Off by default: prompts
        without ``prefix_ids`` are cut from one token pool at offsets by request id, so any
        hit would be accidental; requests with ``prefix_ids`` get the tokens those ids name
        (:meth:`~rlbatch.engine.vllm.engine.VllmEngine.prompt_token_ids`), so their shared
        blocks hit as the simulator's prefix cache assumes.
    """

    model: str = TINY_MODEL
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    cpu_threads: int | None = 1
    quiet: bool = True
    kv_reserve: KvReserveMode = "observed"
    kv_reserve_quantile: float = 0.9
    kv_reserve_shift: bool = True
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a checkpoint path, a hub id or 'tiny'")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16",
                                       "float16"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8[_e4m3|_e5m2], got "
                             f"{self.kv_cache_dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs})")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 or None, got "
                             f"{self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or None, got {self.cpu_threads}")
        check_kv_reserve(self.kv_reserve, self.kv_reserve_quantile)

    @property
    def precision(self) -> str:
        """``fp8`` for an FP8 KV cache, else ``fp16``."""
        return "fp8" if self.kv_cache_dtype.startswith("fp8") else "fp16"
