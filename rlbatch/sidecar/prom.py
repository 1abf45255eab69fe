"""The sidecar's own Prometheus metrics, vLLM-style names under ``rlbatch:``.

Each app owns its registry (no process-global collectors, so several sidecars can live in
one process). Per-request series are resolved to their label children once, when the app is
built, so the request path only calls ``inc()`` / ``observe()``. Gauges that mirror live
state (caps, queues, upstream health) are read when ``/metrics`` is scraped, by a collector
callback, and cost the request path nothing.

================================================  =========  ============================
name                                              type       labels
================================================  =========  ============================
``rlbatch:batch_cap``                             gauge      bucket, pool (cap in force;
                                                             0 = bucket not routed there;
                                                             +Inf = no cap)
``rlbatch:decided_batch_cap``                     gauge      bucket, pool (the controller's
                                                             last decision; differs from
                                                             the cap in force in shadow
                                                             mode and on fallback ticks)
``rlbatch:queue_length``                          gauge      bucket
``rlbatch:requests_running``                      gauge      bucket, pool
``rlbatch:requests_waiting``                      gauge      bucket, pool (in the
                                                             sidecar's engine-wide FIFO)
``rlbatch:upstream_up``                           gauge      upstream, pool
``rlbatch:upstream_kv_cache_usage``               gauge      upstream
``rlbatch:max_num_seqs``                          gauge      upstream
``rlbatch:shadow_mode``                           gauge
``rlbatch:controller_info``                       gauge      controller
``rlbatch:guard_overrides_total``                 counter    rule
``rlbatch:decision_seconds``                      histogram
``rlbatch:tick_seconds``                          histogram  (scrape + stats + decide + apply)
``rlbatch:control_ticks_total``                   counter
``rlbatch:fallback_ticks_total``                  counter
``rlbatch:scrape_failures_total``                 counter    upstream
``rlbatch:requests_total``                        counter    bucket, outcome
``rlbatch:bad_requests_total``                    counter
``rlbatch:prompts_truncated_total``               counter    bucket
``rlbatch:upstream_retries_total``                counter    pool
``rlbatch:e2e_request_latency_seconds``           histogram  bucket
``rlbatch:time_to_first_token_seconds``           histogram  bucket (streamed requests)
``rlbatch:request_queue_time_seconds``            histogram  bucket
``rlbatch:tokenize_seconds``                      histogram  counter
================================================  =========  ============================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from rlbatch.control.guard import RULES

OUTCOMES: tuple[str, ...] = ("ok", "rejected_queue_full", "rejected_too_long",
                             "queue_timeout", "upstream_error", "upstream_client_error",
                             "cancelled", "unavailable")
"""How a request that reached admission left the sidecar."""

LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 20.0, 40.0, 80.0, 160.0)
FAST_BUCKETS: tuple[float, ...] = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                   1e-2, 2.5e-2, 5e-2, 0.1, 0.25)


class _Live(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


class SidecarMetrics:
    """Every metric of one sidecar, in its own registry.

    :param bucket_names: bucket labels.
    :param pools: pool labels.
    :param upstream_names: upstream labels.
    :param live: yields the live-state gauges at scrape time.
    """

    def __init__(self, bucket_names: tuple[str, ...], pools: tuple[str, ...],
                 upstream_names: tuple[str, ...],
                 live: Callable[[], Iterable[Metric]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.guard_overrides = Counter("rlbatch:guard_overrides", "Guard rule overrides of "
                                       "the policy's proposal", ["rule"], registry=reg)
        for rule in RULES:
            self.guard_overrides.labels(rule)
        self.decision_seconds = Histogram("rlbatch:decision_seconds", "Time of one control "
                                          "decision (observation + policy + guard)",
                                          buckets=FAST_BUCKETS, registry=reg)
        self.tick_seconds = Histogram("rlbatch:tick_seconds", "Time of one control tick "
                                      "(scrape, stats, decision, apply)",
                                      buckets=FAST_BUCKETS, registry=reg)
        self.control_ticks = Counter("rlbatch:control_ticks", "Control ticks run",
                                     registry=reg)
        self.fallback_ticks = Counter("rlbatch:fallback_ticks", "Ticks that applied the "
                                      "guard's fallback caps (metrics scrape failed)",
                                      registry=reg)
        scrape_failures = Counter("rlbatch:scrape_failures", "Failed /metrics scrapes",
                                  ["upstream"], registry=reg)
        self.scrape_failures = {u: scrape_failures.labels(u) for u in upstream_names}
        requests = Counter("rlbatch:requests", "Requests that reached admission, by outcome",
                           ["bucket", "outcome"], registry=reg)
        self.requests = {(b, o): requests.labels(name, o)
                         for b, name in enumerate(bucket_names) for o in OUTCOMES}
        self.bad_requests = Counter("rlbatch:bad_requests", "Requests answered 400 before "
                                    "admission (bad JSON, missing fields)", registry=reg)
        truncated = Counter("rlbatch:prompts_truncated", "Prompts truncated to max_seq_len",
                            ["bucket"], registry=reg)
        self.truncated = [truncated.labels(name) for name in bucket_names]
        retries = Counter("rlbatch:upstream_retries", "Requests retried on another replica",
                          ["pool"], registry=reg)
        self.retries = {p: retries.labels(p) for p in pools}
        e2e = Histogram("rlbatch:e2e_request_latency_seconds", "Arrival at the sidecar to "
                        "the last byte sent", ["bucket"], buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = [e2e.labels(name) for name in bucket_names]
        ttft = Histogram("rlbatch:time_to_first_token_seconds", "Arrival to the first "
                         "streamed chunk", ["bucket"], buckets=LATENCY_BUCKETS, registry=reg)
        self.ttft = [ttft.labels(name) for name in bucket_names]
        queue = Histogram("rlbatch:request_queue_time_seconds", "Time in the admission "
                          "queue", ["bucket"], buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = [queue.labels(name) for name in bucket_names]
        self.tokenize_seconds = Histogram("rlbatch:tokenize_seconds", "Prompt token count "
                                          "time", ["counter"], buckets=FAST_BUCKETS,
                                          registry=reg)
        reg.register(_Live(live))
