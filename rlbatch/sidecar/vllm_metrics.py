"""Read a vLLM server's ``/metrics`` page (Prometheus text format) into one small record.

Only the series the sidecar needs are kept (names as vLLM V1 exports them, see
``vllm/v1/metrics/loggers.py``); the page (~50 kB) is filtered line by line first and the
remaining samples go through ``prometheus_client.parser``. Several engines behind one server
(data parallel: one ``engine`` label each) are summed, KV usage takes the fullest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
ITERATIONS = "vllm:iteration_tokens_total_count"
ITL_SUM = "vllm:inter_token_latency_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"

WANTED: frozenset[str] = frozenset({RUNNING, WAITING, KV_USAGE, PREEMPTIONS, PROMPT_TOKENS,
                                    GENERATION_TOKENS, ITERATIONS, ITL_SUM, ITL_COUNT,
                                    CACHE_CONFIG, PREFIX_QUERIES, PREFIX_HITS})


class MetricsParseError(ValueError):
    """The page is not a vLLM metrics page (a required series is missing or unreadable)."""


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """The series of one scrape (gauges as read, counters as totals since the server started).

    :param running: ``vllm:num_requests_running``.
    :param waiting: ``vllm:num_requests_waiting``.
    :param kv_cache_usage: ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full).
    :param preemptions_total: ``vllm:num_preemptions_total``.
    :param prompt_tokens_total: ``vllm:prompt_tokens_total`` (prefilled tokens).
    :param generation_tokens_total: ``vllm:generation_tokens_total``.
    :param iterations_total: ``vllm:iteration_tokens_total_count`` (engine steps).
    :param itl_sum_s: ``vllm:inter_token_latency_seconds_sum``.
    :param itl_count: ``vllm:inter_token_latency_seconds_count``.
    :param num_gpu_blocks: KV blocks of the pool (``vllm:cache_config_info``), if exported.
    :param block_size: tokens per KV block, if exported.
    :param prefix_cache_queries_total: ``vllm:prefix_cache_queries_total`` (prompt tokens
        looked up in the prefix cache; 0 with prefix caching off).
    :param prefix_cache_hits_total: ``vllm:prefix_cache_hits_total`` (of those, found cached).
    """

    running: float
    waiting: float
    kv_cache_usage: float
    preemptions_total: float
    prompt_tokens_total: float
    generation_tokens_total: float
    iterations_total: float
    itl_sum_s: float
    itl_count: float
    num_gpu_blocks: int | None
    block_size: int | None
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        return int(labels[name])
    except (KeyError, ValueError):
        return None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse a vLLM ``/metrics`` page.

    :param text: the page.
    :raises MetricsParseError: the running / waiting / KV usage gauges are missing.
    """
    kept: list[str] = []
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        if line[:end] in WANTED:
            kept.append(line)
    sums: dict[str, float] = {}
    kv = -math.inf
    blocks: int | None = None
    block_size: int | None = None
    try:
        for family in text_string_to_metric_families("\n".join(kept) + "\n"):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG:
                    blocks = _int_label(sample.labels, "num_gpu_blocks")
                    block_size = _int_label(sample.labels, "block_size")
                elif sample.name == KV_USAGE:
                    kv = max(kv, float(sample.value))
                else:
                    sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    except ValueError as exc:
        raise MetricsParseError(f"unreadable metrics page ({exc})") from None
    missing = [n for n in (RUNNING, WAITING) if n not in sums]
    if kv == -math.inf:
        missing.append(KV_USAGE)
    if missing:
        raise MetricsParseError(f"not a vLLM metrics page: {', '.join(missing)} missing")
    return VllmMetrics(
        running=sums[RUNNING], waiting=sums[WAITING], kv_cache_usage=kv,
        preemptions_total=sums.get(PREEMPTIONS, 0.0),
        prompt_tokens_total=sums.get(PROMPT_TOKENS, 0.0),
        generation_tokens_total=sums.get(GENERATION_TOKENS, 0.0),
        iterations_total=sums.get(ITERATIONS, 0.0), itl_sum_s=sums.get(ITL_SUM, 0.0),
        itl_count=sums.get(ITL_COUNT, 0.0), num_gpu_blocks=blocks, block_size=block_size,
        prefix_cache_queries_total=sums.get(PREFIX_QUERIES, 0.0),
        prefix_cache_hits_total=sums.get(PREFIX_HITS, 0.0))


def counter_delta(now: float, before: float | None) -> float:
    """Increase of a counter between two scrapes; a counter that went down was reset (the
    server restarted), so its whole value counts.

    :param now: the current total.
    :param before: the previous total (``None``: no previous scrape; the delta is 0).
    """
    if before is None:
        return 0.0
    return now - before if now >= before else now
