"""Request-level metrics: sliding-window percentiles for control, and run summaries.

Percentiles come from numpy (linear interpolation, numpy's default), never hand-rolled.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbatch.buckets import Buckets
from rlbatch.control.types import SLA, WindowStats, meets_sla
from rlbatch.engine.stats import EngineStats, FinishedRequest


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """``q``-th percentile (0-100) of ``values``; NaN when empty."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


class SlidingWindow:
    """Completions of the last ``window_s`` seconds, for the controller's P99 signals.

    Per-bucket percentiles are recomputed only for buckets whose window content changed
    since the previous call (the expensive part is numpy's call overhead, not the data).

    :param buckets: bucket definitions.
    :param sla: SLA used to count requests meeting it.
    :param window_s: window length in seconds.
    """

    def __init__(self, buckets: Buckets, sla: SLA, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.buckets = buckets
        self.sla = sla
        self.window_s = window_s
        n = len(buckets)
        # per bucket: (finish_s, ttft_s, tpot_s, e2e_s, met_sla)
        self._items: list[deque[tuple[float, float, float, float, bool]]] = [
            deque() for _ in range(n)]
        self._dirty = [True] * n
        self._cache: list[tuple[float, float, int, int]] = [(math.nan, math.nan, 0, 0)] * n
        self._all_cache: tuple[float, float, float] = (math.nan, math.nan, math.nan)

    def add(self, records: Iterable[FinishedRequest]) -> None:
        for rec in records:
            if rec.rejected:
                continue
            self._items[rec.bucket].append((rec.finish_s, rec.ttft_s, rec.tpot_s, rec.e2e_s,
                                            meets_sla(rec, self.sla)))
            self._dirty[rec.bucket] = True

    def stats(self, now_s: float) -> WindowStats:
        horizon = now_s - self.window_s
        any_dirty = False
        for b, items in enumerate(self._items):
            while items and items[0][0] < horizon:
                items.popleft()
                self._dirty[b] = True
            if not self._dirty[b]:
                continue
            any_dirty = True
            self._dirty[b] = False
            if not items:
                self._cache[b] = (math.nan, math.nan, 0, 0)
                continue
            rows = np.array(items, dtype=np.float64)
            ttft, tpot = np.percentile(rows[:, 1:3], 99, axis=0).tolist()
            self._cache[b] = (ttft, tpot, len(rows), int(rows[:, 4].sum()))
        if any_dirty:
            every = [row for items in self._items for row in items]
            if every:
                ttft, tpot, e2e = np.percentile(np.array(every, dtype=np.float64)[:, 1:4], 99,
                                                axis=0).tolist()
                self._all_cache = (ttft, tpot, e2e)
            else:
                self._all_cache = (math.nan, math.nan, math.nan)
        cache = self._cache
        return WindowStats(
            window_s=self.window_s,
            ttft_p99_s=tuple(c[0] for c in cache),
            tpot_p99_s=tuple(c[1] for c in cache),
            ttft_p99_all_s=self._all_cache[0],
            tpot_p99_all_s=self._all_cache[1],
            e2e_p99_all_s=self._all_cache[2],
            completed=tuple(c[2] for c in cache),
            sla_met=tuple(c[3] for c in cache),
        )


@dataclass
class RunTotals:
    """Engine counters summed over a whole run (from EngineStats snapshots)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    kv_overflows: int = 0
    recomputed_tokens: int = 0
    iterations: int = 0
    busy_s: float = 0.0
    kv_cache_usage_peak: float = 0.0

    def add(self, stats: EngineStats) -> None:
        self.prefill_tokens += stats.prefill_tokens
        self.decode_tokens += stats.decode_tokens
        self.preemptions += stats.preemptions
        self.kv_overflows += stats.kv_overflows
        self.recomputed_tokens += stats.recomputed_tokens
        self.iterations += stats.iterations
        self.busy_s += stats.busy_s
        self.kv_cache_usage_peak = max(self.kv_cache_usage_peak, stats.kv_cache_usage_peak)


def _p(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(
    records: Sequence[FinishedRequest],
    buckets: Buckets,
    sla: SLA,
    makespan_s: float,
    totals: RunTotals,
    *,
    submitted: int,
    unfinished: int,
) -> dict[str, Any]:
    """The evaluation row's metric fields (DESIGN.md command contract) for one run.

    :param records: every request that left the system (finished or rejected).
    :param buckets: bucket definitions (names for ``per_bucket``).
    :param sla: the SLA.
    :param makespan_s: simulated time from the first arrival to the end of the run; rates are
        per second of it.
    :param totals: engine counters summed over the run.
    :param submitted: requests in the workload.
    :param unfinished: requests still queued or running when the run stopped (they count
        against SLA attainment).
    """
    done = [r for r in records if not r.rejected]
    rejected = len(records) - len(done)
    span = makespan_s if makespan_s > 0 else math.nan
    ttft = np.array([r.ttft_s for r in done], dtype=np.float64)
    tpot = np.array([r.tpot_s for r in done], dtype=np.float64)
    e2e = np.array([r.e2e_s for r in done], dtype=np.float64)
    met = np.array([meets_sla(r, sla) for r in done], dtype=bool)
    out_tokens = sum(r.output_tokens for r in done)
    decided = len(done) + rejected + unfinished
    per_bucket: dict[str, dict[str, Any]] = {}
    bucket_idx = np.array([r.bucket for r in done], dtype=np.int64)
    submitted_b = [0] * len(buckets)
    for r in records:
        submitted_b[r.bucket] += 1
    for b, name in enumerate(buckets.names):
        mask = bucket_idx == b
        n_done = int(mask.sum())
        n_met = int(met[mask].sum()) if n_done else 0
        n_rej = sum(1 for r in records if r.rejected and r.bucket == b)
        per_bucket[name] = {
            "completed": n_done,
            "rejected": n_rej,
            "goodput_rps": n_met / span,
            "sla_attainment": (n_met / (n_done + n_rej)) if (n_done + n_rej) else math.nan,
            "ttft_p99_s": _p(ttft[mask], 99),
            "tpot_p99_s": _p(tpot[mask], 99),
        }
    return {
        "submitted": submitted,
        "completed": len(done),
        "rejected": rejected,
        "truncated": sum(1 for r in records if r.truncated),
        "unfinished": unfinished,
        "goodput_rps": int(met.sum()) / span,
        "throughput_rps": len(done) / span,
        "throughput_tok_s": out_tokens / span,
        "ttft_p50_s": _p(ttft, 50),
        "ttft_p99_s": _p(ttft, 99),
        "tpot_p50_s": _p(tpot, 50),
        "tpot_p99_s": _p(tpot, 99),
        "e2e_p50_s": _p(e2e, 50),
        "e2e_p99_s": _p(e2e, 99),
        # Every submitted request counts: rejected and unfinished ones did not meet the SLA.
        "sla_attainment": int(met.sum()) / decided if decided else math.nan,
        "preemptions": totals.preemptions,
        "kv_overflows": totals.kv_overflows,
        "kv_cache_usage_peak": totals.kv_cache_usage_peak,
        "prefill_tokens": totals.prefill_tokens,
        "decode_tokens": totals.decode_tokens,
        "batch_efficiency": batch_efficiency(totals),
        "per_bucket": per_bucket,
    }


def batch_efficiency(totals: RunTotals) -> float:
    """Useful tokens / computed tokens.

    With continuous batching and paged KV there is no padding; the waste is KV that was
    computed and then thrown away by preemption (recompute). 1.0 when nothing was preempted,
    lower in preemption storms; NaN before any token was computed.
    """
    computed = totals.prefill_tokens + totals.decode_tokens
    if computed == 0:
        return math.nan
    return max(0.0, computed - totals.recomputed_tokens) / computed
