"""GPU and model profiles: typed, validated specs loaded from JSON data files.

A profile is data, not code: the shipped ones live in ``rlbatch/profiles/gpus/*.json`` and
``rlbatch/profiles/models/*.json`` (package data, read with :mod:`importlib.resources`), and a
user adds their own by writing a JSON file with the same fields and passing its path to
:func:`load_gpu` / :func:`load_model`. Free-form documentation goes in ``"description"`` and
``"notes"`` (a list of strings); ``"fit"`` holds the provenance of fitted numbers. Any other
unknown key is an error, so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from rlbatch.profiles.fields import (
    ProfileError,
    check_keys,
    get_bool,
    get_section,
    get_str,
    pos_float,
    pos_int,
)

__all__ = [
    "Efficiency",
    "GpuSpec",
    "MlaSpec",
    "ModelSpec",
    "MoeSpec",
    "ProfileError",
    "list_gpus",
    "list_models",
    "load_gpu",
    "load_model",
]

# --------------------------------------------------------------------------- GPU


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achieved fractions of peak and per-kernel overheads of one GPU.

    The four linear-op numbers are FITTED to measured GEMM timings
    (:mod:`rlbatch.profiles.fit`); the elementwise pair is fitted to measured norm / rope /
    activation kernels; the attention and all-reduce numbers are assumptions (no
    measurements ship with the project), documented in each GPU file's notes.

    :param eff_compute: fraction of peak tensor FLOP/s a GEMM reaches.
    :param eff_mem: fraction of peak HBM bandwidth a GEMM's weight/activation traffic reaches.
    :param op_overhead_s: fixed time per GEMM kernel (launch, tail), seconds.
    :param blend_exponent: ``k`` of the smooth roofline ``(t_c**k + t_m**k)**(1/k)``
        (``k -> inf`` is the hard max; smaller ``k`` models the compute/memory overlap loss
        near the ridge point). Must be >= 1.
    :param eff_elementwise: fraction of HBM bandwidth an elementwise kernel reaches.
    :param elementwise_overhead_s: fixed time per elementwise kernel, seconds.
    :param eff_attn_mem: fraction of HBM bandwidth the decode attention kernel reaches
        reading the KV cache.
    :param eff_attn_compute: fraction of peak fp16 FLOP/s the (flash) attention kernel
        reaches on prefill.
    :param allreduce_efficiency: fraction of NVLink bandwidth an all-reduce reaches.
    """

    eff_compute: float
    eff_mem: float
    op_overhead_s: float
    blend_exponent: float
    eff_elementwise: float
    elementwise_overhead_s: float
    eff_attn_mem: float
    eff_attn_compute: float
    allreduce_efficiency: float

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> Efficiency:
        """Parse and validate the ``"efficiency"`` object of a GPU file.

        :param data: the JSON object.
        :param source: file name used in error messages.
        """
        names = {f.name for f in fields(cls)}
        check_keys(data, names, source)
        values: dict[str, float] = {}
        for name in names:
            zero_ok = name.endswith("_s")
            values[name] = pos_float(data, name, f"{source} (efficiency)", allow_zero=zero_ok)
        for name in names - {"blend_exponent"}:
            if not name.endswith("_s") and values[name] > 1.0:
                raise ProfileError(f"{source}: field 'efficiency.{name}' must be in (0, 1], "
                                   f"got {values[name]}")
        if values["blend_exponent"] < 1.0:
            raise ProfileError(f"{source}: field 'efficiency.blend_exponent' must be >= 1, "
                               f"got {values['blend_exponent']}")
        return cls(**values)

    def to_dict(self) -> dict[str, float]:
        """The JSON object form (inverse of :meth:`from_dict`)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator: peak rates, memory, and the fitted efficiency parameters.

    :param name: profile name, e.g. ``"a100-80g"``.
    :param memory_bytes: device memory as the driver reports it (nvidia-smi total), bytes.
    :param hbm_bandwidth_bytes_s: peak HBM bandwidth, bytes/s.
    :param peak_flops_fp16: dense (no sparsity) bf16/fp16 tensor-core FLOP/s.
    :param fp8_supported: whether the tensor cores run FP8 GEMMs (Hopper yes, Ampere no).
    :param peak_flops_fp8: dense FP8 FLOP/s; ``None`` when FP8 is unsupported.
    :param nvlink_bandwidth_bytes_s: NVLink bandwidth per GPU per direction, bytes/s.
    :param allreduce_latency_s: fixed latency of one tensor-parallel all-reduce, seconds.
    :param fixed_overhead_s: per-iteration fixed cost (CPU scheduling, input preparation,
        sampling bookkeeping, launch) that no kernel model captures, seconds.
    :param efficiency: achieved fractions of peak, see :class:`Efficiency`.
    :param description: free text.
    :param host_link_bandwidth_bytes_s: effective host-to-GPU copy bandwidth of one GPU's
        link to host memory (PCIe, or NVLink-C2C on Grace Hopper), bytes/s: what loading KV
        blocks from the host tier costs (``--kv-offload-gib``); ``None`` when the profile
        does not say (the host tier then refuses to start).
    """

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_s: float
    peak_flops_fp16: float
    fp8_supported: bool
    peak_flops_fp8: float | None
    nvlink_bandwidth_bytes_s: float
    allreduce_latency_s: float
    fixed_overhead_s: float
    efficiency: Efficiency
    description: str = ""
    host_link_bandwidth_bytes_s: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str, default_name: str) -> GpuSpec:
        """Parse and validate a GPU profile object.

        :param data: the parsed JSON object.
        :param source: file name used in error messages.
        :param default_name: name used when the file has no ``"name"`` field.
        """
        allowed = {f.name for f in fields(cls)}
        check_keys(data, allowed, source)
        fp8 = get_bool(data, "fp8_supported", source)
        peak_fp8_raw = data.get("peak_flops_fp8")
        peak_fp8 = pos_float(data, "peak_flops_fp8", source) if peak_fp8_raw is not None \
            else None
        if fp8 and peak_fp8 is None:
            raise ProfileError(f"{source}: field 'peak_flops_fp8' is required when "
                               f"fp8_supported is true")
        eff = get_section(data, "efficiency", source)
        if eff is None:
            raise ProfileError(f"{source}: missing required field 'efficiency'")
        description = data.get("description", "")
        host_link = (pos_float(data, "host_link_bandwidth_bytes_s", source)
                     if data.get("host_link_bandwidth_bytes_s") is not None else None)
        return cls(
            name=get_str(data, "name", source, default_name),
            memory_bytes=pos_int(data, "memory_bytes", source),
            hbm_bandwidth_bytes_s=pos_float(data, "hbm_bandwidth_bytes_s", source),
            peak_flops_fp16=pos_float(data, "peak_flops_fp16", source),
            fp8_supported=fp8,
            peak_flops_fp8=peak_fp8,
            nvlink_bandwidth_bytes_s=pos_float(data, "nvlink_bandwidth_bytes_s", source),
            allreduce_latency_s=pos_float(data, "allreduce_latency_s", source,
                                           allow_zero=True),
            fixed_overhead_s=pos_float(data, "fixed_overhead_s", source, allow_zero=True),
            efficiency=Efficiency.from_dict(eff, source),
            description=description if isinstance(description, str) else "",
            host_link_bandwidth_bytes_s=host_link,
        )


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3) dimensions.

    The KV cache holds ``kv_lora_rank + qk_rope_head_dim`` values per layer per token
    (one latent shared by all heads; vLLM replicates it on every tensor-parallel rank).

    :param q_lora_rank: rank of the query down-projection; ``None`` for a plain q projection.
    :param kv_lora_rank: rank of the compressed KV latent (cached).
    :param qk_nope_head_dim: per-head query/key dimension without rotary embedding.
    :param qk_rope_head_dim: per-head (and shared key) rotary dimension (cached).
    :param v_head_dim: per-head value dimension.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> MlaSpec:
        """Parse the ``"mla"`` object of a model file.

        :param data: the JSON object.
        :param source: file name used in error messages.
        """
        src = f"{source} (mla)"
        check_keys(data, {f.name for f in fields(cls)}, src)
        q_rank = None if data.get("q_lora_rank") is None else pos_int(data, "q_lora_rank", src)
        return cls(
            q_lora_rank=q_rank,
            kv_lora_rank=pos_int(data, "kv_lora_rank", src),
            qk_nope_head_dim=pos_int(data, "qk_nope_head_dim", src),
            qk_rope_head_dim=pos_int(data, "qk_rope_head_dim", src),
            v_head_dim=pos_int(data, "v_head_dim", src),
        )


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Mixture-of-experts MLP dimensions (gated experts).

    :param num_experts: routed experts per MoE layer.
    :param experts_per_token: routed experts each token is sent to (top-k).
    :param num_shared_experts: always-active shared experts per MoE layer.
    :param expert_intermediate_size: intermediate width of one expert.
    :param first_dense_layers: leading layers that use the dense MLP
        (``intermediate_size``) instead of experts.
    """

    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    expert_intermediate_size: int
    first_dense_layers: int

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> MoeSpec:
        """Parse the ``"moe"`` object of a model file.

        :param data: the JSON object.
        :param source: file name used in error messages.
        """
        src = f"{source} (moe)"
        check_keys(data, {f.name for f in fields(cls)}, src)
        spec = cls(
            num_experts=pos_int(data, "num_experts", src),
            experts_per_token=pos_int(data, "experts_per_token", src),
            num_shared_experts=pos_int(data, "num_shared_experts", src, 0, allow_zero=True),
            expert_intermediate_size=pos_int(data, "expert_intermediate_size", src),
            first_dense_layers=pos_int(data, "first_dense_layers", src, 0, allow_zero=True),
        )
        if spec.experts_per_token > spec.num_experts:
            raise ProfileError(f"{src}: field 'experts_per_token' ({spec.experts_per_token}) "
                               f"must not exceed num_experts ({spec.num_experts})")
        return spec


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One LLM's architecture, as far as step time and memory depend on it.

    :param name: profile name, e.g. ``"llama-2-7b"``.
    :param num_layers: transformer layers.
    :param hidden_size: model width.
    :param num_heads: attention (query) heads.
    :param num_kv_heads: key/value heads (== num_heads for MHA, fewer for GQA).
    :param head_dim: per-head dimension (MHA/GQA; ignored for the attention of an MLA model).
    :param intermediate_size: dense MLP width (MoE models: of the leading dense layers).
    :param vocab_size: vocabulary size (embedding and LM-head rows).
    :param gated_mlp: SwiGLU-style gate+up projection (two matrices) instead of one.
    :param max_model_len: the serving context limit (vLLM ``max_model_len``).
    :param default_tp: tensor-parallel degree used when none is given.
    :param default_gpu: GPU profile name used when none is given (``None``: caller decides).
    :param tie_word_embeddings: LM head shares the embedding matrix.
    :param weight_bytes_per_param: bytes per linear-layer weight of the checkpoint as served
        (2 for bf16, 1 for a native FP8 checkpoint such as DeepSeek-V3).
    :param mla: multi-head latent attention dimensions, or ``None`` for MHA/GQA.
    :param moe: mixture-of-experts dimensions, or ``None`` for a dense MLP.
    :param description: free text.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool
    max_model_len: int
    default_tp: int = 1
    default_gpu: str | None = None
    tie_word_embeddings: bool = False
    weight_bytes_per_param: float = 2.0
    mla: MlaSpec | None = None
    moe: MoeSpec | None = None
    description: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str, default_name: str) -> ModelSpec:
        """Parse and validate a model profile object.

        :param data: the parsed JSON object.
        :param source: file name used in error messages.
        :param default_name: name used when the file has no ``"name"`` field.
        """
        check_keys(data, {f.name for f in fields(cls)}, source)
        mla = get_section(data, "mla", source)
        moe = get_section(data, "moe", source)
        gpu = data.get("default_gpu")
        description = data.get("description", "")
        spec = cls(
            name=get_str(data, "name", source, default_name),
            num_layers=pos_int(data, "num_layers", source),
            hidden_size=pos_int(data, "hidden_size", source),
            num_heads=pos_int(data, "num_heads", source),
            num_kv_heads=pos_int(data, "num_kv_heads", source),
            head_dim=pos_int(data, "head_dim", source),
            intermediate_size=pos_int(data, "intermediate_size", source),
            vocab_size=pos_int(data, "vocab_size", source),
            gated_mlp=get_bool(data, "gated_mlp", source),
            max_model_len=pos_int(data, "max_model_len", source),
            default_tp=pos_int(data, "default_tp", source, 1),
            default_gpu=None if gpu is None else get_str(data, "default_gpu", source),
            tie_word_embeddings=get_bool(data, "tie_word_embeddings", source, False),
            weight_bytes_per_param=pos_float(data, "weight_bytes_per_param", source, 2.0),
            mla=None if mla is None else MlaSpec.from_dict(mla, source),
            moe=None if moe is None else MoeSpec.from_dict(moe, source),
            description=description if isinstance(description, str) else "",
        )
        if spec.mla is None and spec.num_heads % spec.num_kv_heads != 0:
            raise ProfileError(f"{source}: field 'num_kv_heads' ({spec.num_kv_heads}) must "
                               f"divide num_heads ({spec.num_heads})")
        if spec.moe is not None and spec.moe.first_dense_layers > spec.num_layers:
            raise ProfileError(f"{source}: field 'moe.first_dense_layers' "
                               f"({spec.moe.first_dense_layers}) exceeds num_layers "
                               f"({spec.num_layers})")
        return spec

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """Cached values per token per layer, whole model: ``2 * kv_heads * head_dim``
        (MHA/GQA) or ``kv_lora_rank + qk_rope_head_dim`` (MLA)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def total_params(self) -> int:
        """All parameters (every expert counted)."""
        return _param_count(self, activated=False)

    @property
    def activated_params(self) -> int:
        """Parameters one token passes through (MoE: routed top-k + shared experts)."""
        return _param_count(self, activated=True)


