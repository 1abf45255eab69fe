"""Readable tables and JSON for evaluation rows."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, row key, format)
    ("controller", "controller", "s"),
    ("trace", "trace", "s"),
    ("rate", "rate_scale", "g"),
    ("done", "completed", "d"),
    ("rej", "rejected", "d"),
    ("goodput/s", "goodput_rps", ".2f"),
    ("tok/s", "throughput_tok_s", ".0f"),
    ("TTFT p50", "ttft_p50_s", ".2f"),
    ("TTFT p99", "ttft_p99_s", ".2f"),
    ("TPOT p99", "tpot_p99_s", ".3f"),
    ("e2e p99", "e2e_p99_s", ".1f"),
    ("SLA%", "sla_attainment", "%"),
    ("worst bkt%", "worst_bucket_sla", "%"),
    ("preempt", "preemptions", "d"),
    ("overflow", "kv_overflows", "d"),
    ("KV peak", "kv_cache_usage_peak", "%"),
    ("hit%", "prefix_hit_rate", "%"),
)


def worst_bucket_sla(row: dict[str, Any]) -> float:
    """Lowest SLA attainment among buckets that saw requests (NaN if none did)."""
    values = [b["sla_attainment"] for b in row.get("per_bucket", {}).values()
              if b.get("sla_attainment") is not None and not _isnan(b["sla_attainment"])]
    return min(values) if values else math.nan


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _cell(value: Any, fmt: str) -> str:
    if value is None or _isnan(value):
        return "-"
    if fmt == "s":
        return str(value)
    if fmt == "%":
        return f"{100 * value:.1f}"
    if fmt == "d":
        return str(int(value))
    return format(value, fmt)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per row, aligned columns (latencies in seconds, SLA and KV in percent)."""
    cells = [[h for h, _, _ in _COLUMNS]]
    for row in rows:
        full = dict(row, worst_bucket_sla=worst_bucket_sla(row))
        cells.append([_cell(full.get(key), fmt) for _, key, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    lines = []
    for n, r in enumerate(cells):
        parts = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                   strict=True))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_buckets(row: dict[str, Any]) -> str:
    """Per-bucket completions, goodput, SLA attainment and P99s of one row."""
    lines = [f"{'bucket':8}  {'done':>6}  {'rej':>5}  {'goodput/s':>9}  {'SLA%':>6}  "
             f"{'TTFT p99':>8}  {'TPOT p99':>8}"]
    for name, b in row.get("per_bucket", {}).items():
        lines.append(f"{name:8}  {b['completed']:>6}  {b.get('rejected', 0):>5}  "
                     f"{_cell(b['goodput_rps'], '.2f'):>9}  {_cell(b['sla_attainment'], '%'):>6}"
                     f"  {_cell(b['ttft_p99_s'], '.2f'):>8}  {_cell(b['tpot_p99_s'], '.3f'):>8}")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as JSON (NaN/inf become null), creating parent folders; the file
    is replaced atomically so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    tmp.replace(path)
