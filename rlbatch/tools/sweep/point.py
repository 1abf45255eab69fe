"""One sweep point: a fixed-length closed-loop run at one (batch, seq_len, precision)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlbatch.engine.config import Precision
from rlbatch.serving.metrics import percentile
from rlbatch.tools.sweep.backend import SweepBackend
from rlbatch.tools.sweep.closed_loop import ClosedLoopResult, run_closed_loop
from rlbatch.tools.sweep.memory import MemoryBreakdown
from rlbatch.tools.sweep.spec import SweepSLA, SweepSpec


def _per_s(count: float, span_s: float) -> float:
    return count / span_s if span_s > 0 else float("nan")


@dataclass
class SweepPoint:
    """Measurements of one point. Every field is present in the JSON; a point that could not
    run has ``runnable`` false, a ``reason``, and ``None`` for every measurement.

    Rates are over the run's makespan (first send to last finish) of the closed loop: engine
    seconds, which are simulated seconds on the simulator and wall seconds on a live engine.

    :param batch: static batch cap = closed-loop concurrency.
    :param seq_len: prompt tokens of every request.
    :param output_len: output tokens of every request.
    :param precision: ``fp16`` or ``fp8``.
    :param runnable: whether the point could run.
    :param reason: why not, when it could not.
    :param num_requests: requests sent.
    :param completed: requests finished.
    :param sim_seconds: engine seconds of the run (the makespan; wall seconds on a live
        engine).
    :param wall_seconds: wall seconds the run took.
    :param throughput_output_tok_s: output tokens per second.
    :param throughput_total_tok_s: prompt + output tokens per second (useful tokens; KV
        recomputed after preemption is not counted again).
    :param throughput_rps: finished requests per second.
    :param ttft_p50_s: time to first token, median.
    :param ttft_p95_s: time to first token, P95.
    :param ttft_p99_s: time to first token, P99.
    :param tpot_p50_s: time per output token after the first, median.
    :param tpot_p95_s: time per output token, P95.
    :param tpot_p99_s: time per output token, P99.
    :param e2e_p50_s: send to last token, median.
    :param e2e_p95_s: send to last token, P95.
    :param e2e_p99_s: send to last token, P99.
    :param kv_cache_usage_peak: peak fraction of the KV pool in use.
    :param max_running: most sequences running at once; below ``batch`` when the KV pool
        cannot hold ``batch`` sequences (the engine then runs fewer, so the point is not
        really at that batch size).
    :param preemptions: requests preempted (recompute), from the engine.
    :param kv_overflows: iterations in which a running request found no free KV block.
    :param recomputed_tokens: KV tokens thrown away by preemption.
    :param meets_sla: P99 latency and P99 TPOT within the SLA.
    :param ok: meets the SLA without preemption or KV overflow (the guide's test).
    :param memory: the memory breakdown (GiB), see
        :class:`~rlbatch.tools.sweep.memory.MemoryBreakdown`.
    """

    batch: int
    seq_len: int
    output_len: int
    precision: str
    runnable: bool
    reason: str | None = None
    num_requests: int | None = None
    completed: int | None = None
    sim_seconds: float | None = None
    wall_seconds: float | None = None
    throughput_output_tok_s: float | None = None
    throughput_total_tok_s: float | None = None
    throughput_rps: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p95_s: float | None = None
    tpot_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p95_s: float | None = None
    e2e_p99_s: float | None = None
    kv_cache_usage_peak: float | None = None
    max_running: int | None = None
    preemptions: int | None = None
    kv_overflows: int | None = None
    recomputed_tokens: int | None = None
    meets_sla: bool | None = None
    ok: bool | None = None
    memory: dict[str, float] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (every key, ``None`` where not measured)."""
        return asdict(self)

    def sla_latency_s(self, sla: SweepSLA) -> float | None:
        """The P99 of the SLA's metric.

        :param sla: the SLA.
        """
        return self.ttft_p99_s if sla.metric == "ttft" else self.e2e_p99_s

    @property
    def overflowed(self) -> bool:
        """The KV cache was too small at this point: the engine preempted, ran out of blocks
        for a running request, or could not admit ``batch`` sequences."""
        return bool(self.preemptions) or bool(self.kv_overflows) or self.kv_limited

    def sla_failures(self, sla: SweepSLA) -> list[str]:
        """Why the point misses the guide's test (empty when ``ok``), in words.

        :param sla: the SLA.
        """
        if not self.runnable:
            return [f"not runnable: {self.reason}"]
        reasons = []
        latency = self.sla_latency_s(sla)
        if latency is not None and latency > sla.p99_s:
            reasons.append(f"P99 {sla.metric.upper()} {latency:.2f} s > {sla.p99_s:g} s")
        if self.tpot_p99_s is not None and self.tpot_p99_s > sla.tpot_p99_s:
            reasons.append(f"P99 TPOT {1000 * self.tpot_p99_s:.0f} ms > "
                           f"{1000 * sla.tpot_p99_s:g} ms")
        if self.preemptions:
            reasons.append(f"{self.preemptions} preemptions")
        if self.kv_overflows and not self.preemptions:
            reasons.append(f"{self.kv_overflows} KV overflows")
        if self.kv_limited:
            reasons.append(f"KV cache holds only {self.max_running} of {self.batch} sequences")
        return reasons

    @property
    def kv_limited(self) -> bool:
        """The KV pool kept the engine below ``batch`` running sequences."""
        if not self.runnable or self.max_running is None:
            return False
        return self.max_running < min(self.batch, self.num_requests or self.batch)


def not_runnable_reason(seq_len: int, output_len: int, max_model_len: int) -> str | None:
    """Why a (seq_len, output_len) point cannot run on a model, or ``None`` if it can.

    :param seq_len: prompt tokens.
    :param output_len: output tokens.
    :param max_model_len: the model's context limit.
    """
    if seq_len + output_len > max_model_len:
        return (f"prompt {seq_len} + output {output_len} = {seq_len + output_len} tokens "
                f"exceeds the model's context of {max_model_len} tokens (vLLM rejects it)")
    return None


def measure_point(spec: SweepSpec, batch: int, seq_len: int, precision: Precision,
                  backend: SweepBackend) -> SweepPoint:
    """Run one point (or mark it not runnable).

    :param spec: the sweep (output length, requests, SLA, repeats: each point runs that many
        times and the run with the median output tokens/s is reported).
    :param batch: batch size.
    :param seq_len: prompt length.
    :param precision: ``fp16`` or ``fp8``.
    :param backend: the engines.
    """
    reason = not_runnable_reason(seq_len, spec.output_len, backend.max_model_len)
    if reason is not None:
        return SweepPoint(batch=batch, seq_len=seq_len, output_len=spec.output_len,
                          precision=precision, runnable=False, reason=reason)
    runs = []
    for _ in range(spec.repeats):
        built = backend.engine(precision, batch)
        runs.append(run_closed_loop(built.engine, bucket=built.buckets.index(seq_len),
                                    concurrency=batch, num_requests=spec.requests_for(batch),
                                    prompt_tokens=seq_len, output_tokens=spec.output_len))
    result = median_run(runs)
    return summarize_point(result, spec, batch, seq_len, precision,
                           backend.breakdown(precision, result))


def median_run(runs: list[ClosedLoopResult]) -> ClosedLoopResult:
    """The run with the median output tokens/s (the upper one of an even count).

    :param runs: repeated runs of one point (at least one).
    """
    def rate(run: ClosedLoopResult) -> float:
        tokens = sum(r.output_tokens for r in run.records)
        return tokens / run.makespan_s if run.makespan_s > 0 else 0.0

    ordered = sorted(runs, key=rate)
    return ordered[len(ordered) // 2]


def summarize_point(result: ClosedLoopResult, spec: SweepSpec, batch: int, seq_len: int,
                    precision: Precision, memory: MemoryBreakdown) -> SweepPoint:
    """Turn a closed-loop run into a point.

    :param result: the run.
    :param spec: the sweep.
    :param batch: batch size.
    :param seq_len: prompt length.
    :param precision: ``fp16`` or ``fp8``.
    :param memory: the point's memory breakdown.
    """
    records = result.records
    totals = result.totals
    span = result.makespan_s
    out_tokens = sum(r.output_tokens for r in records)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in records)
    ttft = [r.ttft_s for r in records]
    tpot = [r.tpot_s for r in records]
    e2e = [r.e2e_s for r in records]
    point = SweepPoint(
        batch=batch, seq_len=seq_len, output_len=spec.output_len, precision=precision,
        runnable=True, num_requests=result.sent, completed=len(records),
        sim_seconds=span, wall_seconds=result.wall_s,
        throughput_output_tok_s=_per_s(out_tokens, span),
        throughput_total_tok_s=_per_s(all_tokens, span),
        throughput_rps=_per_s(len(records), span),
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p95_s=percentile(tpot, 95),
        tpot_p99_s=percentile(tpot, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p95_s=percentile(e2e, 95),
        e2e_p99_s=percentile(e2e, 99),
        kv_cache_usage_peak=totals.kv_cache_usage_peak, max_running=totals.max_running,
        preemptions=totals.preemptions, kv_overflows=totals.kv_overflows,
        recomputed_tokens=totals.recomputed_tokens,
        memory=memory.to_dict())
    failures = point.sla_failures(spec.sla)
    latency_ok = not any(f.startswith("P99") for f in failures)
    point.meets_sla = latency_ok
    point.ok = not failures
    return point
