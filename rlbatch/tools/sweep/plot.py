"""Figures of a sweep (matplotlib, Agg canvas; no pyplot, no global state).

Panels, each drawn by one function on a given ``Axes`` so the same drawing goes into the
combined PNG and into TensorBoard one by one:

* throughput-latency: output tokens/s vs P99 latency (the SLA's metric), one line per
  sequence length, points labelled by batch, SLA limit dashed;
* decode latency: output tokens/s vs P99 TPOT;
* KV cache: peak KV usage vs batch, the guide's 80% breaker line, and red crosses where the
  engine preempted / ran out of KV blocks (in every panel);
* memory: stacked bars per (batch, seq_len): weights, KV in use at peak, KV pool reserved
  but free, activations/buffers; they sum to GPU memory x utilization on the simulator, and
  to the measured memory (NVML, or process RSS without a GPU) on a live engine.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from rlbatch.tools.sweep.checklist import SweepResult, precision_note
from rlbatch.tools.sweep.memory import format_bytes, memory_unit
from rlbatch.tools.sweep.point import SweepPoint

_SEQ_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#e377c2")
_OVERFLOW = "#d62728"
_MEMORY_PARTS: tuple[tuple[str, str, str, str], ...] = (
    # (key, label, colour, hatch)
    ("weights_gib", "weights", "#4c72b0", ""),
    ("kv_in_use_peak_gib", "KV cache in use (peak)", "#dd8452", ""),
    ("kv_reserved_free_gib", "KV pool reserved, free", "#f3d2b5", ""),
    ("activations_buffers_gib", "activations + buffers", "#8172b3", ""),
)
_LOG_RATIO = 25.0
"""Latency axes switch to a log scale when the values span more than this factor."""
KV_BREAKER = 0.8
"""The guide's circuit breaker: KV usage above 80% (for 10 s) halves the batch."""


def _color(result: SweepResult, seq_len: int) -> str:
    return _SEQ_COLORS[result.spec.seq_lens.index(seq_len) % len(_SEQ_COLORS)]


def _runnable_rows(result: SweepResult) -> list[tuple[int, list[SweepPoint]]]:
    rows = []
    for seq_len in result.spec.seq_lens:
        pts = [p for p in result.points if p.seq_len == seq_len and p.runnable]
        if pts:
            rows.append((seq_len, sorted(pts, key=lambda p: p.batch)))
    return rows


def _not_runnable_note(result: SweepResult) -> str:
    skipped = [s for s in result.spec.seq_lens
               if not any(p.runnable for p in result.points if p.seq_len == s)]
    if not skipped:
        return ""
    return (f"not runnable: seq_len {', '.join(map(str, skipped))} (prompt + "
            f"{result.spec.output_len} output tokens > the model's context of "
            f"{result.max_model_len})")


def _legend(ax: Axes, result: SweepResult, extra: list[Any]) -> None:
    handles, _ = ax.get_legend_handles_labels()
    handles += [*extra, _overflow_handle()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              fontsize=8, frameon=False)


def _note(ax: Axes, text: str, y: float = 0.02) -> None:
    ax.text(0.99, y, text, transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
            color="#555555")


def _overflow_handle() -> Line2D:
    return Line2D([], [], color=_OVERFLOW, marker="x", linestyle="none", markersize=10,
                  markeredgewidth=2.5, label="KV overflow (preempted / batch not admitted)")


