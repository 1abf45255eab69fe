"""The sidecar's view of one upstream: its /metrics page parsed, the busy time and the waits
it reports to the control loop."""

from __future__ import annotations

import asyncio

import pytest

from rlbatch.request import Request
from rlbatch.sidecar import UpstreamSpec
from rlbatch.sidecar.upstream import HttpUpstream, Ticket
from rlbatch.sidecar.vllm_metrics import (
    MetricsParseError,
    counter_delta,
    parse_vllm_metrics,
)

METRICS_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 2.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.79e+09
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 700.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1100.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"} 5.0
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 90.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny"} 2.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"} 1000.0
vllm:cache_config_info{block_size="32",cache_dtype="fp8",engine="0",num_gpu_blocks="2048"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
python_gc_objects_collected_total{generation="0"} 1.0
"""


def _page(values: dict[str, float]) -> str:
    """:data:`METRICS_PAGE` with each named series (``name{labels} value`` lines) set to its
    value."""
    lines = []
    for line in METRICS_PAGE.splitlines():
        name = line.partition("{")[0]
        if name in values:
            line = f"{line.rpartition(' ')[0]} {values[name]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _upstream() -> HttpUpstream:
    return HttpUpstream(0, UpstreamSpec("fp16", "http://127.0.0.1:9"), 1, {}, lambda: 0.0, 64)


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(METRICS_PAGE)
    assert (m.running, m.waiting, m.kv_cache_usage) == (3.0, 1.0, 0.25)
    assert (m.preemptions_total, m.prompt_tokens_total, m.generation_tokens_total) == (
        2.0, 700.0, 1100.0)
    assert m.iterations_total == 90.0 and m.itl_count == 1000.0
    assert m.kv_capacity_tokens == 2048 * 32
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (640.0, 512.0)
    plain = parse_vllm_metrics(METRICS_PAGE.replace("vllm:prefix_cache", "vllm:other"))
    assert (plain.prefix_cache_queries_total, plain.prefix_cache_hits_total) == (0.0, 0.0)
    with pytest.raises(MetricsParseError, match="num_requests_running"):
        parse_vllm_metrics("python_gc_objects_collected_total 1.0\n")
    assert counter_delta(10.0, 4.0) == 6.0
    assert counter_delta(3.0, 40.0) == 3.0  # the server restarted
    assert counter_delta(3.0, None) == 0.0


def test_upstream_busy_time_is_iterations_times_the_mean_inter_token_latency() -> None:
    # vLLM exports no step time: the guard's P99 rule reads busy / iterations, which behind
    # the sidecar is the interval's mean inter-token latency
    upstream = _upstream()

    def scrape(iterations: float, itl_sum: float, itl_count: float) -> tuple[int, float]:
        upstream.observe(parse_vllm_metrics(_page({
            "vllm:iteration_tokens_total_count": iterations,
            "vllm:inter_token_latency_seconds_sum": itl_sum,
            "vllm:inter_token_latency_seconds_count": itl_count})))
        es = upstream.snapshot()
        return es.iterations, es.busy_s

    assert scrape(90.0, 2.0, 1000.0) == (0, 0.0)  # the first scrape is the baseline
    # 50 steps, 400 inter-token gaps summing 10 s: a decoding request waited 25 ms a step
    assert scrape(140.0, 12.0, 1400.0) == (50, 50 * 0.025)
    assert scrape(150.0, 12.0, 1400.0) == (10, 0.0)  # prefill only: no step time to read
    assert upstream.itl_mean_s == 0.025
    # the server restarted: 500 gaps summing 13 s since, although the sum alone looks grown
    assert scrape(20.0, 13.0, 500.0) == (20, 20 * (13.0 / 500.0))


def test_upstream_reports_how_long_the_engine_wide_cap_holds_its_oldest() -> None:
    loop = asyncio.new_event_loop()
    try:
        tickets: dict[int, Ticket] = {}
        upstream = HttpUpstream(0, UpstreamSpec("fp16", "http://127.0.0.1:9"), 1, tickets,
                                lambda: 0.0, 64)
        upstream.set_max_num_seqs(1)
        for i, arrival in enumerate((0.0, 2.0, 1.0)):  # the last a retry from another replica
            ticket = Ticket(Request(i, arrival, 100, 10), 0, loop.create_future())
            tickets[i] = ticket
            upstream.add_request(ticket.request, 0, 100, False)
        assert upstream.oldest_waiting_s(5.0) == 4.0  # request 0 runs; 2 waits longest
        upstream.release(tickets[2])
        assert upstream.oldest_waiting_s(5.0) == 3.0
        upstream.clear_max_num_seqs()
        assert upstream.oldest_waiting_s(5.0) == 0.0
    finally:
        loop.close()


def test_upstream_reports_the_prefix_cache_lookups_of_the_interval() -> None:
    upstream = _upstream()

    def scrape(queries: float, hits: float) -> tuple[int, int]:
        upstream.observe(parse_vllm_metrics(_page({"vllm:prefix_cache_queries_total": queries,
                                                   "vllm:prefix_cache_hits_total": hits})))
        es = upstream.snapshot()
        return es.prefix_cache_queries, es.prefix_cache_hits

    assert scrape(640.0, 512.0) == (0, 0)  # the first scrape is the baseline
    assert scrape(2640.0, 2012.0) == (2000, 1500)
    assert scrape(300.0, 10.0) == (300, 10)  # the server restarted
