"""Step-time models: how long one vLLM V1 engine iteration takes on a GPU.

:class:`StepTimeModel` is the small swappable base (like vidur's
``BaseExecutionTimePredictor``); :class:`RooflineStepTimeModel` is the shipped one: a roofline
over FLOPs and bytes per kernel whose efficiency factors are fitted to measured GEMM timings
(:mod:`rlbatch.profiles.fit`). The GEMM cost function :func:`linear_op_time_s` is shared with
the fit and with :func:`rlbatch.profiles.profile_check`, so what is checked is what runs.

Cost of one iteration with ``T = num_prefill_tokens + num_decode_seqs`` tokens and ``S``
sampled sequences (all per tensor-parallel rank, ranks run in lockstep)::

    fixed_overhead                                   CPU scheduling / input prep / sampling
  + layers * sum_ops gemm(T, in, out)                QKV, out-proj, MLP up (gate+up), down
  + elementwise(T)                                   2 fused add+RMSNorm, rope, act per layer
  + all-reduce(T)                                    2 per layer + embedding, when tp > 1
  + layers * (attention kernel overhead
              + prefill_attn_work * 4 * heads/tp * head_dim / (peak * eff_attn_compute)
              + decode_kv_tokens * max(kv bytes / (hbm * eff_attn_mem), flops / peak'))
  + lm_head(S) + sampler(S)

with ``gemm = (t_compute**k + t_memory**k)**(1/k) + op_overhead`` (a smooth roofline).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, NamedTuple

from rlbatch.profiles.overheads import EngineOverheads
from rlbatch.profiles.roofline import (
    ACTIVATION_BYTES,
    dense_linear_shapes,
    expected_experts_touched,
    linear_op_time_s,
    roofline_time_s,
)
from rlbatch.profiles.specs import GpuSpec, ModelSpec

__all__ = [
    "Precision",
    "RooflineStepTimeModel",
    "StepTimeModel",
    "pool_precision",
]

Precision = Literal["fp16", "fp8"]


def pool_precision(pool: str) -> Precision:
    """The precision a pool's engines compute in (``fp8`` for the FP8 pool, else ``fp16``)."""
    return "fp8" if pool == "fp8" else "fp16"


_NON_TORCH_RESERVE_BYTES = 512 * 2**20
"""cuBLAS workspaces, allocator fragmentation and other non-tensor memory vLLM's profiling
run attributes to the engine (a few hundred MiB in its logs)."""

_NCCL_RESERVE_BYTES = 256 * 2**20
"""Extra buffers of NCCL / the custom all-reduce when tp > 1."""

_CACHE_LIMIT = 1 << 16
"""Per-instance memo tables stop growing beyond this many entries (then compute directly)."""


