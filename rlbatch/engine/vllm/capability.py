"""What this machine's vLLM can run: an FP8 KV cache needs hardware support on CPU.

vLLM's CPU attention backend holds an FP8 KV cache only on x86 with AVX-512 or AMX (ARM,
POWER, s390x and RISC-V have their own kernels); elsewhere it raises ``NotImplementedError``
only once the engine builds its cache, after the model has loaded, and an ``vllm serve``
process exits with code 1. rlbatch checks first, so that an ``fp8`` pool on such a machine
fails at once and says why (an AVX2-only AMD EPYC, stop 25). GPU builds of vLLM are not
checked here: their FP8 support is the GPU's.
"""

from __future__ import annotations

import functools

__all__ = ["check_kv_cache_dtype", "fp8_kv_unsupported"]


@functools.cache
def fp8_kv_unsupported() -> str | None:
    """Why vLLM cannot hold an FP8 KV cache on this machine, or ``None`` when it can."""
    import torch
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    if not current_platform.is_cpu():
        return None
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
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
