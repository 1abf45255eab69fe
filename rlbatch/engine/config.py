"""Engine configuration with vLLM's names for the scheduler budgets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rlbatch.engine.reserve import KvReserveMode, check_kv_reserve

Precision = Literal["fp16", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("fp16", "fp8")

# vLLM's defaults for the OpenAI server (engine/arg_utils.py, UsageContext.OPENAI_API_SERVER):
# (max_num_seqs, max_num_batched_tokens) by GPU family.
_VLLM_DEFAULTS: dict[str, tuple[int, int]] = {
    "a100": (256, 2048),
    "h100": (1024, 8192),
    "h200": (1024, 8192),
}


def vllm_default_budgets(gpu_name: str) -> tuple[int, int]:
    """vLLM's default ``(max_num_seqs, max_num_batched_tokens)`` for a GPU profile name."""
    family = gpu_name.split("-")[0].lower()
    return _VLLM_DEFAULTS.get(family, _VLLM_DEFAULTS["a100"])


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and cache settings of one engine (one vLLM instance).

    :param max_num_seqs: upper bound on running sequences (vLLM ``--max-num-seqs``).
    :param max_num_batched_tokens: token budget of one iteration (vLLM
        ``--max-num-batched-tokens``); decodes are scheduled first, prefill chunks fill the rest.
    :param block_size: tokens per paged KV block.
    :param gpu_memory_utilization: fraction of GPU memory vLLM may use (weights + activations
        + KV pool).
    :param precision: ``fp16`` or ``fp8`` (FP8 KV cache; FP8 weights where the GPU has FP8).
    :param max_model_len: longest sequence (prompt + output) the engine accepts; ``None``
        takes the model's own limit.
    :param num_kv_blocks_override: force the KV pool size (tests, calibration); ``None``
        derives it from GPU memory.
    :param kv_reserve: how the admission budget counts a request's KV
        (:mod:`rlbatch.engine.reserve`): ``observed`` (recent outputs of its bucket, grown as
        it runs), ``declared`` (its ``max_tokens``, or the rest of the context) or ``oracle``
        (its real output: simulator comparisons only).
    :param kv_reserve_quantile: output quantile ``observed`` reserves at admission.
    :param kv_reserve_shift: ``observed`` forgets a bucket's older outputs when its recent
        completions show a turn to longer answers (:mod:`rlbatch.engine.reserve`).
    :param enable_prefix_caching: vLLM's automatic prefix caching (on by default in vLLM V1):
        a request's leading prompt blocks that the KV pool still holds skip prefill
        (:mod:`rlbatch.engine.prefix_cache`; only requests with prefix information, such as
        Mooncake's ``hash_ids``, can hit).
    :param kv_offload_gib: host memory for vLLM's KV offloading (``--kv-offloading-size``,
        the native CPU backend), GiB; 0 turns it off. Every prompt block computed is copied
        to the host pool, and a prefix that left the GPU cache but is still there is loaded
        over the host link instead of computed (:mod:`rlbatch.engine.host_tier`). Needs
        prefix caching.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    precision: Precision = "fp16"
    max_model_len: int | None = None
    num_kv_blocks_override: int | None = None
    kv_reserve: KvReserveMode = "observed"
    kv_reserve_quantile: float = 0.9
    kv_reserve_shift: bool = True
    enable_prefix_caching: bool = True
    kv_offload_gib: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks_override is not None and self.num_kv_blocks_override < 1:
            raise ValueError(f"num_kv_blocks_override must be >= 1, got "
                             f"{self.num_kv_blocks_override}")
        check_kv_reserve(self.kv_reserve, self.kv_reserve_quantile)
        check_kv_offload(self.kv_offload_gib, self.enable_prefix_caching)


def check_kv_offload(gib: float, enable_prefix_caching: bool) -> None:
    """Refuse a host KV tier the simulator cannot build.

    :param gib: host memory for the KV tier, GiB (0: off).
    :param enable_prefix_caching: whether prefix caching is on (the tier keys its blocks by
        the prefix hashes).
    :raises ValueError: ``gib`` negative or not finite, or the tier on without prefix caching.
    """
    if not 0.0 <= gib < math.inf:
        raise ValueError(f"kv_offload_gib must be a finite number >= 0 (GiB of host memory; "
                         f"0 = off), got {gib}")
    if gib > 0 and not enable_prefix_caching:
        raise ValueError(f"kv_offload_gib={gib} needs prefix caching (the host tier keeps "
                         f"blocks by their prefix hash); drop --no-prefix-caching or set it to 0")


def parse_pools(text: str) -> dict[str, int]:
    """Parse ``"fp16"`` / ``"fp16:2,fp8:1"`` into ``{pool: number of engines}``."""
    pools: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, count = part.partition(":")
        if name not in PRECISIONS:
            raise ValueError(f"unknown pool {name!r} in {text!r}; pools are {PRECISIONS}")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"pool {name!r}: engine count must be an integer, got "
                             f"{count!r}") from None
        if n < 1:
            raise ValueError(f"pool {name!r}: engine count must be >= 1, got {n}")
        if name in pools:
            raise ValueError(f"pool {name!r} given twice in {text!r}")
        pools[name] = n
    if not pools:
        raise ValueError(f"no pool in {text!r}; e.g. fp16 or fp16:1,fp8:1")
    return pools


def format_pools(pools: dict[str, int]) -> str:
    """The text :func:`parse_pools` reads back: ``fp16`` or ``fp16,fp8:2``.

    :param pools: engines per pool.
    """
    return ",".join(name if n == 1 else f"{name}:{n}" for name, n in pools.items())
