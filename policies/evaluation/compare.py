"""Judging a controller against the baselines (DESIGN.md "No starving a bucket", issue
targets): per run, per contested regime, and overall.

A run is *contested* when the hindsight-best static cap meets the SLA for 20-95% of requests:
below that every static collapses and ratios mean nothing; above it every controller wins.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

CONTESTED = (0.20, 0.95)
FAIRNESS_POINTS = 0.05


def goodput_ratio(row: dict[str, Any], other: dict[str, Any] | None) -> float:
    """``row``'s goodput over ``other``'s: NaN without ``other`` or when both are 0, ``inf``
    when only ``other``'s is."""
    if other is None:
        return math.nan
    mine, theirs = float(row["goodput_rps"] or 0.0), float(other["goodput_rps"] or 0.0)
    return mine / theirs if theirs > 0 else math.inf if mine > 0 else math.nan


def gmean(values: Sequence[float]) -> float:
    """Geometric mean of the positive, finite ``values`` (NaN if there are none)."""
    kept = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, kept)) / len(kept)) if kept else math.nan


def _is_static(name: str) -> bool:
    return name.startswith("static:")


def _attainments(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, b in row["per_bucket"].items():
        value = b.get("sla_attainment")
        if value is not None and not (isinstance(value, float) and math.isnan(value)) and (
                b.get("completed", 0) or b.get("rejected", 0)):
            out[name] = float(value)
    return out


def starved_buckets(row: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """Buckets whose SLA attainment is more than 5 points below ``reference``'s."""
    mine, ref = _attainments(row), _attainments(reference)
    return [b for b, v in ref.items() if b in mine and mine[b] < v - FAIRNESS_POINTS]


def starved_shortfalls(row: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """:func:`starved_buckets`, each with how many requests the gap is: ``4k+ (4 of 74)``
    when ``reference`` met the SLA for 4 more of the bucket's 74 decided requests (a 5-point
    gap on a small bucket is a handful of requests; the reader should see which)."""
    mine, ref = _attainments(row), _attainments(reference)
    out = []
    for name in starved_buckets(row, reference):
        bucket = reference["per_bucket"][name]
        decided = int(bucket.get("completed", 0)) + int(bucket.get("rejected", 0))
        out.append(f"{name} ({round((ref[name] - mine[name]) * decided)} of {decided})")
    return out


def user_pick_static(rows: Sequence[dict[str, Any]], training_traces: Sequence[str]) -> str:
    """The one static cap a user would pick on the training traffic: the best mean goodput
    over the training-trace runs (all rate scales)."""
    totals: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if _is_static(row["controller"]) and row["trace"] in training_traces:
            totals[row["controller"]].append(float(row["goodput_rps"] or 0.0))
    if not totals:
        raise ValueError(f"no static runs on the training traces {list(training_traces)}")
    return max(totals, key=lambda c: (sum(totals[c]) / len(totals[c]), -int(c.split(":")[1])))


def compare(rows: Sequence[dict[str, Any]], candidate: str, user_pick: str,
            baseline: str = "playbook") -> list[dict[str, Any]]:
    """One verdict per (trace, rate_scale) for ``candidate``.

    Fields: trace, rate_scale, contested, best_static, vs_user_pick, vs_best_static,
    vs_baseline, kv_overflows, starved (buckets more than 5 points below the best static),
    light (best static meets the SLA for > 95%), not_worse_at_light.
    """
    by_run: dict[tuple[str, float], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_run[(row["trace"], float(row["rate_scale"]))][row["controller"]] = row
    verdicts = []
    for (trace, rate), runs in sorted(by_run.items()):
        if candidate not in runs:
            continue
        mine = runs[candidate]
        statics = [r for c, r in runs.items() if _is_static(c)]
        if not statics:
            continue
        best = max(statics, key=lambda r: float(r["goodput_rps"] or 0.0))
        best_attain = float(best["sla_attainment"] or 0.0)
        good = float(mine["goodput_rps"] or 0.0)

        verdicts.append({
            "trace": trace,
            "rate_scale": rate,
            "contested": CONTESTED[0] <= best_attain <= CONTESTED[1],
            "light": best_attain > CONTESTED[1],
            "best_static": best["controller"],
            "best_static_sla": best_attain,
            "goodput_rps": good,
            "vs_user_pick": goodput_ratio(mine, runs.get(user_pick)),
            "vs_best_static": goodput_ratio(mine, best),
            "vs_baseline": goodput_ratio(mine, runs.get(baseline)),
            "kv_overflows": int(mine["kv_overflows"] or 0),
            "starved": starved_buckets(mine, best),
        })
    return verdicts


def format_verdicts(verdicts: Sequence[dict[str, Any]], candidate: str, user_pick: str,
                    baseline: str = "playbook") -> str:
    """A Markdown table of :func:`compare`'s verdicts plus a summary line."""
    lines = [f"| trace | rate | regime | best static (SLA%) | {candidate} goodput/s | "
             f"vs {user_pick} (user's pick) | vs best static | vs {baseline} | KV overflows "
             f"| starved buckets |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for v in verdicts:
        regime = "contested" if v["contested"] else "light" if v["light"] else "collapsed"
        lines.append(
            f"| {v['trace']} | {v['rate_scale']:g} | {regime} | {v['best_static']} "
            f"({100 * v['best_static_sla']:.0f}) | {v['goodput_rps']:.2f} | "
            f"{v['vs_user_pick']:.2f}x | {v['vs_best_static']:.2f}x | {v['vs_baseline']:.2f}x | "
            f"{v['kv_overflows']} | {', '.join(v['starved']) or '-'} |")
    contested = [v for v in verdicts if v["contested"]]
    if contested:
        def gmean(key: str) -> float:
            vals = [v[key] for v in contested if v[key] > 0 and math.isfinite(v[key])]
            return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals else math.nan

        lines.append("")
        lines.append(f"Contested runs: {len(contested)}; geometric mean goodput ratio vs "
                     f"{user_pick}: {gmean('vs_user_pick'):.2f}x, vs best static: "
                     f"{gmean('vs_best_static'):.2f}x, vs {baseline}: "
                     f"{gmean('vs_baseline'):.2f}x; runs with a starved bucket: "
                     f"{sum(1 for v in contested if v['starved'])}; KV overflows: "
                     f"{sum(v['kv_overflows'] for v in verdicts)}.")
    light = [v for v in verdicts if v["light"]]
    if light:
        worse = [v for v in light if v["vs_best_static"] < 0.99]
        lines.append(f"Light-load runs: {len(light)}; worse than the best static (< 0.99x): "
                     f"{len(worse)}.")
    return "\n".join(lines)
