"""The sweep as a Markdown report.

Verdicts on the guide's configurations, recommendations, the measured points and the memory
breakdown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlbatch.tools.sweep.checklist import METHOD, SweepResult, precision_note
from rlbatch.tools.sweep.guide import GuideCheck
from rlbatch.tools.sweep.memory import memory_unit


@dataclass(frozen=True)
class _Formats:
    """Number formats of the tables: seconds and whole-ms TPOT for the simulator's GPUs,
    milliseconds when every latency is below a second (the tiny live model).

    :param unit: unit of TTFT and e2e (``s`` or ``ms``).
    :param scale: seconds -> ``unit``.
    :param latency: format of TTFT and e2e.
    :param tpot_ms: format of TPOT in ms.
    """

    unit: str = "s"
    scale: float = 1.0
    latency: str = ".2f"
    tpot_ms: str = ".0f"

    @classmethod
    def of(cls, result: SweepResult) -> _Formats:
        points = [p for p in [*result.points, *result.extra_points] if p.runnable]
        latencies = [v for p in points for v in (p.ttft_p99_s, p.e2e_p99_s) if v is not None]
        tpots = [p.tpot_p99_s for p in points if p.tpot_p99_s is not None]
        fine_tpot = bool(tpots) and max(tpots) < 0.01
        if latencies and max(latencies) < 1.0:
            return cls("ms", 1000.0, ".1f", ".2f" if fine_tpot else ".0f")
        return cls(tpot_ms=".2f" if fine_tpot else ".0f")


def _f(value: float | int | None, fmt: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(scale * value if scale != 1.0 else value, fmt)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _guide_section(checks: Sequence[GuideCheck], fmt: _Formats) -> list[str]:
    lines = ["## The guide's configurations", ""]
    if not checks:
        return [*lines, "Not checked (run without the guide check).", ""]
    rows = []
    for c in checks:
        verdict = {"holds": "**holds**", "fails": "**fails**"}.get(c.verdict, c.verdict)
        rows.append([c.name, c.guide_text, verdict])
    lines += _table(["configuration", "guide", "verdict"], rows)
    lines.append("")
    for c in checks:
        lines += [f"### {c.name}: {c.guide_text}", "", c.summary, ""]
        if c.points:
            rows = [[str(p["seq_len"]), str(p["batch"]), p["precision"], p["source"],
                     _f(p["throughput_output_tok_s"], ".0f"),
                     _f(p["ttft_p99_s"], fmt.latency, fmt.scale),
                     _f(p["tpot_p99_s"], fmt.tpot_ms, 1000),
                     _f(p["e2e_p99_s"], fmt.latency, fmt.scale),
                     _f(p["kv_cache_usage_peak"], ".0f", 100), str(p["preemptions"]),
                     "yes" if p["ok"] else "no: " + "; ".join(p["failures"])]
                    for p in c.points]
            lines += _table(["seq_len", "batch", "precision", "measured in", "out tok/s",
                             f"TTFT p99 {fmt.unit}", "TPOT p99 ms", f"e2e p99 {fmt.unit}",
                             "KV peak %",
                             "preempt", "passes"], rows)
            lines.append("")
    return lines


def _recommendation_section(result: SweepResult) -> list[str]:
    lines = [f"## What the sweep recommends ({result.precision})", "",
             "Per sequence length: the largest batch, and the batch with the most output "
             "tokens/s, whose P99 latency and TPOT meet the SLA with no preemption or KV "
             "overflow. *Pool fits* is how many sequences of this length the KV pool holds at "
             "once; larger batches must preempt.", ""]
    rows = []
    for r in result.recommendations:
        if not r.runnable:
            rows.append([str(r.seq_len), "not runnable", "-", "-", "-", "-",
                         str(r.kv_fit_batch)])
            continue
        rows.append([str(r.seq_len), _f(r.largest_batch_meeting_sla, "d"),
                     _f(r.max_throughput_batch, "d"), _f(r.max_throughput_output_tok_s, ".0f"),
                     _f(r.max_throughput_total_tok_s, ".0f"),
                     _f(r.first_kv_overflow_batch, "d") if r.first_kv_overflow_batch
                     else "none swept", str(r.kv_fit_batch)])
    lines += _table(["seq_len", "largest batch meeting SLA", "max tokens/s batch",
                     "its out tok/s", "its total tok/s", "KV overflow from batch",
                     "pool fits"], rows)
    return [*lines, ""]


def _points_section(result: SweepResult) -> list[str]:
    fmt = _Formats.of(result)
    lines = ["## Measured points", "",
             "Latencies: TTFT and e2e from the moment a request was sent (closed loop); "
             "P50 / P95 / P99. *Max running*: most sequences running at once (below the batch "
             "when the KV pool cannot hold that many). *KV overflow*: iterations in which a "
             "running request found no free KV block.", ""]
    rows = []
    skipped = []
    for p in result.points:
        if not p.runnable:
            skipped.append(f"- seq_len {p.seq_len}, batch {p.batch}: {p.reason}")
            continue
        rows.append([
            str(p.seq_len), str(p.batch), _f(p.throughput_output_tok_s, ".0f"),
            _f(p.throughput_total_tok_s, ".0f"), _f(p.throughput_rps, ".2f"),
            " / ".join(_f(v, fmt.latency, fmt.scale)
                       for v in (p.ttft_p50_s, p.ttft_p95_s, p.ttft_p99_s)),
            " / ".join(_f(v, fmt.tpot_ms, 1000)
                       for v in (p.tpot_p50_s, p.tpot_p95_s, p.tpot_p99_s)),
            " / ".join(_f(v, fmt.latency, fmt.scale)
                       for v in (p.e2e_p50_s, p.e2e_p95_s, p.e2e_p99_s)),
            _f(p.kv_cache_usage_peak, ".0f", 100), _f(p.max_running, "d"),
            _f(p.preemptions, "d"), _f(p.kv_overflows, "d"), "yes" if p.ok else "no"])
    lines += _table(["seq_len", "batch", "out tok/s", "total tok/s", "req/s",
                     f"TTFT {fmt.unit}", "TPOT ms", f"e2e {fmt.unit}", "KV peak %",
                     "max running", "preempt", "KV overflow", "passes"], rows)
    if skipped:
        lines += ["", "Not runnable:", "", *skipped]
    return [*lines, ""]


def _memory_rows(result: SweepResult, scale: float, fmt: str) -> list[list[str]]:
    rows = []
    for p in result.points:
        if p.memory is None:
            continue
        m = p.memory
        rows.append([str(p.seq_len), str(p.batch)] + [
            format(scale * m[k], fmt) for k in ("weights_gib", "kv_in_use_peak_gib",
                                               "kv_reserved_free_gib",
                                               "activations_buffers_gib", "total_gib")])
    return rows


_MEMORY_HEAD = ("weights", "KV in use (peak)", "KV reserved, free", "activations + buffers",
                "total")


def _live_memory_section(result: SweepResult) -> list[str]:
    plan = result.plan
    largest = max((p.memory["total_gib"] for p in result.points if p.memory is not None),
                  default=1.0) * 2**30
    unit, size = memory_unit(largest)
    scale = 2**30 / size
    measured = ("NVML's used memory of the GPU at the point's peak (every process on it)"
                if plan.source == "nvml" else
                "this process's resident memory (RSS) at the point's peak: there is no GPU, so "
                "weights, KV cache and activations live in host memory and *activations + "
                "buffers* includes the Python / torch / vLLM runtime")
    lines = [f"## Memory ({unit}), measured on the live engine", "",
             f"Weights: {plan.weights_bytes / size:.2f} {unit} (the checkpoint's parameter "
             f"bytes at the serving dtype). KV pool: the engine's {plan.num_kv_blocks:,} blocks "
             f"x {plan.block_size} tokens = {plan.kv_pool_tokens:,} tokens x "
             f"{plan.kv_bytes_per_token:,} B = {plan.kv_pool_bytes / size:.2f} {unit}; *KV in "
             f"use* is vLLM's peak KV usage x the pool. *Total* is {measured}. *Activations + "
             f"buffers* is the total minus the rest (never negative), so each row sums to its "
             f"total."]
    if plan.source == "process":
        lines[-1] += (" RSS is the process's high-water mark: memory an earlier point freed "
                      "stays with the process, so the totals only grow along the sweep; read "
                      "how they grow with batch and seq_len, not their level.")
    lines.append("")
    lines += _table(["seq_len", "batch", *_MEMORY_HEAD], _memory_rows(result, scale, ".2f"))
    return [*lines, ""]


def _memory_section(result: SweepResult) -> list[str]:
    if result.live:
        return _live_memory_section(result)
    plan = result.plan
    gib = 2**30
    lines = ["## Memory (GiB)", "",
             f"vLLM pre-allocates GPU memory x gpu_memory_utilization = "
             f"{plan.gpu_memory_bytes / gib:.1f} x {plan.gpu_memory_utilization:g} = "
             f"{plan.budget_bytes / gib:.2f} GiB: weights {plan.weights_bytes / gib:.2f}, "
             f"activation reserve {plan.activation_reserve_bytes / gib:.2f}, and a KV pool of "
             f"{plan.num_kv_blocks:,} blocks = {plan.kv_pool_tokens:,} tokens "
             f"({plan.kv_bytes_per_token / 2**20:.2f} MiB per token). Each row sums to the "
             f"budget; activations + buffers is the rest of it.", ""]
    lines += _table(["seq_len", "batch", *_MEMORY_HEAD], _memory_rows(result, 1.0, ".2f"))
    return [*lines, ""]


def render_markdown(result: SweepResult, plot_link: str | None = None) -> str:
    """The report.

    :param result: the sweep.
    :param plot_link: path of the PNG relative to the report (embedded when given).
    """
    spec = result.spec
    requests = (f"{spec.num_requests}" if spec.num_requests is not None
                else "max(8 x batch, 64)")
    lines = [f"# Benchmark sweep: {result.model} on {result.gpu}, {result.precision} "
             f"(engine {result.engine_label})", ""]
    if plot_link:
        lines += [f"![sweep]({plot_link})", ""]
    device = (f"device **{result.gpu}** (live engine {result.engine_label})" if result.live
              else f"GPU **{result.gpu}**")
    precision = result.precision_text or precision_note(result.precision, result.gpu_fp8)
    lines += [
        f"- {device}, model **{result.model}** (context {result.max_model_len} "
        f"tokens), {precision}",
        f"- batch sizes {', '.join(map(str, spec.batches))}; prompt lengths (seq_len) "
        f"{', '.join(map(str, spec.seq_lens))}; output {spec.output_len} tokens; "
        f"{requests} requests per point"
        + (f", each point run {spec.repeats} times and the run with the median output "
           f"tokens/s reported" if spec.repeats > 1 else ""),
        f"- SLA: {spec.sla.describe()}; a point *passes* when it meets it with no preemption, "
        f"no KV overflow and the KV pool admitting the whole batch (the guide's test)",
        f"- Method: {METHOD}",
        *(f"- {note}" for note in result.notes),
        "",
    ]
    lines += _guide_section(result.guide_checks, _Formats.of(result))
    lines += _recommendation_section(result)
    lines += _points_section(result)
    lines += _memory_section(result)
    return "\n".join(lines)
