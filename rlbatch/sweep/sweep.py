"""Run the guide's benchmark checklist: every (batch, seq_len) point, then the verdicts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rlbatch.engine.config import Precision
from rlbatch.profiles import load_gpu, load_model
from rlbatch.sweep.engines import engine_factory
from rlbatch.sweep.guide import GUIDE_CONFIGS, GuideCheck, PointKey, admitted_seq_lens, check_config
from rlbatch.sweep.memory import MemoryPlan, memory_plan
from rlbatch.sweep.point import SweepPoint, measure_point
from rlbatch.sweep.recommend import SeqLenRecommendation, recommend
from rlbatch.sweep.spec import SweepSLA, SweepSpec

PointCallback = Callable[[SweepPoint], None]

METHOD = (
    "Closed loop at fixed lengths: per point, `batch` clients each keep one request "
    "(prompt = seq_len tokens, output = output_len tokens) in flight under static:batch "
    "(vLLM --max-num-seqs batch); all clients send at t=0 and send the next request as soon "
    "as theirs finishes, so the engine always holds `batch` requests until the last ones "
    "drain. This equals queueing every request at t=0, with latency measured from the moment "
    "a request's slot opens. Rates are over the run (first send to last finish); with "
    "identical requests the engine runs in near-lockstep waves, so P99 TTFT is about the time "
    "to prefill a whole wave (the burst a fixed-length benchmark creates).")


def precision_note(precision: str, gpu_fp8: bool) -> str:
    """What the precision means on this GPU, in words.

    :param precision: ``fp16`` or ``fp8``.
    :param gpu_fp8: whether the GPU has FP8 tensor cores.
    """
    if precision == "fp16":
        return "fp16: bf16/fp16 weights and KV cache"
    if gpu_fp8:
        return "fp8: FP8 weights (FP8 GEMMs) and FP8 KV cache"
    return "fp8: FP8 KV cache only (no FP8 tensor cores on this GPU; weights stay bf16)"


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
            "precision_note": precision_note(spec.precision, self.gpu_fp8),
            "batches": list(spec.batches),
            "seq_lens": list(spec.seq_lens),
            "output_len": spec.output_len,
            "num_requests": spec.num_requests,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": spec.gpu_memory_utilization,
            "sla": {"p99_s": spec.sla.p99_s, "metric": spec.sla.metric,
                    "tpot_p99_s": spec.sla.tpot_p99_s, "text": spec.sla.describe()},
            "method": METHOD,
            "memory_plan": {
                "weights_gib": plan.weights_bytes / 2**30,
                "activation_reserve_gib": plan.activation_reserve_bytes / 2**30,
                "kv_bytes_per_token": plan.kv_bytes_per_token,
                "kv_pool_blocks": plan.num_kv_blocks,
                "kv_pool_tokens": plan.kv_pool_tokens,
                "budget_gib": plan.budget_bytes / 2**30,
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
              check_guide: bool = True, on_point: PointCallback | None = None) -> SweepResult:
    """Measure every ``(batch, seq_len)`` point and judge the guide's configurations.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param batches: batch sizes (static caps), each >= 1.
    :param seq_lens: prompt lengths in tokens, each >= 1; a length the model's context cannot
        hold with the output is reported as not runnable, with the reason.
    :param output_len: output tokens per request.
    :param precision: ``fp16`` or ``fp8``.
    :param engine: ``sim``; ``vllm`` raises until the live-engine backend is registered.
    :param num_requests: requests per point (``None``: ``max(8 * batch, 64)``).
    :param sla: latency target (default: P99 TTFT <= 2 s and P99 TPOT <= 100 ms).
    :param gpu_memory_utilization: vLLM ``--gpu-memory-utilization``.
    :param max_num_batched_tokens: engine token budget (``None``: vLLM's default).
    :param check_guide: judge the guide's two configurations (running their points where the
        grid lacks them).
    :param on_point: called after every measured point (progress).
    :raises ValueError: bad arguments, unknown profile or engine, model does not fit.
    """
    spec = SweepSpec(gpu=gpu, model=model, batches=tuple(batches), seq_lens=tuple(seq_lens),
                     output_len=output_len, precision=precision, engine=engine,
                     num_requests=num_requests, sla=sla or SweepSLA(),
                     gpu_memory_utilization=gpu_memory_utilization,
                     max_num_batched_tokens=max_num_batched_tokens, check_guide=check_guide)
    return run_spec(spec, on_point)


def run_spec(spec: SweepSpec, on_point: PointCallback | None = None) -> SweepResult:
    """:func:`run_sweep` for a ready :class:`SweepSpec`.

    :param spec: the sweep.
    :param on_point: called after every measured point.
    """
    factory = engine_factory(spec.engine)
    gpu_spec = load_gpu(spec.gpu)
    model_spec = load_model(spec.model)
    max_model_len = model_spec.max_model_len
    plans: dict[str, MemoryPlan] = {}

    def plan_for(precision: Precision) -> MemoryPlan:
        if precision not in plans:
            plans[precision] = memory_plan(spec.gpu, spec.model, precision,
                                           spec.gpu_memory_utilization,
                                           spec.max_num_batched_tokens)
        return plans[precision]

    def measure(precision: Precision, batch: int, seq_len: int) -> SweepPoint:
        point = measure_point(spec, batch, seq_len, precision, factory, plan_for(precision),
                              max_model_len)
        if on_point is not None:
            on_point(point)
        return point

    plan_for(spec.precision)
    points = [measure(spec.precision, b, s) for s in spec.seq_lens for b in spec.batches]
    measured: dict[PointKey, SweepPoint] = {(p.precision, p.batch, p.seq_len): p for p in points}
    grid_keys = set(measured)
    extra: list[SweepPoint] = []
    checks: list[GuideCheck] = []
    recs = recommend(points, spec.seq_lens, spec.output_len, plan_for(spec.precision))
    if spec.check_guide:
        for config in GUIDE_CONFIGS:
            served, _ = admitted_seq_lens(config, spec.seq_lens, spec.output_len, max_model_len)
            for seq_len in served:
                key: PointKey = (config.precision, config.batch, seq_len)
                if key not in measured:
                    measured[key] = measure(config.precision, config.batch, seq_len)
                    extra.append(measured[key])
        where = f"{gpu_spec.name} / {model_spec.name}"
        checks = [check_config(config, measured,
                               lambda k: "sweep" if k in grid_keys else "extra run",
                               spec.seq_lens, spec.output_len, max_model_len, spec.sla, recs,
                               spec.precision, where)
                  for config in GUIDE_CONFIGS]
    return SweepResult(spec=spec, gpu=gpu_spec.name, model=model_spec.name,
                       max_model_len=max_model_len, gpu_fp8=gpu_spec.fp8_supported,
                       points=points, plans=plans, recommendations=recs, guide_checks=checks,
                       extra_points=extra)