def _curve(ax: Axes, result: SweepResult, y_of: Callable[[SweepPoint], float | None],
           scale: float) -> None:
    for seq_len, pts in _runnable_rows(result):
        color = _color(result, seq_len)
        xs = [p.throughput_output_tok_s or 0.0 for p in pts]
        ys = [scale * (y_of(p) or 0.0) for p in pts]
        ax.plot(xs, ys, marker="o", color=color, label=f"seq {seq_len}")
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(f"b{p.batch}", (x, y), textcoords="offset points", xytext=(5, 5),
                        fontsize=8, color=color)
            if p.overflowed:
                ax.plot([x], [y], marker="x", color=_OVERFLOW, markersize=12,
                        markeredgewidth=2.5, linestyle="none")
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_xlim(0, 1.12 * max((p.throughput_output_tok_s or 0.0 for _, pts in
                                _runnable_rows(result) for p in pts), default=1.0))
    values = [scale * v for _, pts in _runnable_rows(result) for p in pts
              if (v := y_of(p)) is not None and v > 0]
    if values and max(values) / min(values) > _LOG_RATIO:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(0, 1.12 * max(values, default=1.0))
    ax.grid(True, alpha=0.3)


def draw_throughput_latency(ax: Axes, result: SweepResult) -> None:
    """Output tokens/s vs P99 latency of the SLA's metric, per sequence length (in ms when
    every point is below 100 ms, as on the tiny live model).

    :param ax: where to draw.
    :param result: the sweep.
    """
    sla = result.spec.sla
    latencies = [v for _, pts in _runnable_rows(result) for p in pts
                 if (v := p.sla_latency_s(sla)) is not None]
    ms = bool(latencies) and max(latencies) < 0.1
    scale, unit = (1000.0, "ms") if ms else (1.0, "s")
    _curve(ax, result, lambda p: p.sla_latency_s(sla), scale)
    limit = scale * sla.p99_s
    top = ax.get_ylim()[1]
    if limit <= 3.0 * top:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1)
        _legend(ax, result, [Line2D([], [], color="black", linestyle="--",
                                    label=f"SLA {limit:g} {unit}")])
        ax.set_ylim(top=max(top, 1.15 * limit))
    else:
        _legend(ax, result, [])
        _note(ax, f"{sla.metric.upper()} SLA {sla.p99_s:g} s is far above every point")
    ax.set_ylabel(f"P99 {sla.metric.upper()} ({unit})")
    ax.set_title(f"Throughput vs P99 {sla.metric.upper()} (labels: batch)", fontsize=10)


def draw_tpot(ax: Axes, result: SweepResult) -> None:
    """Output tokens/s vs P99 time per output token, per sequence length.

    :param ax: where to draw.
    :param result: the sweep.
    """
    sla = result.spec.sla
    _curve(ax, result, lambda p: p.tpot_p99_s, 1000.0)
    limit_ms = 1000 * sla.tpot_p99_s
    top = ax.get_ylim()[1]
    if limit_ms <= 3.0 * top:
        ax.set_ylim(top=max(top, 1.1 * limit_ms))
        ax.axhline(limit_ms, color="black", linestyle="--", linewidth=1)
        _legend(ax, result, [Line2D([], [], color="black", linestyle="--",
                                    label=f"SLA {limit_ms:g} ms")])
    else:
        _legend(ax, result, [])
        _note(ax, f"TPOT SLA {limit_ms:g} ms is far above every point")
    ax.set_ylabel("P99 TPOT (ms)")
    ax.set_title("Throughput vs P99 time per output token", fontsize=10)


