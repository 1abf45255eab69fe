"""Run the guide's benchmark checklist: every (batch, seq_len) point, then the verdicts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from rlbatch.engine.config import Precision
from rlbatch.tools.sweep.backend import precision_note
from rlbatch.tools.sweep.engines import open_backend
from rlbatch.tools.sweep.guide import (
    GUIDE_CONFIGS,
    GuideCheck,
    PointKey,
    guide_checks,
    guide_point_keys,
)
from rlbatch.tools.sweep.memory import MemoryPlan
from rlbatch.tools.sweep.point import SweepPoint, measure_point
from rlbatch.tools.sweep.recommend import SeqLenRecommendation, recommend
from rlbatch.tools.sweep.spec import SweepSLA, SweepSpec

PointCallback = Callable[[SweepPoint], None]

__all__ = ["METHOD", "PointCallback", "SweepResult", "precision_note", "run_spec", "run_sweep"]

METHOD = (
    "Closed loop at fixed lengths: per point, `batch` clients each keep one request "
    "(prompt = seq_len tokens, output = output_len tokens) in flight under static:batch "
    "(vLLM --max-num-seqs batch); all clients send at t=0 and send the next request as soon "
    "as theirs finishes, so the engine always holds `batch` requests until the last ones "
    "drain. This equals queueing every request at t=0, with latency measured from the moment "
    "a request's slot opens. Rates are over the run (first send to last finish); with "
    "identical requests the engine runs in near-lockstep waves, so P99 TTFT is about the time "
    "to prefill a whole wave (the burst a fixed-length benchmark creates).")


@dataclass
class SweepResult:
    """A finished sweep.

    :param spec: what was asked.
    :param gpu: GPU profile name.
    :param model: model profile name.
    :param max_model_len: the model's context limit.
    :param gpu_fp8: whether the GPU has FP8 tensor cores.
    :param points: the grid, ``seq_len``-major, batches ascending.
    :param plans: memory plan per precision run.
    :param recommendations: one per sequence length.
    :param guide_checks: one per guide configuration (empty when not checked).
    :param extra_points: points run only for the guide checks (not in the grid).
    :param engine_label: the engine in words (``sim``, or e.g. ``vllm 0.32.0 (cpu)``).
    :param precision_text: what the grid's precision means on this backend, in words.
    :param notes: the backend's caveats (timing, memory measurement, engine reuse).
    """

    spec: SweepSpec
    gpu: str
    model: str
    max_model_len: int
    gpu_fp8: bool
    points: list[SweepPoint]
    plans: dict[str, MemoryPlan]
    recommendations: list[SeqLenRecommendation]
    guide_checks: list[GuideCheck] = field(default_factory=list)
    extra_points: list[SweepPoint] = field(default_factory=list)
    engine_label: str = "sim"
    precision_text: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def live(self) -> bool:
        """Measured on a live engine (wall-clock times, measured memory)."""
        return self.plan.live

    @property
    def precision(self) -> str:
        return self.spec.precision

    @property
    def plan(self) -> MemoryPlan:
        """The memory plan of the grid's precision."""
        return self.plans[self.spec.precision]

    def point(self, batch: int, seq_len: int) -> SweepPoint:
        """The grid point at ``(batch, seq_len)``.

        :param batch: batch size.
        :param seq_len: prompt length.
        :raises KeyError: not in the grid.
        """
        for p in self.points:
            if p.batch == batch and p.seq_len == seq_len:
                return p
        raise KeyError(f"no point at batch {batch}, seq_len {seq_len}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: setup, points, recommendations, guide checks."""
        spec = self.spec
        plan = self.plan
        return {
            "gpu": self.gpu,
            "model": self.model,
            "precision": spec.precision,
            "engine": spec.engine,
            "engine_label": self.engine_label,
            "precision_note": self.precision_text or precision_note(spec.precision,
                                                                    self.gpu_fp8),
            "batches": list(spec.batches),
            "seq_lens": list(spec.seq_lens),
            "output_len": spec.output_len,
            "num_requests": spec.num_requests,
            "repeats": spec.repeats,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": spec.gpu_memory_utilization,
            "sla": {"p99_s": spec.sla.p99_s, "metric": spec.sla.metric,
                    "tpot_p99_s": spec.sla.tpot_p99_s, "text": spec.sla.describe()},
            "method": METHOD,
            "notes": list(self.notes),
            "memory_plan": {
                "source": plan.source,
                "weights_gib": plan.weights_bytes / 2**30,
                "activation_reserve_gib": (None if plan.live
                                           else plan.activation_reserve_bytes / 2**30),
                "kv_bytes_per_token": plan.kv_bytes_per_token,
                "kv_block_size": plan.block_size,
                "kv_pool_blocks": plan.num_kv_blocks,
                "kv_pool_tokens": plan.kv_pool_tokens,
                "kv_pool_gib": plan.kv_pool_bytes / 2**30,
                "budget_gib": None if plan.live else plan.budget_bytes / 2**30,
                "gpu_memory_gib": plan.gpu_memory_bytes / 2**30,
            },
            "points": [p.to_dict() for p in self.points],
            "recommendations": {
                "rule": ("per sequence length: the largest batch, and the batch with the most "
                         "output tokens/s, whose P99 latency and TPOT meet the SLA with no "
                         "preemption or KV overflow"),
                "per_seq_len": [r.to_dict() for r in self.recommendations],
            },
            "guide_checks": [c.to_dict() for c in self.guide_checks],
        }


def run_sweep(gpu: str, model: str, batches: Iterable[int], seq_lens: Iterable[int],
              output_len: int = 128, precision: Precision = "fp16", engine: str = "sim", *,
              num_requests: int | None = None, sla: SweepSLA | None = None,
              gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int | None = None,
              check_guide: bool = True, kv_cache_memory_bytes: int | None = None,
              block_size: int | None = None, repeats: int = 1,
              on_point: PointCallback | None = None) -> SweepResult:
    """Measure every ``(batch, seq_len)`` point and judge the guide's configurations.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param batches: batch sizes (static caps), each >= 1.
    :param seq_lens: prompt lengths in tokens, each >= 1; a length the model's context cannot
        hold with the output is reported as not runnable, with the reason.
    :param output_len: output tokens per request.
    :param precision: ``fp16`` or ``fp8``.
    :param engine: ``sim`` (the simulator) or ``vllm`` (a live vLLM engine on this machine;
        ``model`` is ``tiny`` or a checkpoint folder and ``gpu`` is not used).
    :param num_requests: requests per point (``None``: ``max(8 * batch, 64)``).
    :param sla: latency target (default: P99 TTFT <= 2 s and P99 TPOT <= 100 ms).
    :param gpu_memory_utilization: vLLM ``--gpu-memory-utilization``.
    :param max_num_batched_tokens: engine token budget (``None``: vLLM's default).
    :param check_guide: judge the guide's two configurations (running their points where the
        grid lacks them).
    :param kv_cache_memory_bytes: live engine only: KV pool bytes (see :class:`SweepSpec`).
    :param block_size: live engine only: tokens per KV block.
    :param repeats: runs per point, the one with the median output tokens/s reported.
    :param on_point: called after every measured point (progress).
    :raises ValueError: bad arguments, unknown profile or engine, model does not fit, or a
        live model that is neither ``tiny`` nor a checkpoint folder.
    """
    spec = SweepSpec(gpu=gpu, model=model, batches=tuple(batches), seq_lens=tuple(seq_lens),
                     output_len=output_len, precision=precision, engine=engine,
                     num_requests=num_requests, sla=sla or SweepSLA(),
                     gpu_memory_utilization=gpu_memory_utilization,
                     max_num_batched_tokens=max_num_batched_tokens, check_guide=check_guide,
                     kv_cache_memory_bytes=kv_cache_memory_bytes, block_size=block_size,
                     repeats=repeats)
    return run_spec(spec, on_point)


def planned_max_batch(spec: SweepSpec) -> int:
    """The largest batch a sweep may run: the grid's, or a guide configuration's.

    :param spec: the sweep.
    """
    batches = list(spec.batches)
    if spec.check_guide:
        batches += [config.batch for config in GUIDE_CONFIGS]
    return max(batches)


def run_spec(spec: SweepSpec, on_point: PointCallback | None = None) -> SweepResult:
    """:func:`run_sweep` for a ready :class:`SweepSpec`.

    :param spec: the sweep.
    :param on_point: called after every measured point.
    """
    with open_backend(spec, planned_max_batch(spec)) as backend:
        max_model_len = backend.max_model_len
        plans: dict[str, MemoryPlan] = {}

        def plan_for(precision: Precision) -> MemoryPlan:
            if precision not in plans:
                plans[precision] = backend.plan(precision)
            return plans[precision]

        def measure(precision: Precision, batch: int, seq_len: int) -> SweepPoint:
            plan_for(precision)
            point = measure_point(spec, batch, seq_len, precision, backend)
            if on_point is not None:
                on_point(point)
            return point

        plan_for(spec.precision)
        points = [measure(spec.precision, b, s) for s in spec.seq_lens for b in spec.batches]
        measured: dict[PointKey, SweepPoint] = {(p.precision, p.batch, p.seq_len): p
                                                for p in points}
        grid_keys = set(measured)
        extra: list[SweepPoint] = []
        checks: list[GuideCheck] = []
        recs = recommend(points, spec.seq_lens, spec.output_len, plan_for(spec.precision))
        for key in guide_point_keys(spec, max_model_len):
            if key not in measured:
                measured[key] = measure(cast(Precision, key[0]), key[1], key[2])
                extra.append(measured[key])
        info = backend.info()
        if spec.check_guide:
            checks = guide_checks(spec, measured, grid_keys, max_model_len, recs,
                                  f"{info.gpu} / {info.model}")
        return SweepResult(spec=spec, gpu=info.gpu, model=info.model,
                           max_model_len=max_model_len, gpu_fp8=info.gpu_fp8,
                           points=points, plans=plans, recommendations=recs,
                           guide_checks=checks, extra_points=extra,
                           engine_label=info.engine_label,
                           precision_text=backend.precision_note(spec.precision),
                           notes=list(info.notes))
