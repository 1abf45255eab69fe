"""Request-level metrics: sliding-window percentiles for control, and run summaries.

Percentiles follow numpy's default (linear interpolation). Run summaries call numpy; the
sliding window, read at every control tick, keeps its values sorted as they come and go and
reads the percentile off them with numpy's own float operations
(:func:`percentile_of_sorted`: the same bits as ``np.percentile``, checked by the tests).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

import numpy as np

from rlbatch.buckets import Buckets
from rlbatch.control.types import SLA, WindowStats, meets_sla, within_sla
from rlbatch.engine.stats import EngineStats, FinishedRequest, batch_efficiency


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """``q``-th percentile (0-100) of ``values``; NaN when empty."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def percentile_of_sorted(ordered: Sequence[float], q: float) -> float:
    """``np.percentile(ordered, q)`` (method ``linear``) of an ascending, NaN-free sequence,
    computed with numpy's float operations in numpy's order (virtual index ``(n-1) * q/100``,
    then its ``_lerp``), so that both give the same bits; NaN when empty.

    :param ordered: the values, sorted ascending, no NaN.
    :param q: the percentile, 0-100.
    """
    n = len(ordered)
    if n == 0:
        return math.nan
    virtual = (n - 1) * (q / 100.0)
    if virtual >= n - 1:
        # numpy takes the last value on both sides, with gamma = virtual - (-1)
        below = above = ordered[-1]
        gamma = virtual + 1.0
    else:
        index = math.floor(virtual)
        below, above = ordered[index], ordered[index + 1]
        gamma = virtual - index
    diff = above - below
    if gamma >= 0.5:
        return above - diff * (1.0 - gamma)
    return below + diff * gamma


class _SortedValues:
    """A multiset of floats kept sorted (insert and remove by value), NaNs counted apart."""

    __slots__ = ("nans", "values")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.nans = 0

    def add(self, value: float) -> None:
        if value != value:
            self.nans += 1
        else:
            bisect.insort(self.values, value)

    def remove(self, value: float) -> None:
        if value != value:
            self.nans -= 1
        else:
            del self.values[bisect.bisect_left(self.values, value)]

    def percentile(self, q: float) -> float:
        """numpy's percentile of the values (NaN when any value is NaN, as numpy)."""
        return math.nan if self.nans else percentile_of_sorted(self.values, q)


