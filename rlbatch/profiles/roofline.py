"""Roofline cost primitives: the GEMM, elementwise and expert-touch costs the step model uses.

:func:`linear_op_time_s` is shared by the step-time model, the fit
(:mod:`rlbatch.profiles.fit`) and profile-check, so what is checked is what runs.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

from rlbatch.profiles.specs import Efficiency, GpuSpec

__all__ = [
    "ACTIVATION_BYTES",
    "dense_linear_shapes",
    "elementwise_time_s",
    "expected_experts_touched",
    "linear_op_time_s",
    "roofline_time_s",
]

ACTIVATION_BYTES = 2
"""Activations stay bf16/fp16 in both precisions (FP8 applies to weights and the KV cache)."""

_Num = TypeVar("_Num", float, npt.NDArray[np.float64])


def roofline_time_s(flops: _Num, nbytes: _Num, peak_flops: float, bandwidth: float,
                    eff: Efficiency) -> _Num:
    """Time of one GEMM-like kernel: smooth roofline plus a fixed per-kernel overhead.

    ``t = (t_c**k + t_m**k)**(1/k) + op_overhead_s`` with ``t_c = flops / (peak * eff_compute)``
    and ``t_m = bytes / (bandwidth * eff_mem)``. Works element-wise on numpy arrays.

    :param flops: floating-point operations of the kernel.
    :param nbytes: bytes it moves to/from HBM.
    :param peak_flops: peak FLOP/s of the precision it runs in.
    :param bandwidth: peak HBM bandwidth, bytes/s.
    :param eff: the GPU's efficiency parameters.
    """
    t_c = flops / (peak_flops * eff.eff_compute)
    t_m = nbytes / (bandwidth * eff.eff_mem)
    k = eff.blend_exponent
    blended: _Num = (t_c**k + t_m**k) ** (1.0 / k)  # float ** float is typed Any
    return blended + eff.op_overhead_s


def linear_op_time_s(tokens: _Num, in_features: int, out_features: int, gpu: GpuSpec,
                     weight_bytes_per_param: float = 2.0,
                     peak_flops: float | None = None) -> _Num:
    """Time of one linear layer ``[tokens, in] @ [in, out]`` on one GPU (shapes per rank).

    FLOPs ``2 * tokens * in * out``; bytes ``in * out * weight_bytes + tokens * (in + out) *
    ACTIVATION_BYTES`` (weights read once, input read, output written).

    :param tokens: rows of the activation matrix (scalar or numpy array).
    :param in_features: input width on this rank.
    :param out_features: output width on this rank.
    :param gpu: the GPU profile (peak rates and fitted efficiency).
    :param weight_bytes_per_param: 2 for bf16 weights, 1 for FP8.
    :param peak_flops: FLOP/s of the GEMM's precision; default the GPU's fp16 peak.
    """
    peak = gpu.peak_flops_fp16 if peak_flops is None else peak_flops
    flops = tokens * (2.0 * in_features * out_features)
    nbytes = tokens * float((in_features + out_features) * ACTIVATION_BYTES) \
        + float(in_features * out_features) * weight_bytes_per_param
    return roofline_time_s(flops, nbytes, peak, gpu.hbm_bandwidth_bytes_s, gpu.efficiency)


def elementwise_time_s(nbytes: _Num, gpu: GpuSpec) -> _Num:
    """Time of one memory-bound elementwise kernel (norm, rope, activation, embedding):
    ``bytes / (hbm_bandwidth * eff_elementwise) + elementwise_overhead_s``.

    :param nbytes: bytes the kernel reads plus writes (scalar or numpy array).
    :param gpu: the GPU profile.
    """
    eff = gpu.efficiency
    return nbytes / (gpu.hbm_bandwidth_bytes_s * eff.eff_elementwise) \
        + eff.elementwise_overhead_s


def dense_linear_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        intermediate: int, gated_mlp: bool,
                        tp: int) -> dict[str, tuple[int, int]]:
    """Per-rank ``(in, out)`` of the four linear ops of a Llama-style layer under tensor
    parallelism (vLLM/Megatron sharding; KV heads are replicated when ``tp > num_kv_heads``).

    Keys are vidur's op names: ``attn_pre_proj`` (fused QKV), ``attn_post_proj`` (output
    projection), ``mlp_up_proj`` (fused gate+up when gated), ``mlp_down_proj``.

    :param hidden: model width.
    :param num_heads: query heads.
    :param num_kv_heads: key/value heads.
    :param head_dim: per-head dimension.
    :param intermediate: MLP width.
    :param gated_mlp: two up matrices (gate and up) instead of one.
    :param tp: tensor-parallel degree.
    """
    heads = num_heads // tp
    kv_heads = max(1, num_kv_heads // tp)
    return {
        "attn_pre_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
        "attn_post_proj": (heads * head_dim, hidden),
        "mlp_up_proj": (hidden, (2 if gated_mlp else 1) * intermediate // tp),
        "mlp_down_proj": (intermediate // tp, hidden),
    }


def expected_experts_touched(num_tokens: int, num_experts: int, experts_per_token: int) -> float:
    """Expected number of distinct experts a batch routes to, under uniform independent
    routing: ``E * (1 - (1 - k/E) ** tokens)``. This is how many experts' weights one MoE
    layer reads from HBM in an iteration (1 token: k experts; large batches: all E).

    :param num_tokens: tokens in the batch.
    :param num_experts: routed experts ``E``.
    :param experts_per_token: top-k ``k``.
    """
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)