def draw_kv_usage(ax: Axes, result: SweepResult) -> None:
    """Peak KV-cache usage vs batch, with the 80% breaker and preemption markers.

    :param ax: where to draw.
    :param result: the sweep.
    """
    plan = result.plan
    for seq_len, pts in _runnable_rows(result):
        color = _color(result, seq_len)
        fits = plan.max_sequences(seq_len + result.spec.output_len)
        xs = [p.batch for p in pts]
        ys = [100 * (p.kv_cache_usage_peak or 0.0) for p in pts]
        over = [(x, y) for p, x, y in zip(pts, xs, ys, strict=True) if p.overflowed]
        label = f"seq {seq_len} (fits {fits})"
        if over:
            label += f", KV overflow from b{over[0][0]}"
        ax.plot(xs, ys, marker="o", color=color, label=label)
        if over:
            ox, oy = zip(*over, strict=True)
            ax.plot(ox, oy, marker="x", color=_OVERFLOW, markersize=12, markeredgewidth=2.5,
                    linestyle="none")
    if not any(p.overflowed for _, pts in _runnable_rows(result) for p in pts):
        _note(ax, "no preemption / KV overflow at any swept point", y=0.935)
    ax.axhline(100 * KV_BREAKER, color="#ff7f0e", linestyle="--", linewidth=1)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    batches = list(result.spec.batches)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_ylim(0, 110)
    ax.set_xlabel("batch size (max running sequences)")
    ax.set_ylabel("KV cache peak usage (% of pool)")
    pool = f"pool {plan.kv_pool_tokens:,} tokens ({format_bytes(plan.kv_pool_bytes)})"
    ax.set_title(f"KV cache peak usage; {pool}\n(fits N: sequences the pool holds at once)",
                 fontsize=10)
    _legend(ax, result, [Line2D([], [], color="#ff7f0e", linestyle="--",
                                label="guide breaker 80%")])
    ax.grid(True, alpha=0.3)


def draw_memory(ax: Axes, result: SweepResult) -> None:
    """Stacked memory bars per (batch, seq_len), grouped by sequence length.

    :param ax: where to draw.
    :param result: the sweep.
    """
    plan = result.plan
    live = plan.live
    totals = [p.memory["total_gib"] for p in result.points if p.memory is not None]
    if live:
        unit, size = memory_unit(max(totals, default=1.0) * 2**30)
        scale = 2**30 / size
        top = max(totals, default=1.0) * scale
        ceiling = top * 1.12
    else:
        unit, scale = "GiB", 1.0
        top = plan.budget_bytes / 2**30
        gpu_total = plan.gpu_memory_bytes / 2**30
        ceiling = gpu_total * 1.08
    batches = list(result.spec.batches)
    group = len(batches) + 1
    ticks: list[float] = []
    labels: list[str] = []
    for g, seq_len in enumerate(result.spec.seq_lens):
        for i, batch in enumerate(batches):
            x = g * group + i
            ticks.append(x)
            labels.append(f"b{batch}")
            point = result.point(batch, seq_len)
            if point.memory is None:
                ax.bar(x, top, width=0.8, color="white", edgecolor="#999999", hatch="//")
                ax.text(x, top / 2, "not runnable", rotation=90, ha="center", va="center",
                        fontsize=8, color="#555555")
                continue
            bottom = 0.0
            for key, _, color, hatch in _MEMORY_PARTS:
                height = scale * point.memory[key]
                ax.bar(x, height, bottom=bottom, width=0.8, color=color, hatch=hatch,
                       edgecolor="white", linewidth=0.5)
                bottom += height
            kv_in_use = scale * point.memory["kv_in_use_peak_gib"]
            if live:
                pool = scale * point.memory["kv_pool_gib"]
                ax.text(x, bottom + 0.01 * ceiling, f"{bottom:.0f}\nKV {kv_in_use:.2g}/{pool:.3g}",
                        ha="center", va="bottom", fontsize=7, color="#7a3b0c")
            else:
                kv_top = scale * point.memory["weights_gib"] + kv_in_use
                inside = kv_top > top - 0.06 * gpu_total  # no room above: write inside
                ax.text(x, kv_top - 1.0 if inside else kv_top + 0.5, f"{kv_in_use:.1f}",
                        ha="center", va="top" if inside else "bottom", fontsize=7,
                        color="white" if inside else "#7a3b0c")
            if point.overflowed:
                ax.plot([x], [bottom + (0.08 if live else 0.04) * ceiling], marker="x",
                        color=_OVERFLOW, markersize=10, markeredgewidth=2.5, linestyle="none")
        center = g * group + (len(batches) - 1) / 2
        ax.text(center, -0.13, f"seq_len {seq_len}", transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=9, fontweight="bold")
    handles: list[Any] = [Patch(facecolor=c, label=lbl) for _, lbl, c, _ in _MEMORY_PARTS]
    if live and plan.source == "process":
        handles[-1] = Patch(facecolor=_MEMORY_PARTS[-1][2],
                            label="activations + buffers + Python/torch/vLLM runtime")
    if live:
        measured = ("process RSS (no GPU: the runtime is in activations + buffers)"
                    if plan.source == "process" else "NVML used GPU memory")
        ax.set_ylabel(f"memory ({unit})")
        ax.set_title(f"Memory breakdown per (batch, seq_len), measured: total = {measured}; "
                     f"weights {plan.weights_bytes / size:.2f} {unit}; numbers: total, KV in "
                     f"use at peak / KV pool ({unit})", fontsize=10)
        handles.append(_overflow_handle())
    else:
        ax.axhline(top, color="black", linestyle="--", linewidth=1)
        ax.axhline(gpu_total, color="black", linewidth=1)
        ax.set_ylabel("GPU memory (GiB)")
        ax.set_title(f"Memory breakdown per (batch, seq_len); numbers: KV in use at peak "
                     f"(GiB); budget = {gpu_total:.1f} GiB x {plan.gpu_memory_utilization:g} "
                     f"= {top:.1f} GiB", fontsize=10)
        handles += [Line2D([], [], color="black", linestyle="--", label="budget (GPU x util)"),
                    Line2D([], [], color="black", label="GPU memory"), _overflow_handle()]
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylim(0, ceiling)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=7,
              fontsize=8, frameon=False)