def _param_count(model: ModelSpec, activated: bool) -> int:
    h = model.hidden_size
    if model.mla is not None:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * model.num_heads * qk if m.q_lora_rank is None else \
            h * m.q_lora_rank + m.q_lora_rank * model.num_heads * qk
        attn = q + h * (m.kv_lora_rank + m.qk_rope_head_dim) \
            + m.kv_lora_rank * model.num_heads * (m.qk_nope_head_dim + m.v_head_dim) \
            + model.num_heads * m.v_head_dim * h
    else:
        d = model.head_dim
        attn = h * (model.num_heads + 2 * model.num_kv_heads) * d + model.num_heads * d * h
    mats = 3 if model.gated_mlp else 2
    dense_mlp = mats * h * model.intermediate_size
    total = 0
    if model.moe is None:
        total += model.num_layers * (attn + dense_mlp + 2 * h)
    else:
        e = model.moe
        experts = (e.experts_per_token if activated else e.num_experts) + e.num_shared_experts
        moe_mlp = experts * mats * h * e.expert_intermediate_size + h * e.num_experts
        total += model.num_layers * (attn + 2 * h)
        total += e.first_dense_layers * dense_mlp
        total += (model.num_layers - e.first_dense_layers) * moe_mlp
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return total + embeddings + h