class StepTimeModel(ABC):
    """Swappable latency model of one engine iteration (vidur's BaseExecutionTimePredictor role).

    The simulator calls :meth:`step_time_s` once per iteration and
    :meth:`decode_coefficients` to skip runs of decode-only iterations in closed form, so a
    decode-only :meth:`step_time_s` must equal ``base + per_kv * decode_kv_tokens`` exactly.
    Memory (weights, KV bytes per token, KV capacity) is not part of this interface; the
    roofline model provides it (:meth:`RooflineStepTimeModel.kv_capacity_blocks`).
    """

    @abstractmethod
    def step_time_s(self, num_prefill_tokens: int, prefill_attn_work: float,
                    num_decode_seqs: int, decode_kv_tokens: int) -> float:
        """Seconds for one engine iteration.

        :param num_prefill_tokens: prompt tokens scheduled this iteration (all chunks).
        :param prefill_attn_work: causal attention work of those chunks in token pairs:
            ``sum chunk_len * (context_before_chunk + (chunk_len + 1) / 2)``.
        :param num_decode_seqs: sequences decoding one token each.
        :param decode_kv_tokens: sum over decoding sequences of the context they attend to.
        """

    @abstractmethod
    def decode_coefficients(self, num_decode_seqs: int) -> tuple[float, float]:
        """``(base_s, per_kv_token_s)`` of a decode-only iteration with that many sequences.

        :param num_decode_seqs: sequences decoding one token each.
        """

    def overheads(self) -> EngineOverheads | None:
        """Engine overheads beyond :meth:`step_time_s` (``None``: none; the roofline model
        has none, its fixed per-iteration overhead is part of the step)."""
        return None

    def prefill_time_s(self, prompt_tokens: int, cached_tokens: int,
                       max_num_batched_tokens: int) -> float:
        """Seconds from a request's first scheduled chunk to its first token on an idle
        engine: its prompt after the ``cached_tokens`` already held, in chunks of the token
        budget, nothing else in the iterations (the least it can take: a busy engine shares
        each iteration with decodes and other prefills, and adds its overheads).

        :param prompt_tokens: its prompt.
        :param cached_tokens: of those, already computed (a prefix-cache hit).
        :param max_num_batched_tokens: the engine's token budget per iteration.
        :raises ValueError: a budget under 1.
        """
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        # vLLM computes at least the last prompt token even on a full hit (its logits give
        # the first output token)
        done = min(max(cached_tokens, 0), prompt_tokens - 1)
        total = 0.0
        while done < prompt_tokens:
            n = min(max_num_batched_tokens, prompt_tokens - done)
            total += self.step_time_s(n, n * (done + (n + 1) / 2), 0, 0)
            done += n
        return total


@dataclass(frozen=True, slots=True)
class _Gemm:
    """One linear op per layer group, shapes per rank."""

    layers: int
    in_features: int
    out_features: int
    weight_bytes_per_param: float
    peak_flops: float
    num_experts: int = 0  # > 0: routed MoE experts (grouped GEMM over touched experts)
    experts_per_token: int = 0