class SlidingWindow:
    """Completions of the last ``window_s`` seconds, for the controller's P99 signals.

    Completions leave the window in arrival order (the oldest first while older than the
    horizon); each bucket's TTFT and TPOT and all buckets' TTFT, TPOT and e2e are kept sorted
    as they enter and leave, and percentiles are recomputed only for buckets whose window
    content changed since the previous call.

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
        # sorted values: per bucket (ttft, tpot); all buckets (ttft, tpot, e2e)
        self._sorted = [(_SortedValues(), _SortedValues()) for _ in range(n)]
        self._sorted_all = (_SortedValues(), _SortedValues(), _SortedValues())
        self._met = [0] * n
        self._dirty = [True] * n
        # per bucket, as of the last stats(): TTFT P99, TPOT P99, completions, SLA met
        self._ttft_p99 = [math.nan] * n
        self._tpot_p99 = [math.nan] * n
        self._completed = [0] * n
        self._last: WindowStats | None = None

    def add(self, records: Iterable[FinishedRequest]) -> None:
        every = self._sorted_all
        every_ttft, every_tpot, every_e2e = (v.values for v in every)
        insort = bisect.insort
        for rec in records:
            if rec.rejected:
                continue
            bucket = rec.bucket
            met = meets_sla(rec, self.sla)
            t1, t2, t3 = rec.ttft_s, rec.tpot_s, rec.e2e_s
            self._items[bucket].append((rec.finish_s, t1, t2, t3, met))
            ttft, tpot = self._sorted[bucket]
            if t1 == t1 and t2 == t2 and t3 == t3:  # no NaN: straight into the lists
                insort(ttft.values, t1)
                insort(tpot.values, t2)
                insort(every_ttft, t1)
                insort(every_tpot, t2)
                insort(every_e2e, t3)
            else:
                for values, value in ((ttft, t1), (tpot, t2), (every[0], t1),
                                      (every[1], t2), (every[2], t3)):
                    values.add(value)
            self._met[bucket] += met
            self._dirty[bucket] = True

    def stats(self, now_s: float) -> WindowStats:
        horizon = now_s - self.window_s
        any_dirty = False
        every_ttft, every_tpot, every_e2e = self._sorted_all
        all_ttft, all_tpot, all_e2e = every_ttft.values, every_tpot.values, every_e2e.values
        bisect_left = bisect.bisect_left
        p99, nan = percentile_of_sorted, math.nan
        for b, items in enumerate(self._items):
            if items and items[0][0] < horizon:
                ttft, tpot = self._sorted[b]
                ttft_v, tpot_v = ttft.values, tpot.values
                while items and items[0][0] < horizon:
                    _, t1, t2, t3, met = items.popleft()
                    if t1 == t1 and t2 == t2 and t3 == t3:  # no NaN: straight from the lists
                        del ttft_v[bisect_left(ttft_v, t1)]
                        del tpot_v[bisect_left(tpot_v, t2)]
                        del all_ttft[bisect_left(all_ttft, t1)]
                        del all_tpot[bisect_left(all_tpot, t2)]
                        del all_e2e[bisect_left(all_e2e, t3)]
                    else:
                        for sv, value in ((ttft, t1), (tpot, t2), (every_ttft, t1),
                                          (every_tpot, t2), (every_e2e, t3)):
                            sv.remove(value)
                    self._met[b] -= met
                self._dirty[b] = True
            if not self._dirty[b]:
                continue
            any_dirty = True
            self._dirty[b] = False
            self._completed[b] = len(items)
            if not items:
                self._ttft_p99[b] = self._tpot_p99[b] = math.nan
                continue
            # _SortedValues.percentile, inline (several per tick)
            ttft, tpot = self._sorted[b]
            self._ttft_p99[b] = nan if ttft.nans else p99(ttft.values, 99)
            self._tpot_p99[b] = nan if tpot.nans else p99(tpot.values, 99)
        if not any_dirty and self._last is not None:
            return self._last  # nothing entered or left: the same (immutable) figures
        self._last = WindowStats(
            window_s=self.window_s,
            ttft_p99_s=tuple(self._ttft_p99),
            tpot_p99_s=tuple(self._tpot_p99),
            ttft_p99_all_s=nan if every_ttft.nans else p99(all_ttft, 99),
            tpot_p99_all_s=nan if every_tpot.nans else p99(all_tpot, 99),
            e2e_p99_all_s=nan if every_e2e.nans else p99(all_e2e, 99),
            completed=tuple(self._completed),
            sla_met=tuple(self._met),
        )
        return self._last


@dataclass
class RunTotals:
    """Engine counters summed over a run: the one accumulator of EngineStats snapshots.

    :param prefill_tokens: prompt tokens computed (recomputation included).
    :param decode_tokens: output tokens generated.
    :param preemptions: requests preempted.
    :param kv_overflows: iterations in which a running request could not get a KV block.
    :param recomputed_tokens: KV tokens thrown away by preemption.
    :param iterations: engine iterations.
    :param busy_s: engine time spent in iterations, summed over engines.
    :param kv_cache_usage_peak: highest KV usage fraction of any engine.
    :param finished: requests that finished.
    :param output_tokens: tokens generated by the finished requests.
    :param max_running: most sequences one engine ran at a snapshot.
    :param gpu_memory_used_peak_bytes: most GPU memory one engine reported in use.
    :param gpu_memory_total_bytes: device memory, as the last snapshot reported it.
    :param num_kv_blocks: KV blocks of the last snapshot's engine.
    :param snapshots: snapshots folded in.
    :param prefix_cache_queries: prompt tokens looked up in the prefix cache (first
        admissions).
    :param prefix_cache_hits: of those, tokens found cached.
    :param prefix_cache_evictions: cached KV blocks evicted.
    :param kv_offload_hits: the host KV tier's counters, summed (each as its
        :class:`~rlbatch.engine.stats.EngineStats` field; ``kv_offload_loads`` ...
        ``kv_offload_evictions`` likewise).
    :param kv_offload_usage_peak: the tier's highest occupancy of any engine at a snapshot.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    kv_overflows: int = 0
    recomputed_tokens: int = 0
    iterations: int = 0
    busy_s: float = 0.0
    kv_cache_usage_peak: float = 0.0
    finished: int = 0
    output_tokens: int = 0
    max_running: int = 0
    gpu_memory_used_peak_bytes: int = 0
    gpu_memory_total_bytes: int = 0
    num_kv_blocks: int = 0
    snapshots: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    kv_offload_hits: int = 0
    kv_offload_loads: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_load_bytes: int = 0
    kv_offload_load_s: float = 0.0
    kv_offload_stored_blocks: int = 0
    kv_offload_store_bytes: int = 0
    kv_offload_evictions: int = 0
    kv_offload_usage_peak: float = 0.0

    def add(self, stats: EngineStats) -> None:
        """Fold one engine snapshot in.

        :param stats: the snapshot.
        """
        self.prefill_tokens += stats.prefill_tokens
        self.decode_tokens += stats.decode_tokens
        self.preemptions += stats.preemptions
        self.kv_overflows += stats.kv_overflows
        self.recomputed_tokens += stats.recomputed_tokens
        self.iterations += stats.iterations
        self.busy_s += stats.busy_s
        self.kv_cache_usage_peak = max(self.kv_cache_usage_peak, stats.kv_cache_usage_peak)
        if stats.finished:
            self.finished += len(stats.finished)
            self.output_tokens += sum([r.output_tokens for r in stats.finished])
        self.max_running = max(self.max_running, stats.running_total)
        self.gpu_memory_used_peak_bytes = max(self.gpu_memory_used_peak_bytes,
                                              stats.gpu_memory_used_bytes)
        self.gpu_memory_total_bytes = stats.gpu_memory_total_bytes
        self.num_kv_blocks = stats.num_kv_blocks
        self.snapshots += 1
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.prefix_cache_evictions += stats.prefix_cache_evictions
        if stats.kv_offload_num_blocks:
            self.kv_offload_hits += stats.kv_offload_hits
            self.kv_offload_loads += stats.kv_offload_loads
            self.kv_offload_loaded_blocks += stats.kv_offload_loaded_blocks
            self.kv_offload_load_bytes += stats.kv_offload_load_bytes
            self.kv_offload_load_s += stats.kv_offload_load_s
            self.kv_offload_stored_blocks += stats.kv_offload_stored_blocks
            self.kv_offload_store_bytes += stats.kv_offload_store_bytes
            self.kv_offload_evictions += stats.kv_offload_evictions
            self.kv_offload_usage_peak = max(self.kv_offload_usage_peak, stats.kv_offload_usage)

    @property
    def batch_efficiency(self) -> float:
        """Useful / computed tokens over the run (see
        :func:`rlbatch.engine.stats.batch_efficiency`)."""
        return batch_efficiency(self.prefill_tokens + self.decode_tokens,
                                self.recomputed_tokens)

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix-cache hits / queries in tokens (vLLM's hit rate); 0 without queries."""
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def kv_offload_hit_rate(self) -> float:
        """Tokens loaded from the host tier / prompt tokens looked up (the prefix cache's
        queries), so that it adds to :attr:`prefix_hit_rate`; 0 without queries."""
        if not self.prefix_cache_queries:
            return 0.0
        return self.kv_offload_hits / self.prefix_cache_queries


def _p(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _per_bucket(buckets: Buckets, bucket_idx: np.ndarray, refused: Sequence[FinishedRequest],
                met: np.ndarray, ttft: np.ndarray, tpot: np.ndarray, span: float,
                abandoned: Sequence[int]) -> dict[str, dict[str, Any]]:
    """The row's ``per_bucket`` field: each bucket's completions, refusals, goodput,
    attainment (abandoned requests count against it) and P99s (``bucket_idx``, ``met``,
    ``ttft``, ``tpot``: one entry per completed request)."""
    rejected_b = [0] * len(buckets)
    for r in refused:
        rejected_b[r.bucket] += 1
    per_bucket: dict[str, dict[str, Any]] = {}
    for b, name in enumerate(buckets.names):
        mask = bucket_idx == b
        n_done = int(mask.sum())
        n_met = int(met[mask].sum()) if n_done else 0
        n_rej = rejected_b[b] + abandoned[b]
        per_bucket[name] = {
            "completed": n_done,
            "rejected": n_rej,
            "goodput_rps": n_met / span,
            "sla_attainment": (n_met / (n_done + n_rej)) if (n_done + n_rej) else math.nan,
            "ttft_p99_s": _p(ttft[mask], 99),
            "tpot_p99_s": _p(tpot[mask], 99),
        }
    return per_bucket


def summarize(
    records: Sequence[FinishedRequest],
    buckets: Buckets,
    sla: SLA,
    makespan_s: float,
    totals: RunTotals,
    *,
    submitted: int,
    unfinished: int,
    abandoned: Sequence[int] | None = None,
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
    :param abandoned: per bucket, requests whose client gave up (they count against SLA
        attainment); ``None``: none.
    """
    done = [r for r in records if not r.rejected]
    refused = [r for r in records if r.rejected]
    rejected, n = len(refused), len(done)
    span = makespan_s if makespan_s > 0 else math.nan
    # each column in one pass in C (a run has tens of thousands of records)
    ttft = np.fromiter(map(attrgetter("ttft_s"), done), np.float64, n)
    tpot = np.fromiter(map(attrgetter("tpot_s"), done), np.float64, n)
    e2e = np.fromiter(map(attrgetter("e2e_s"), done), np.float64, n)
    met = within_sla(ttft, tpot, sla)  # meets_sla of each (none is rejected)
    out_tokens = sum(map(attrgetter("output_tokens"), done))
    served_tokens = sum(map(attrgetter("prompt_tokens"), done)) + out_tokens
    fp8_tokens = sum(r.prompt_tokens + r.output_tokens for r in done if r.pool == "fp8")
    gave_up = [0] * len(buckets) if abandoned is None else list(abandoned)
    decided = len(done) + rejected + unfinished + sum(gave_up)
    bucket_idx = np.fromiter(map(attrgetter("bucket"), done), np.int64, n)
    per_bucket = _per_bucket(buckets, bucket_idx, refused, met, ttft, tpot, span, gave_up)
    return {
        "submitted": submitted,
        "completed": len(done),
        "rejected": rejected,
        "truncated": sum(map(attrgetter("truncated"), records)),
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
        # the SLA judged against: training draws one per workload, and a P99 reads against it
        "sla_ttft_s": sla.ttft_s,
        "sla_tpot_s": sla.tpot_s,
        "preemptions": totals.preemptions,
        "kv_overflows": totals.kv_overflows,
        "kv_cache_usage_peak": totals.kv_cache_usage_peak,
        "prefill_tokens": totals.prefill_tokens,
        "decode_tokens": totals.decode_tokens,
        "batch_efficiency": totals.batch_efficiency,
        "prefix_hit_rate": totals.prefix_hit_rate,
        "prefix_cache_hits": totals.prefix_cache_hits,
        "prefix_cache_queries": totals.prefix_cache_queries,
        "prefix_cache_evictions": totals.prefix_cache_evictions,
        # the host KV tier: every RunTotals counter, by its name
        "kv_offload_hit_rate": totals.kv_offload_hit_rate,
        **{f.name: getattr(totals, f.name) for f in fields(totals)
           if f.name.startswith("kv_offload_")},
        # FP8 KV costs quality (the guide: <= 1.5%): how much of the work it served.
        "fp8_token_share": fp8_tokens / served_tokens if served_tokens else 0.0,
        "per_bucket": per_bucket,
    }
