"""A deployment's reference capacity: requests per second of one reference request shape.

The controller's observation (version 3) states arrival and departure rates, queues and
throughput in units of this capacity, so that a policy reads "the load is at 80% of what this
deployment serves" the same way on an A100 with Llama-2-7B as on an H200 with Llama-3.1-8B.

The estimate is a steady state, not a simulation: ``N`` reference requests decode together
(``N`` = what the KV pool holds at their full length, at most ``max_num_seqs``), and each
request costs its share of ``output`` decode iterations plus its own prefill::

    seconds per request = output * t_decode(N, N * (prompt + output / 2)) / N + t_prefill(prompt)

With 1,024 prompt and 256 output tokens the estimates relative to A100 / Llama-2-7B are 1.92 (H100 /
Llama-2-7B), 1.68 (A100 / Llama-3.1-8B), 3.96 (H100 / Llama-3.1-8B), 4.84 (H200 / Llama-3.1-8B) and
2.17 (H200 / Llama-3.1-70B, tp 4), against rate scales of 2.0, 1.6, 4.4, 5.0 and 2.0 measured
to put the Azure protocol runs at the knee
(:data:`policies.evaluation.protocol.DEPLOYMENT_RATE_SCALES`): within 10% on every shipped
deployment.
"""

from __future__ import annotations

from rlbatch.profiles.step_time import StepTimeModel

REFERENCE_PROMPT_TOKENS = 1024
REFERENCE_OUTPUT_TOKENS = 256


def reference_capacity_rps(step_model: StepTimeModel, kv_capacity_tokens: int,
                           max_num_seqs: int, *,
                           prompt_tokens: int = REFERENCE_PROMPT_TOKENS,
                           output_tokens: int = REFERENCE_OUTPUT_TOKENS) -> float:
    """Reference requests one engine completes per second in steady state.

    :param step_model: the engine's step-time model.
    :param kv_capacity_tokens: tokens its KV pool holds.
    :param max_num_seqs: its sequence cap.
    :param prompt_tokens: the reference prompt.
    :param output_tokens: the reference output.
    :raises ValueError: a non-positive argument.
    """
    if min(kv_capacity_tokens, max_num_seqs, prompt_tokens, output_tokens) < 1:
        raise ValueError(f"kv_capacity_tokens ({kv_capacity_tokens}), max_num_seqs "
                         f"({max_num_seqs}), prompt_tokens ({prompt_tokens}) and "
                         f"output_tokens ({output_tokens}) must be >= 1")
    length = prompt_tokens + output_tokens
    batch = max(1, min(max_num_seqs, kv_capacity_tokens // length))
    decode_s = step_model.step_time_s(0, 0.0, batch, batch * (prompt_tokens + output_tokens // 2))
    prefill_s = step_model.step_time_s(prompt_tokens, prompt_tokens * (prompt_tokens + 1) / 2,
                                       0, 0)
    return 1.0 / (output_tokens * decode_s / batch + prefill_s)


def profile_capacity_rps(gpu: str, model: str, pools: dict[str, int], *, max_num_seqs: int,
                         max_num_batched_tokens: int,
                         num_kv_blocks: dict[str, int] | None = None,
                         block_size: int = 16, gpu_memory_utilization: float = 0.9) -> float:
    """Reference capacity of a deployment of shipped (or file) profiles, all engines summed.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param pools: engines per pool (``fp16`` / ``fp8``).
    :param max_num_seqs: the engines' sequence cap.
    :param max_num_batched_tokens: their token budget (sizes vLLM's activation reserve).
    :param num_kv_blocks: KV blocks per engine of each pool where known (a pool missing or at
        0: the profile's own estimate at ``gpu_memory_utilization``).
    :param block_size: tokens per KV block.
    :param gpu_memory_utilization: vLLM's setting, for the profile's KV estimate.
    :raises ProfileError: an unknown profile.
    """
    from rlbatch.profiles.specs import load_gpu, load_model
    from rlbatch.profiles.step_time import RooflineStepTimeModel, pool_precision

    gpu_spec, model_spec = load_gpu(gpu), load_model(model)
    total = 0.0
    for pool, count in pools.items():
        step_model = RooflineStepTimeModel(
            gpu_spec, model_spec, precision=pool_precision(pool),
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        blocks = (num_kv_blocks or {}).get(pool, 0) or step_model.kv_capacity_blocks(
            gpu_memory_utilization, block_size)
        total += count * reference_capacity_rps(step_model, blocks * block_size, max_num_seqs)
    return total