def _check_tp(model: ModelSpec, tp: int) -> None:
    """:raises ValueError: ``tp`` does not shard the model's attention heads evenly."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if model.num_heads % tp != 0:
        raise ValueError(f"tp ({tp}) must divide num_heads ({model.num_heads}) of "
                         f"{model.name}")
    if model.mla is None and model.num_kv_heads % tp != 0 and tp % model.num_kv_heads != 0:
        raise ValueError(f"tp ({tp}) and num_kv_heads ({model.num_kv_heads}) of "
                         f"{model.name} must divide one another")


class _AttentionShape(NamedTuple):
    """Per rank: the attention projections, and what the attention kernels and rope read."""

    gemms: list[_Gemm]
    qkv_width: int
    rope_values: int
    prefill_flops_per_pair: float
    decode_flops_per_kv: float
    kv_values_rank: int


def _attention_shape(model: ModelSpec, tp: int, wbpp: float, peak: float) -> _AttentionShape:
    """Attention projections, rope bytes and attention FLOPs per token pair (dense GQA or
    MLA)."""
    h, layers = model.hidden_size, model.num_layers
    heads = model.num_heads // tp
    gemms: list[_Gemm] = []
    if model.mla is None:
        kv_heads = max(1, model.num_kv_heads // tp)
        shapes = dense_linear_shapes(h, model.num_heads, model.num_kv_heads,
                                     model.head_dim, model.intermediate_size,
                                     model.gated_mlp, tp)
        for op in ("attn_pre_proj", "attn_post_proj"):
            gemms.append(_Gemm(layers, *shapes[op], wbpp, peak))
        qkv_width = shapes["attn_pre_proj"][1]
        rope_values = (heads + kv_heads) * model.head_dim
        prefill_flops_per_pair = 4.0 * heads * model.head_dim
        decode_flops_per_kv = 4.0 * heads * model.head_dim
        kv_values_rank = 2 * kv_heads * model.head_dim
    else:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        if m.q_lora_rank is None:  # separate q_proj (sharded) and kv_a (replicated)
            gemms.append(_Gemm(layers, h, heads * qk, wbpp, peak))
            gemms.append(_Gemm(layers, h, latent, wbpp, peak))
        else:  # fused q_a + kv_a (replicated), then q_b (sharded)
            gemms.append(_Gemm(layers, h, m.q_lora_rank + latent, wbpp, peak))
            gemms.append(_Gemm(layers, m.q_lora_rank, heads * qk, wbpp, peak))
        gemms.append(_Gemm(layers, m.kv_lora_rank,
                           heads * (m.qk_nope_head_dim + m.v_head_dim), wbpp, peak))
        gemms.append(_Gemm(layers, heads * m.v_head_dim, h, wbpp, peak))
        qkv_width = heads * qk + latent
        rope_values = heads * m.qk_rope_head_dim + m.qk_rope_head_dim
        prefill_flops_per_pair = 2.0 * heads * (qk + m.v_head_dim)
        decode_flops_per_kv = 2.0 * heads * (latent + m.kv_lora_rank)
        kv_values_rank = latent  # replicated on every rank
    return _AttentionShape(gemms, qkv_width, rope_values, prefill_flops_per_pair,
                           decode_flops_per_kv, kv_values_rank)


class _MlpShape(NamedTuple):
    """Per rank: the dense MLPs and MoE experts, and the elementwise activations they need."""

    gemms: list[_Gemm]
    width: int
    act_values_per_token: float
    routed_expert_params_per_gpu: float


def _mlp_shape(gpu: GpuSpec, model: ModelSpec, tp: int, wbpp: float,
               peak: float) -> _MlpShape:
    """Dense MLP layers and MoE layers (router, shared and routed experts)."""
    h, layers = model.hidden_size, model.num_layers
    gemms: list[_Gemm] = []
    mats = 2 if model.gated_mlp else 1
    dense_layers = layers if model.moe is None else model.moe.first_dense_layers
    act_values_per_token = 0.0  # elementwise activation bytes, summed over layers
    if dense_layers:
        ff = model.intermediate_size // tp
        gemms.append(_Gemm(dense_layers, h, mats * ff, wbpp, peak))
        gemms.append(_Gemm(dense_layers, ff, h, wbpp, peak))
        act_values_per_token += dense_layers * (mats + 1) * ff
    mlp_width = mats * model.intermediate_size // tp
    routed_expert_params_per_gpu = 0.0
    if model.moe is not None:
        e = model.moe
        moe_layers = layers - e.first_dense_layers
        ei = e.expert_intermediate_size // tp
        if moe_layers:
            gemms.append(_Gemm(moe_layers, h, e.num_experts, 2.0, gpu.peak_flops_fp16))
            if e.num_shared_experts:
                se = e.num_shared_experts * ei
                gemms.append(_Gemm(moe_layers, h, mats * se, wbpp, peak))
                gemms.append(_Gemm(moe_layers, se, h, wbpp, peak))
            gemms.append(_Gemm(moe_layers, h, mats * ei, wbpp, peak, e.num_experts,
                               e.experts_per_token))
            gemms.append(_Gemm(moe_layers, ei, h, wbpp, peak, e.num_experts,
                               e.experts_per_token))
            act_values_per_token += moe_layers * (mats + 1) * ei * (
                e.experts_per_token + e.num_shared_experts)
            routed_expert_params_per_gpu = float(
                moe_layers * e.num_experts * (mats + 1) * h * ei)
        mlp_width = max(mlp_width, mats * ei * (e.experts_per_token + e.num_shared_experts))
    return _MlpShape(gemms, mlp_width, act_values_per_token, routed_expert_params_per_gpu)


class RooflineStepTimeModel(StepTimeModel):
    """Roofline step-time model of vLLM V1 with fitted per-GPU efficiency factors.

    Precision: ``"fp16"`` serves bf16/fp16 weights (or the checkpoint's native FP8, see
    ``ModelSpec.weight_bytes_per_param``) with a bf16 KV cache. ``"fp8"`` always halves the
    KV cache (vLLM ``kv_cache_dtype=fp8``); where the GPU has FP8 tensor cores it also stores
    linear weights in FP8 (half the bytes) and runs those GEMMs at the FP8 peak. On A100 FP8
    therefore changes only the KV cache. Embedding and LM head stay bf16 (vLLM does not
    quantize them); attention math runs at the fp16 peak in both precisions.

    Simplifications (documented, deliberate):

    * Sampled sequences: ``num_decode_seqs + 1`` when the batch holds prefill tokens (V1
      computes logits for every scheduled request; with one prefill chunk per iteration,
      typical under chunked prefill, that is exact).
    * Prefill attention is compute only (``4 * heads/tp * head_dim`` FLOPs per token pair, or
      ``2 * heads/tp * (qk_dim + v_dim)`` for MLA); reading the cached context of a chunked
      prefill is ignored. Decode attention per KV token is the larger of KV bytes over HBM
      bandwidth and its FLOPs (MLA's absorbed decode is compute-heavy), so it stays linear
      in ``decode_kv_tokens``.
    * MoE: FLOPs use the activated experts (top-k + shared); weight bytes read per routed
      layer use the expected number of distinct experts the batch touches
      (:func:`expected_experts_touched`), which is the activated parameters for one token and
      tends to all experts for large batches. MLA's ``kv_b`` projection is costed per new
      token (the absorbed form vLLM uses for decode), not per cached context token.
    * All-reduce: ring cost ``latency + 2 (tp-1)/tp * bytes / (nvlink * eff)``, 2 per layer
      plus one for the vocab-parallel embedding; the LM-head gather is ignored.

    :param gpu: GPU profile.
    :param model: model profile.
    :param precision: ``"fp16"`` or ``"fp8"``.
    :param tp: tensor-parallel degree (default ``model.default_tp``).
    :param max_num_batched_tokens: vLLM's token budget per iteration; sizes the activation
        reserve (vLLM profiles one forward pass of this many tokens).
    :param max_num_seqs: vLLM's sequence cap; sizes the sampler's logits in the reserve.
    """

    def __init__(self, gpu: GpuSpec, model: ModelSpec, precision: Precision = "fp16",
                 tp: int | None = None, *, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256) -> None:
        if precision not in ("fp16", "fp8"):
            raise ValueError(f"precision must be 'fp16' or 'fp8', got {precision!r}")
        tp = model.default_tp if tp is None else tp
        _check_tp(model, tp)
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and "
                             f"max_num_seqs ({max_num_seqs}) must be >= 1")
        self.gpu = gpu
        self.model = model
        self.precision: Precision = precision
        self.tp = tp
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

        eff = gpu.efficiency
        fp8_gemm = gpu.fp8_supported and gpu.peak_flops_fp8 is not None
        wbpp = model.weight_bytes_per_param
        if precision == "fp8" and fp8_gemm:
            wbpp = min(wbpp, 1.0)
        peak = gpu.peak_flops_fp8 if (fp8_gemm and wbpp <= 1.0) else gpu.peak_flops_fp16
        assert peak is not None
        self.linear_weight_bytes_per_param = wbpp
        self.linear_peak_flops = peak
        self.kv_bytes_per_value = 1 if precision == "fp8" else 2

        attention = _attention_shape(model, tp, wbpp, peak)
        mlp = _mlp_shape(gpu, model, tp, wbpp, peak)
        h, layers = model.hidden_size, model.num_layers
        rope_values = attention.rope_values
        act_values_per_token = mlp.act_values_per_token
        self._routed_expert_params_per_gpu = mlp.routed_expert_params_per_gpu
        self._gemms = (*attention.gemms, *mlp.gemms)

        # ---- elementwise kernels: linear in tokens
        bw = gpu.hbm_bandwidth_bytes_s
        ew_bw = bw * eff.eff_elementwise
        # per layer: 2 fused add+RMSNorm (read x, residual; write both), rope in place on
        # q and k (read + write), activation (read gate+up, write out); plus the embedding
        # gather (read row, write) once per step.
        ew_kernels = 4 * layers + 1
        ew_values = layers * (2 * 4 * h + 2 * rope_values) + act_values_per_token + 2 * h
        self._ew_fixed = ew_kernels * eff.elementwise_overhead_s
        self._ew_per_token = ew_values * ACTIVATION_BYTES / ew_bw
        # ---- tensor-parallel all-reduce: linear in tokens
        if tp > 1:
            n_ar = 2 * layers + 1
            ar_bw = gpu.nvlink_bandwidth_bytes_s * eff.allreduce_efficiency
            self._ar_fixed = n_ar * gpu.allreduce_latency_s
            self._ar_per_token = n_ar * 2.0 * (tp - 1) / tp * h * ACTIVATION_BYTES / ar_bw
        else:
            self._ar_fixed = 0.0
            self._ar_per_token = 0.0
        # ---- attention
        attn_peak = gpu.peak_flops_fp16 * eff.eff_attn_compute
        self._attn_fixed = layers * eff.op_overhead_s
        self._prefill_per_work = layers * attention.prefill_flops_per_pair / attn_peak
        kv_bytes_layer = attention.kv_values_rank * self.kv_bytes_per_value
        self._decode_per_kv = layers * max(kv_bytes_layer / (bw * eff.eff_attn_mem),
                                           attention.decode_flops_per_kv / attn_peak)
        self._kv_bytes_per_token = layers * kv_bytes_layer
        # ---- LM head (bf16, vocab-parallel) and sampler (fp32 logits, read + write)
        self._vocab_rank = -(-model.vocab_size // tp)
        self._sampler_per_seq = 2.0 * model.vocab_size * 4 / ew_bw
        # ---- constant part of every non-empty iteration
        self._fixed = gpu.fixed_overhead_s + self._attn_fixed
        # ---- memory
        self._qkv_width = attention.qkv_width
        self._mlp_width = mlp.width
        # ---- memo tables (per instance; no global caches)
        self._token_cache: dict[int, float] = {}
        self._sample_cache: dict[int, float] = {}
        self._decode_cache: dict[int, tuple[float, float]] = {}

    # ------------------------------------------------------------------ components

    def linear_time_s(self, num_tokens: int) -> float:
        """Time of all layers' linear ops (projections, MLP / experts) for ``num_tokens``.

        :param num_tokens: tokens in the batch (prefill + decode).
        """
        if num_tokens <= 0:
            return 0.0
        bw = self.gpu.hbm_bandwidth_bytes_s
        eff = self.gpu.efficiency
        total = 0.0
        t = float(num_tokens)
        for g in self._gemms:
            if g.num_experts:
                touched = expected_experts_touched(num_tokens, g.num_experts,
                                                   g.experts_per_token)
                rows = t * g.experts_per_token
                flops = 2.0 * rows * g.in_features * g.out_features
                nbytes = touched * g.in_features * g.out_features * g.weight_bytes_per_param \
                    + rows * (g.in_features + g.out_features) * ACTIVATION_BYTES
                total += g.layers * roofline_time_s(flops, nbytes, g.peak_flops, bw, eff)
            else:
                total += g.layers * linear_op_time_s(t, g.in_features, g.out_features,
                                                     self.gpu, g.weight_bytes_per_param,
                                                     g.peak_flops)
        return total

    def _token_cost(self, num_tokens: int) -> float:
        """Everything that depends only on the batch's token count (memoised)."""
        cost = self._token_cache.get(num_tokens)
        if cost is None:
            cost = (self.linear_time_s(num_tokens) + self._ew_fixed
                    + self._ew_per_token * num_tokens + self._ar_fixed
                    + self._ar_per_token * num_tokens)
            if len(self._token_cache) < _CACHE_LIMIT:
                self._token_cache[num_tokens] = cost
        return cost

    def _sample_cost(self, num_sampled: int) -> float:
        """LM head + sampler for ``num_sampled`` sequences (memoised)."""
        cost = self._sample_cache.get(num_sampled)
        if cost is None:
            if num_sampled <= 0:
                cost = 0.0
            else:
                cost = linear_op_time_s(float(num_sampled), self.model.hidden_size,
                                        self._vocab_rank, self.gpu, 2.0) \
                    + self.gpu.efficiency.elementwise_overhead_s \
                    + self._sampler_per_seq * num_sampled
            if len(self._sample_cache) < _CACHE_LIMIT:
                self._sample_cache[num_sampled] = cost
        return cost

    # ------------------------------------------------------------------ StepTimeModel

    def decode_coefficients(self, num_decode_seqs: int) -> tuple[float, float]:
        """``(base_s, per_kv_token_s)``: a decode-only iteration of ``num_decode_seqs``
        sequences takes ``base_s + per_kv_token_s * decode_kv_tokens``; ``(0, 0)`` for 0.

        :param num_decode_seqs: sequences decoding one token each (>= 0).
        """
        coeffs = self._decode_cache.get(num_decode_seqs)
        if coeffs is None:
            if num_decode_seqs < 0:
                raise ValueError(f"num_decode_seqs must be >= 0, got {num_decode_seqs}")
            if num_decode_seqs == 0:
                coeffs = (0.0, 0.0)
            else:
                base = self._fixed + self._token_cost(num_decode_seqs) \
                    + self._sample_cost(num_decode_seqs)
                coeffs = (base, self._decode_per_kv)
            if len(self._decode_cache) < _CACHE_LIMIT:
                self._decode_cache[num_decode_seqs] = coeffs
        return coeffs

    def step_time_s(self, num_prefill_tokens: int, prefill_attn_work: float,
                    num_decode_seqs: int, decode_kv_tokens: int) -> float:
        """Seconds for one engine iteration (0 for an empty batch).

        :param num_prefill_tokens: prompt tokens scheduled this iteration (all chunks).
        :param prefill_attn_work: ``sum chunk_len * (context_before_chunk +
            (chunk_len + 1) / 2)`` over the prefill chunks, token pairs.
        :param num_decode_seqs: sequences decoding one token each.
        :param decode_kv_tokens: sum of the decoding sequences' context lengths.
        :raises ValueError: negative inputs, attention work without tokens, or KV tokens
            without decoding sequences.
        """
        if decode_kv_tokens < 0 or (num_decode_seqs == 0 and decode_kv_tokens != 0):
            raise ValueError(f"decode_kv_tokens ({decode_kv_tokens}) must be >= 0 and 0 "
                             f"when num_decode_seqs is 0 ({num_decode_seqs})")
        if num_prefill_tokens == 0:
            if prefill_attn_work != 0:
                raise ValueError(f"prefill_attn_work ({prefill_attn_work}) must be 0 "
                                 f"without prefill tokens")
            base, per_kv = self.decode_coefficients(num_decode_seqs)
            return base + per_kv * decode_kv_tokens
        if num_prefill_tokens < 0 or prefill_attn_work < 0 or num_decode_seqs < 0:
            raise ValueError(f"negative input: num_prefill_tokens={num_prefill_tokens}, "
                             f"prefill_attn_work={prefill_attn_work}, "
                             f"num_decode_seqs={num_decode_seqs}")
        # the memo tables' lookups inline (once per iteration with prefill)
        tokens = num_prefill_tokens + num_decode_seqs
        token_cost = self._token_cache.get(tokens)
        if token_cost is None:
            token_cost = self._token_cost(tokens)
        sample_cost = self._sample_cache.get(num_decode_seqs + 1)
        if sample_cost is None:
            sample_cost = self._sample_cost(num_decode_seqs + 1)
        return (self._fixed + token_cost + sample_cost
                + self._prefill_per_work * prefill_attn_work
                + self._decode_per_kv * decode_kv_tokens)

    # ------------------------------------------------------------------ memory

    @property
    def gpu_memory_bytes(self) -> int:
        """Device memory of one GPU, bytes."""
        return self.gpu.memory_bytes

    @property
    def weight_bytes_per_gpu(self) -> int:
        """Weights on one GPU: linear layers (all experts) at the serving precision, plus
        the bf16 vocab-parallel embedding / LM head and norms."""
        linear = 0.0
        for g in self._gemms:
            if not g.num_experts:
                linear += g.layers * g.in_features * g.out_features * g.weight_bytes_per_param
        linear += self._routed_expert_params_per_gpu * self.linear_weight_bytes_per_param
        h = self.model.hidden_size
        vocab = self._vocab_rank * h * (1 if self.model.tie_word_embeddings else 2)
        norms = (2 * self.model.num_layers + 1) * h
        return int(linear + (vocab + norms) * 2)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """KV bytes per token on one GPU: ``2 * layers * kv_heads/tp * head_dim * bytes``
        (MHA/GQA) or ``(kv_lora_rank + rope_dim) * layers * bytes`` (MLA, replicated)."""
        return self._kv_bytes_per_token

    @property
    def activation_reserve_bytes(self) -> int:
        """Memory vLLM's profiling run takes for activations, estimated.

        Heuristic: the peak live tensors of one layer for ``max_num_batched_tokens`` tokens
        (hidden + residual + norm output + attention output, QKV output, MLP gate/up output
        and activation output: ``(4 * hidden + qkv_width + 1.5 * mlp_width) * 2`` bytes per
        token), plus fp32 logits of ``max_num_seqs`` sequences twice (logits and sampler
        probabilities), plus 512 MiB of non-tensor memory (+256 MiB NCCL buffers if tp > 1).
        For Llama-2-7B at 8192 tokens this gives ~1.6 GB, in line with vLLM's reported
        activation peak of 1-2 GiB.
        """
        per_token = (4 * self.model.hidden_size + self._qkv_width + 1.5 * self._mlp_width) \
            * ACTIVATION_BYTES
        logits = 2 * self.max_num_seqs * self.model.vocab_size * 4
        other = _NON_TORCH_RESERVE_BYTES + (_NCCL_RESERVE_BYTES if self.tp > 1 else 0)
        return int(self.max_num_batched_tokens * per_token + logits + other)

    def kv_capacity_blocks(self, gpu_memory_utilization: float = 0.9,
                           block_size: int = 16) -> int:
        """KV-cache blocks vLLM would allocate on each GPU.

        ``floor((memory * util - weights - activation_reserve) / (block_size * kv_bytes))``.

        :param gpu_memory_utilization: vLLM's ``gpu_memory_utilization`` in (0, 1].
        :param block_size: tokens per KV block (vLLM default 16).
        :raises ValueError: bad arguments, or the model does not fit (numbers in the message).
        """
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {gpu_memory_utilization}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        budget = self.gpu_memory_bytes * gpu_memory_utilization
        free = budget - self.weight_bytes_per_gpu - self.activation_reserve_bytes
        block_bytes = block_size * self.kv_bytes_per_token_per_gpu
        blocks = math.floor(free / block_bytes) if free > 0 else 0
        if blocks < 1:
            raise ValueError(
                f"model does not fit: memory {self.gpu_memory_bytes / 1e9:.2f} GB x "
                f"utilization {gpu_memory_utilization} = {budget / 1e9:.2f} GB, weights "
                f"{self.weight_bytes_per_gpu / 1e9:.2f} GB + activation reserve "
                f"{self.activation_reserve_bytes / 1e9:.2f} GB leave {free / 1e9:.2f} GB, "
                f"less than one KV block of {block_bytes} bytes")
        return blocks

    def __repr__(self) -> str:
        return (f"RooflineStepTimeModel(gpu={self.gpu.name!r}, model={self.model.name!r}, "
                f"precision={self.precision!r}, tp={self.tp})")
