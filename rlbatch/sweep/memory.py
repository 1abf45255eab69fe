"""GPU memory of one engine, from the profiles: weights, KV pool, activations and buffers.

vLLM pre-allocates its budget (``GPU memory x gpu_memory_utilization``) at start-up: the
weights, an activation reserve found by a profiling forward pass, and the KV-cache pool that
fills the rest. So the breakdown of a point always sums to the budget; what changes with
batch and sequence length is how much of the pool is in use at the peak:

``budget = weights + KV in use at peak + KV pool reserved but free + activations/buffers``

where activations/buffers is the rest of the budget (the activation reserve estimate plus
the sliver too small for one more KV block).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlbatch.engine.config import EngineConfig, Precision, vllm_default_budgets
from rlbatch.profiles import RooflineStepTimeModel, load_gpu, load_model

GIB = float(2**30)


@dataclass(frozen=True)
class MemoryBreakdown:
    """One point's memory, GiB. The first four fields sum to ``total_gib``.

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
    """

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int

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
    """The plan :func:`rlbatch.deployment.build_deployment` sizes a simulated engine with.

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