PANELS: dict[str, Callable[[Axes, SweepResult], None]] = {
    "throughput_latency": draw_throughput_latency,
    "tpot": draw_tpot,
    "kv_usage": draw_kv_usage,
    "memory": draw_memory,
}


def title(result: SweepResult) -> str:
    """The figure title: GPU, model, precision, engine, workload."""
    precision = result.precision_text or precision_note(result.precision, result.gpu_fp8)
    text = (f"{result.model} on {result.gpu} — {precision} — engine {result.engine_label}"
            f"\nclosed loop, prompt = seq_len, output {result.spec.output_len} tokens; SLA "
            f"{result.spec.sla.describe()}, no preemption")
    if result.live:
        text += "; wall-clock times on a live engine"
    note = _not_runnable_note(result)
    return f"{text}\n{note}" if note else text


def build_figure(result: SweepResult) -> Figure:
    """All panels in one figure: three curves on top, the memory bars below.

    :param result: the sweep.
    """
    fig = Figure(figsize=(17, 10.5), dpi=90, layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=(1.0, 0.95))
    draw_throughput_latency(fig.add_subplot(grid[0, 0]), result)
    draw_tpot(fig.add_subplot(grid[0, 1]), result)
    draw_kv_usage(fig.add_subplot(grid[0, 2]), result)
    draw_memory(fig.add_subplot(grid[1, :]), result)
    fig.suptitle(title(result), fontsize=12)
    return fig


def panel_figure(result: SweepResult, name: str) -> Figure:
    """One panel alone (for TensorBoard).

    :param result: the sweep.
    :param name: a key of :data:`PANELS`.
    """
    wide = name == "memory"
    fig = Figure(figsize=(12 if wide else 7, 5.5), dpi=90, layout="constrained")
    PANELS[name](fig.add_subplot(), result)
    fig.suptitle(title(result), fontsize=9)
    return fig


def save_png(fig: Figure, path: Path) -> None:
    """Write ``fig`` as a PNG, creating parent folders.

    :param fig: the figure.
    :param path: the file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png")


def to_rgb_array(fig: Figure) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Render ``fig`` to an ``(H, W, 3)`` uint8 array.

    :param fig: the figure.
    """
    canvas = FigureCanvasAgg(fig)
    width, height = canvas.get_width_height(physical=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="rgba")
    rgba = np.frombuffer(buffer.getvalue(), dtype=np.uint8).reshape(height, width, 4)
    return rgba[..., :3].copy()
