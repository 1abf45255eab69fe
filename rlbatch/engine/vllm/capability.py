"""What this machine's vLLM can run: an FP8 KV cache needs AVX-512 or AMX on CPU.

vLLM's CPU attention backend holds an FP8 KV cache only where torch reports AVX-512 or AMX
(``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``: x86 only, so never on an
ARM, POWER, s390x or RISC-V CPU), and raises ``NotImplementedError`` only once the engine
builds its cache, after the model has loaded; a ``vllm serve`` process exits with code 1.
rlbatch checks first, so that an ``fp8`` pool on such a machine fails at once and says why
(seen on an AVX2-only AMD EPYC). vLLM also refuses an FP8 KV cache for a head size that is
a multiple of 16 but not of 32; that still fails late (the tiny model's heads are 32 wide).
GPU builds of vLLM are not checked here: their FP8 support is the GPU's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

__all__ = ["check_kv_cache_dtype", "check_pools", "fp8_kv_unsupported"]


@functools.cache
def fp8_kv_unsupported() -> str | None:
    """Why vLLM cannot hold an FP8 KV cache on this machine, or ``None`` when it can."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("vLLM's CPU backend holds an FP8 KV cache only on x86 with AVX-512 or AMX, and "
            "this CPU has neither")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise before any work when ``kv_cache_dtype`` cannot run here.

    :param kv_cache_dtype: vLLM's ``kv_cache_dtype`` (``auto``, ``fp8``, ...).
    :raises ValueError: an FP8 KV cache on a machine whose vLLM cannot hold one (bad input
        for this machine: the command line prints it as a one-line error).
    """
    if not kv_cache_dtype.startswith("fp8"):
        return
    reason = fp8_kv_unsupported()
    if reason is not None:
        raise ValueError(f"cannot start an fp8 pool: {reason}; serve fp16 pools only "
                         f"(--pools fp16:N) on this machine")


def check_pools(pools: Iterable[str]) -> None:
    """:func:`check_kv_cache_dtype` for every pool name, so that a command serving several
    pools one after the other fails before the first, not after it.

    :param pools: pool names (``fp16``, ``fp8``).
    :raises ValueError: as :func:`check_kv_cache_dtype`.
    """
    from rlbatch.engine.vllm.config import kv_cache_dtype_for_pool

    for pool in pools:
        check_kv_cache_dtype(kv_cache_dtype_for_pool(pool))