# --------------------------------------------------------------------------- loading


def _names(kind: str) -> list[str]:
    folder = resources.files("rlbatch.profiles").joinpath(kind)
    return sorted(p.name[: -len(".json")] for p in folder.iterdir()
                  if p.name.endswith(".json"))


def list_gpus() -> list[str]:
    """Names of the shipped GPU profiles."""
    return _names("gpus")


def list_models() -> list[str]:
    """Names of the shipped model profiles."""
    return _names("models")


def _read(kind: str, name_or_path: str | os.PathLike[str]) -> tuple[dict[str, Any], str, str]:
    text_name = os.fspath(name_or_path)
    shipped = _names(kind)
    if text_name in shipped:
        res = resources.files("rlbatch.profiles").joinpath(kind).joinpath(f"{text_name}.json")
        source = f"rlbatch/profiles/{kind}/{text_name}.json"
        raw, stem = res.read_text(encoding="utf-8"), text_name
    else:
        path = Path(text_name)
        looks_like_path = path.suffix == ".json" or os.sep in text_name or "/" in text_name
        if not looks_like_path or not path.is_file():
            where = "no such file" if looks_like_path else "unknown name"
            raise ProfileError(f"{kind[:-1]} profile {text_name!r}: {where}; available "
                               f"names: {', '.join(shipped)} (or pass a path to a JSON file)")
        source, stem = str(path), path.stem
        raw = path.read_text(encoding="utf-8")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{source}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: top level must be a JSON object")
    return data, source, stem


def load_gpu(name_or_path: str | os.PathLike[str]) -> GpuSpec:
    """Load a GPU profile by shipped name (see :func:`list_gpus`) or from a JSON file.

    :param name_or_path: e.g. ``"a100-80g"`` or ``"my/gpus/l40s.json"``.
    :raises ProfileError: (a ``ValueError``) unknown name, missing file or bad field.
    """
    data, source, stem = _read("gpus", name_or_path)
    return GpuSpec.from_dict(data, source, stem)


def load_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """Load a model profile by shipped name (see :func:`list_models`) or from a JSON file.

    :param name_or_path: e.g. ``"llama-2-7b"`` or ``"my/models/qwen.json"``.
    :raises ProfileError: (a ``ValueError``) unknown name, missing file or bad field.
    """
    data, source, stem = _read("models", name_or_path)
    return ModelSpec.from_dict(data, source, stem)
