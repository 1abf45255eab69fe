"""Run metrics, the sliding window, the snapshot's derived fields and the metric table."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.control.guard import RULES
from rlbatch.control.stats_metrics import (
    METRICS,
    MetricContext,
    metric,
    tensorboard_scalars,
)
from rlbatch.control.types import SLA, DeploymentStats
from rlbatch.engine.stats import FinishedRequest, batch_efficiency
from rlbatch.serving.deadlines import DeadlineTracker
from rlbatch.serving.metrics import (
    RunTotals,
    SlidingWindow,
    percentile_of_sorted,
    summarize,
)
from tests.factories import (
    BUCKETS,
    deployment_stats,
    engine_stats,
    random_deployment_stats,
    record,
)

SLA_ = SLA(ttft_s=1.0, tpot_s=0.05)
CTX = MetricContext(BUCKETS.names, ("fp16", "fp8"))

record_st = st.builds(
    lambda i, b, ttft, tpot, rej, trunc: FinishedRequest(
        request_id=i, bucket=b, pool="" if rej else "fp16", arrival_s=0.0, prompt_tokens=10,
        output_tokens=0 if rej else 5, ttft_s=math.nan if rej else ttft,
        tpot_s=math.nan if rej else tpot, e2e_s=math.nan if rej else ttft + 4 * tpot,
        finish_s=1.0, truncated=trunc, rejected=rej),
    st.integers(0, 10**6), st.integers(0, 2), st.floats(0.0, 3.0), st.floats(0.0, 0.2),
    st.booleans(), st.booleans())


# ---------------------------------------------------------------- summarize
@settings(max_examples=60, deadline=None)
@given(records=st.lists(record_st, max_size=40), unfinished=st.integers(0, 10))
def test_summarize_conserves_counts(records: list[FinishedRequest], unfinished: int) -> None:
    submitted = len(records) + unfinished
    row = summarize(records, BUCKETS, SLA_, 10.0, RunTotals(), submitted=submitted,
                    unfinished=unfinished)
    n_rej = sum(r.rejected for r in records)
    assert row["completed"] + row["rejected"] + row["unfinished"] == submitted
    assert row["rejected"] == n_rej
    assert row["truncated"] == sum(r.truncated for r in records)
    per = row["per_bucket"]
    assert list(per) == list(BUCKETS.names)
    assert sum(b["completed"] for b in per.values()) == row["completed"]
    assert sum(b["rejected"] for b in per.values()) == row["rejected"]
    met = sum(1 for r in records if not r.rejected and r.ttft_s <= 1.0 and r.tpot_s <= 0.05)
    assert row["goodput_rps"] == pytest.approx(met / 10.0)
    assert sum(b["goodput_rps"] for b in per.values()) == pytest.approx(row["goodput_rps"])
    assert row["goodput_rps"] <= row["throughput_rps"] + 1e-12
    if submitted:
        assert row["sla_attainment"] == pytest.approx(met / submitted)
    else:
        assert math.isnan(row["sla_attainment"])


def test_summarize_reads_the_totals() -> None:
    totals = RunTotals()
    totals.add(engine_stats(prefill=300, decode=100, recomputed=100, preemptions=2,
                            kv_overflows=1, kv=0.5, finished=(record(0, 0),)))
    row = summarize([record(0, 0)], BUCKETS, SLA_, 1.0, totals, submitted=1, unfinished=0)
    assert (row["preemptions"], row["kv_overflows"], row["prefill_tokens"]) == (2, 1, 300)
    assert row["batch_efficiency"] == 0.75 and row["kv_cache_usage_peak"] == 0.5


def test_fp8_token_share_counts_the_tokens_served_in_fp8() -> None:
    records = [record(0, 0, pool="fp8", output_tokens=30), record(1, 0, output_tokens=50),
               record(2, 1, rejected=True)]
    row = summarize(records, BUCKETS, SLA_, 1.0, RunTotals(), submitted=3, unfinished=0)
    assert row["fp8_token_share"] == pytest.approx((10 + 30) / (10 + 30 + 10 + 50))
    none = summarize([], BUCKETS, SLA_, 1.0, RunTotals(), submitted=0, unfinished=0)
    assert none["fp8_token_share"] == 0.0


# ---------------------------------------------------------------- accumulator, efficiency
@pytest.mark.parametrize("computed,recomputed,expected", [
    (0, 0, math.nan), (100, 0, 1.0), (100, 25, 0.75), (10, 20, 0.0)])
def test_batch_efficiency_formula(computed: int, recomputed: int, expected: float) -> None:
    got = batch_efficiency(computed, recomputed)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


@settings(max_examples=40, deadline=None)
@given(stats=st.lists(random_deployment_stats(), min_size=1, max_size=5))
def test_run_totals_sum_every_snapshot(stats: list[DeploymentStats]) -> None:
    totals = RunTotals()
    snaps = [es for s in stats for es in s.engines]
    for es in snaps:
        totals.add(es)
    assert totals.snapshots == len(snaps)
    assert totals.prefill_tokens == sum(es.prefill_tokens for es in snaps)
    assert totals.decode_tokens == sum(es.decode_tokens for es in snaps)
    assert totals.preemptions == sum(es.preemptions for es in snaps)
    assert totals.finished == sum(len(es.finished) for es in snaps)
    assert totals.output_tokens == sum(r.output_tokens for es in snaps for r in es.finished)
    assert totals.max_running == max(sum(es.running) for es in snaps)
    computed = totals.prefill_tokens + totals.decode_tokens
    eff = totals.batch_efficiency
    assert (computed == 0 and math.isnan(eff)) or eff == batch_efficiency(
        computed, totals.recomputed_tokens)


# ---------------------------------------------------------------- snapshot derived fields
@settings(max_examples=60, deadline=None)
@given(stats=random_deployment_stats())
def test_derived_fields_match_loops_over_engines(stats: DeploymentStats) -> None:
    engines = stats.engines
    for b in range(3):
        assert stats.running_per_bucket[b] == sum(e.running[b] for e in engines)
        assert stats.waiting_per_bucket[b] == sum(e.waiting[b] for e in engines)
        assert stats.in_engines_per_bucket[b] == (stats.running_per_bucket[b]
                                                  + stats.waiting_per_bucket[b])
    assert stats.running_total == sum(stats.running_per_bucket)
    assert stats.waiting_total == sum(stats.waiting_per_bucket)
    assert stats.preemptions == sum(e.preemptions for e in engines)
    assert stats.kv_overflows == sum(e.kv_overflows for e in engines)
    assert stats.finished_count == len(stats.finished) == sum(len(e.finished) for e in engines)
    assert stats.computed_tokens == stats.prefill_tokens + stats.decode_tokens
    assert stats.throughput_tok_s == stats.decode_tokens / stats.tick_s
    usage = [e.kv_cache_usage for e in engines]
    if not any(math.isnan(u) for u in usage):
        assert stats.kv_cache_usage_max == max(usage)
    assert stats.pool_engines("fp16") == tuple(e for e in engines if e.pool == "fp16")


def test_derived_fields_of_an_empty_deployment() -> None:
    stats = deployment_stats(())
    assert stats.kv_cache_usage_max == 0.0 and stats.kv_committed_max == 0.0
    assert stats.running_per_bucket == (0, 0, 0) and math.isnan(stats.batch_efficiency)


# ---------------------------------------------------------------- sliding window
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(0.0, 100.0), st.integers(0, 2), st.floats(0.0, 3.0),
                               st.floats(0.0, 0.2)), max_size=60),
       now=st.floats(0.0, 130.0))
def test_sliding_window_percentiles_match_numpy(
        rows: list[tuple[float, int, float, float]], now: float) -> None:
    rows = sorted(rows)
    win = SlidingWindow(BUCKETS, SLA_, 30.0)
    recs = [record(i, b, ttft=ttft, tpot=tpot, finish=f)
            for i, (f, b, ttft, tpot) in enumerate(rows)]
    win.add(recs)
    win.add([record(999, 0, rejected=True, finish=now)])  # rejected: never in the window
    got = win.stats(now)
    live = [r for r in recs if r.finish_s >= now - 30.0]
    for b in range(3):
        mine = [r for r in live if r.bucket == b]
        assert got.completed[b] == len(mine)
        assert got.sla_met[b] == sum(r.ttft_s <= 1.0 and r.tpot_s <= 0.05 for r in mine)
        if mine:
            assert got.ttft_p99_s[b] == pytest.approx(np.percentile([r.ttft_s for r in mine], 99))
            assert got.tpot_p99_s[b] == pytest.approx(np.percentile([r.tpot_s for r in mine], 99))
        else:
            assert math.isnan(got.ttft_p99_s[b])
    if live:
        assert got.e2e_p99_all_s == pytest.approx(np.percentile([r.e2e_s for r in live], 99))
    else:
        assert math.isnan(got.ttft_p99_all_s)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.floats(0.0, 1e4), st.sampled_from([0.0, 0.5, 2.0])),
                       min_size=1, max_size=300),
       q=st.sampled_from([0.0, 1.0, 50.0, 90.0, 95.0, 99.0, 99.9, 100.0]))
def test_percentile_of_sorted_is_numpy_to_the_bit(values: list[float], q: float) -> None:
    assert percentile_of_sorted(sorted(values), q) == np.percentile(values, q)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 0.2), st.integers(0, 2)),
                     min_size=1, max_size=200))
def test_sliding_window_equals_numpy_tick_after_tick(
        rows: list[tuple[float, float, int]]) -> None:
    """Completions come and go over many ticks: every figure is numpy's on the window."""
    win = SlidingWindow(BUCKETS, SLA_, 5.0)
    recs = [record(i, b, ttft=ttft, tpot=tpot, finish=0.25 * (i + 1))
            for i, (ttft, tpot, b) in enumerate(rows)]
    for tick in range(1, len(recs) // 4 + 12):
        now = float(tick)
        win.add([r for r in recs if now - 1.0 < r.finish_s <= now])
        got = win.stats(now)
        live = [r for r in recs if now - 5.0 <= r.finish_s <= now]
        for b in range(3):
            mine = [r for r in live if r.bucket == b]
            if mine:
                assert got.ttft_p99_s[b] == np.percentile([r.ttft_s for r in mine], 99)
                assert got.tpot_p99_s[b] == np.percentile([r.tpot_s for r in mine], 99)
            assert got.completed[b] == len(mine)
        if live:
            assert got.tpot_p99_all_s == np.percentile([r.tpot_s for r in live], 99)
            assert got.e2e_p99_all_s == np.percentile([r.e2e_s for r in live], 99)


def test_deadlines_accepted_out_of_arrival_order_are_swept_too() -> None:
    tracker = DeadlineTracker(3, ttft_s=1.0)
    tracker.accept([(0, 5.0, 0), (1, 2.0, 1), (2, 6.0, 2)])  # 1 arrived before 0
    assert tracker.update(3.5, []) == (0, 1, 0)
    assert tracker.update(7.5, []) == (1, 0, 1)
    assert tracker.doomed_open == [1, 1, 1]


def test_oldest_unserved_reads_every_queue_and_forgets_the_served() -> None:
    tracker = DeadlineTracker(3, ttft_s=1.0)
    assert tracker.oldest_unserved_s(0.0) == 0.0
    tracker.accept([(0, 1.0, 0), (1, 2.0, 1), (2, 0.5, 2)])  # 2 out of arrival order
    tracker.update(1.2, [])
    assert tracker.oldest_unserved_s(1.2) == pytest.approx(0.7)
    tracker.update(1.6, [engine_stats(first_tokens=((2, 1.55),))])  # 2 late, now served
    assert tracker.oldest_unserved_s(1.6) == pytest.approx(0.6)
    tracker.update(2.5, [])  # 0 doomed without a first token: still the oldest
    assert tracker.oldest_unserved_s(2.5) == pytest.approx(1.5)
    tracker.update(2.6, [engine_stats(first_tokens=((0, 2.55),))])
    assert tracker.oldest_unserved_s(2.6) == pytest.approx(0.6)
    tracker.update(2.7, [engine_stats(finished=(record(1, 1, ttft=0.6),))])
    assert tracker.oldest_unserved_s(2.7) == 0.0


def test_sliding_window_forgets_old_completions() -> None:
    win = SlidingWindow(BUCKETS, SLA_, 10.0)
    win.add([record(0, 0, ttft=2.0, finish=1.0), record(1, 0, ttft=0.5, finish=8.0)])
    assert win.stats(9.0).completed == (2, 0, 0)
    later = win.stats(15.0)
    assert later.completed == (1, 0, 0) and later.ttft_p99_s[0] == 0.5


# ---------------------------------------------------------------- metric table
def test_metric_names_and_tags_are_unique() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    stats = deployment_stats((engine_stats(),))
    tags = [m.tb_tag(label) for m in METRICS for label, _ in m.values(stats, CTX)]
    assert len(tags) == len(set(tags))
    assert all(m.kind in ("gauge", "counter") for m in METRICS)
    assert all(m.group in ("rollout", "engine", "decision", "guard") for m in METRICS)
    assert metric("guard_overrides").tb_name == "guard/guard_overrides"
    with pytest.raises(KeyError, match="no metric"):
        metric("nope")


@settings(max_examples=40, deadline=None)
@given(stats=random_deployment_stats())
def test_every_metric_reads_one_value_per_label(stats: DeploymentStats) -> None:
    for m in METRICS:
        values = m.read(stats, CTX)
        assert len(values) == len(m.label_values(CTX)), m.name
        assert all(isinstance(v, float) for v in values), m.name


def test_table_values_and_tags() -> None:
    stats = deployment_stats(
        (engine_stats(0, "fp16", kv=0.3, running=(1, 2, 0)),
         engine_stats(1, "fp8", kv=0.6, running=(0, 1, 0), preemptions=3)),
        queued=(4, 0, 1), caps=(8, None, 2), pools=("fp16", "fp8", "fp16"))
    scalars = tensorboard_scalars(stats, MetricContext(BUCKETS.names, ("fp16", "fp8"),
                                                       {"kv_high": 2}))
    b0, b1, _ = BUCKETS.names
    assert scalars[f"rollout/queue_length/{b0}"] == 4.0
    assert scalars[f"decision/batch_cap/{b1}"] == math.inf
    assert scalars[f"decision/pool_index/{b1}"] == 1.0
    assert scalars[f"engine/requests_running/{b1}"] == 3.0
    assert scalars["engine/kv_cache_usage/fp8"] == 0.6
    assert scalars["engine/preemptions"] == 3.0
    assert scalars["guard/guard_overrides/kv_high"] == 2.0
    assert {f"guard/guard_overrides/{r}" for r in RULES} <= set(scalars)
