"""The sidecar's Prometheus metrics: the snapshot table's, its control state, its HTTP path.

Each app owns its registry (no process-global collectors, so several sidecars can live in
one process). Three kinds of series:

* **The tick's snapshot**, named by :data:`rlbatch.control.stats_metrics.METRICS` (the names
  training's TensorBoard uses too): gauges are read from the last tick's
  :class:`~rlbatch.control.types.DeploymentStats` when ``/metrics`` is scraped; counters
  (arrivals, rejections, finished, preemptions, KV overflows, guard overrides) add the tick's
  increments at each tick. The table's ``batch_cap`` / ``pool_index`` are not exported: the
  control-state families below say more under the same name (per bucket *and* pool, in force
  *and* decided).
* **Control state** read at scrape time: the action in force and the last decision, upstream
  health, shadow mode, the controller in charge.
* **The HTTP path**, counted by the handlers: per-request series are resolved to their label
  children once, when the app is built, so the request path only calls ``inc()`` /
  ``observe()``.

================================================  =========  ============================
name                                              type       labels
================================================  =========  ============================
``rlbatch:queue_length``                          gauge      bucket
``rlbatch:oldest_wait_seconds``                   gauge      bucket
``rlbatch:oldest_unserved_seconds``               gauge
``rlbatch:arrivals_total``                        counter    bucket
``rlbatch:rejections_total``                      counter    bucket
``rlbatch:finished_total``                        counter
``rlbatch:ttft_p99_seconds``, ``tpot_p99_seconds``  gauge    bucket (sliding window)
``rlbatch:{ttft,tpot,e2e}_p99_all_seconds``       gauge      (sliding window)
``rlbatch:sla_attainment``                        gauge      (sliding window)
``rlbatch:requests_running``                      gauge      bucket
``rlbatch:requests_waiting``                      gauge      bucket (in the sidecar's
                                                             engine-wide FIFO)
``rlbatch:kv_cache_usage``                        gauge      pool (max over its upstreams)
``rlbatch:kv_offload_usage``                      gauge      pool (host KV tier occupancy;
                                                             0 behind vLLM: not read)
``rlbatch:kv_committed``, ``gpu_memory_used``     gauge
``rlbatch:max_num_seqs``                          gauge      pool (engine-wide cap applied)
``rlbatch:throughput_tok_s``                      gauge
``rlbatch:batch_efficiency``                      gauge      (NaN behind vLLM: not exported)
``rlbatch:preemptions_total``                     counter
``rlbatch:kv_overflows_total``                    counter
``rlbatch:kv_budget_blocked``                     gauge
``rlbatch:guard_overrides_total``                 counter    rule
``rlbatch:batch_cap``                             gauge      bucket, pool (cap in force;
                                                             0 = bucket not routed there;
                                                             +Inf = no cap)
``rlbatch:decided_batch_cap``                     gauge      bucket, pool (the controller's
                                                             last decision; differs from
                                                             the cap in force in shadow
                                                             mode and on fallback ticks)
``rlbatch:upstream_up``                           gauge      upstream, pool
``rlbatch:shadow_mode``                           gauge
``rlbatch:controller_info``                       gauge      controller
``rlbatch:sla_target_seconds``                    gauge      metric (``ttft``, ``tpot``)
``rlbatch:decision_seconds``                      histogram
``rlbatch:tick_seconds``                          histogram  (scrape + stats + decide + apply)
``rlbatch:control_ticks_total``                   counter
``rlbatch:fallback_ticks_total``                  counter
``rlbatch:scrape_failures_total``                 counter    upstream
``rlbatch:requests_total``                        counter    bucket, outcome
``rlbatch:bad_requests_total``                    counter
``rlbatch:prompts_truncated_total``               counter    bucket
``rlbatch:upstream_retries_total``                counter    pool
``rlbatch:upstream_ejections_total``             counter    upstream
``rlbatch:e2e_request_latency_seconds``           histogram  bucket
``rlbatch:time_to_first_token_seconds``           histogram  bucket (streamed requests)
``rlbatch:request_queue_time_seconds``            histogram  bucket
``rlbatch:tokenize_seconds``                      histogram  counter
``rlbatch:limit_trips_total``                     counter    limit (see :data:`LIMITS`)
``rlbatch:held_body_bytes``                       gauge      (request bodies held now)
``rlbatch:connections_open``                      gauge      (client connections)
``rlbatch:requests_counting``                     gauge      (prompts being tokenised)
================================================  =========  ============================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rlbatch.control.stats_metrics import METRICS, MetricContext, StatMetric
from rlbatch.control.types import ANY_POOL, SLA, ControlAction, DeploymentStats

OUTCOMES: tuple[str, ...] = ("ok", "rejected_queue_full", "rejected_too_long",
                             "queue_timeout", "upstream_error", "upstream_client_error",
                             "cancelled", "unavailable", "upstream_timeout")
"""How a request that reached admission left the sidecar."""

LIMITS: tuple[str, ...] = (
    "body_size", "held_bytes", "header_size", "header_timeout", "body_timeout",
    "connections", "tokenize_timeout", "tokenize_error", "tokenize_breaker",
    "upstream_connect", "upstream_first_byte", "upstream_idle", "upstream_total", "event_size",
    "json_depth", "sequences")
"""Every bound the sidecar enforces, as the ``limit`` label of ``rlbatch:limit_trips_total``:
request body size, bytes held by waiting requests, header size, slow header / body,
connection count, ``/tokenize`` time / failure / not called while its breaker is open
(approximate count used), the upstream's connect / first-byte / idle / total time, the size
of one upstream stream event, JSON nesting, sequences per request."""

LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 20.0, 40.0, 80.0, 160.0)
FAST_BUCKETS: tuple[float, ...] = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                   1e-2, 2.5e-2, 5e-2, 0.1, 0.25)

NOT_EXPORTED: frozenset[str] = frozenset({"batch_cap", "pool_index"})
"""Table metrics the sidecar exports as control state instead (see the module docstring)."""


class _Live(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


class SnapshotMetrics:
    """The snapshot table's series: counters advanced every tick, gauges read from the last
    tick's stats at scrape time.

    :param registry: the sidecar's registry.
    :param ctx: bucket and pool names.
    """

    def __init__(self, registry: CollectorRegistry, ctx: MetricContext) -> None:
        self.ctx = ctx
        exported = [m for m in METRICS if m.name not in NOT_EXPORTED]
        self._gauges = [m for m in exported if m.kind == "gauge"]
        self._counters: list[tuple[StatMetric, list[Counter]]] = []
        for m in exported:
            if m.kind != "counter":
                continue
            if m.label == "none":
                counter = Counter(m.prom_name, m.help, registry=registry)
                self._counters.append((m, [counter]))
            else:
                family = Counter(m.prom_name, m.help, [m.label], registry=registry)
                self._counters.append((m, [family.labels(v) for v in m.label_values(ctx)]))
        self._last: tuple[DeploymentStats, MetricContext] | None = None
        registry.register(_Live(self._collect))

    def record(self, stats: DeploymentStats, ctx: MetricContext) -> None:
        """One tick: add its increments to the counters; its gauges are served from now on.

        :param stats: the tick's snapshot.
        :param ctx: names and the tick's guard overrides.
        """
        self._last = (stats, ctx)
        for m, children in self._counters:
            for child, value in zip(children, m.read(stats, ctx), strict=True):
                if value > 0:
                    child.inc(value)

    def _collect(self) -> Iterator[Metric]:
        if self._last is None:
            return
        stats, ctx = self._last
        for m in self._gauges:
            labels = [] if m.label == "none" else [m.label]
            family = GaugeMetricFamily(m.prom_name, m.help, labels=labels)
            for label, value in m.values(stats, ctx):
                if not math.isnan(value):  # NaN is "no signal": no sample
                    family.add_metric([label] if labels else [], value)
            yield family


@dataclass
class LoadGauges:
    """What the sidecar holds now, kept as plain integers by the request path and the
    connection guard (no lock per request) and read at scrape time.

    :param held_body_bytes: request-body bytes held by the requests inside the sidecar.
    :param connections_open: client connections open.
    :param requests_counting: requests whose prompt is being tokenised.
    """

    held_body_bytes: int = 0
    connections_open: int = 0
    requests_counting: int = 0

    def families(self) -> Iterator[Metric]:
        """The three gauges."""
        for name, doc in (("held_body_bytes", "Request-body bytes held by the requests "
                           "inside the sidecar"),
                          ("connections_open", "Client connections open"),
                          ("requests_counting", "Requests whose prompt is being tokenised")):
            yield GaugeMetricFamily(f"rlbatch:{name}", doc, value=float(getattr(self, name)))


@dataclass(frozen=True)
class ControlState:
    """The sidecar's control state at scrape time (not part of any tick's snapshot).

    :param in_force: the action in force.
    :param decided: the controller's last decision.
    :param bucket_names: bucket labels.
    :param pools: pool labels.
    :param upstreams: ``(name, pool, reachable)`` per upstream.
    :param shadow: shadow mode.
    :param controller: the controller's name.
    :param sla: the SLA in force (its limits are exported for dashboards and alerts).
    """

    in_force: ControlAction
    decided: ControlAction
    bucket_names: tuple[str, ...]
    pools: tuple[str, ...]
    upstreams: tuple[tuple[str, str, bool], ...]
    shadow: bool
    controller: str
    sla: SLA = field(default_factory=SLA)


def control_state_families(state: ControlState) -> Iterator[Metric]:
    """The control-state gauges.

    :param state: the state to show.
    """
    for metric_name, action, doc in (
            ("rlbatch:batch_cap", state.in_force, "Batch cap in force per bucket and pool "
             "(0: bucket not routed to the pool; +Inf: no cap; a bucket routed to any pool "
             "shows its cap under each)"),
            ("rlbatch:decided_batch_cap", state.decided, "The controller's last decision "
             "per bucket and pool (0: not routed there; +Inf: no cap)")):
        fam = GaugeMetricFamily(metric_name, doc, labels=["bucket", "pool"])
        for b, name in enumerate(state.bucket_names):
            cap = action.caps[b]
            for pool in state.pools:
                value = 0.0 if action.pools[b] not in (pool, ANY_POOL) else (
                    math.inf if cap is None else float(cap))
                fam.add_metric([name, pool], value)
        yield fam
    up = GaugeMetricFamily("rlbatch:upstream_up", "Upstream reachable (1) or not (0)",
                           labels=["upstream", "pool"])
    for name, pool, healthy in state.upstreams:
        up.add_metric([name, pool], float(healthy))
    yield up
    yield GaugeMetricFamily("rlbatch:shadow_mode", "1 in shadow mode (decide, never act)",
                            value=float(state.shadow))
    ctl = GaugeMetricFamily("rlbatch:controller_info", "The controller in charge",
                            labels=["controller"])
    ctl.add_metric([state.controller], 1.0)
    yield ctl
    sla = GaugeMetricFamily("rlbatch:sla_target_seconds", "The SLA's per-request limit",
                            labels=["metric"])
    sla.add_metric(["ttft"], state.sla.ttft_s)
    sla.add_metric(["tpot"], state.sla.tpot_s)
    yield sla


class SidecarMetrics:
    """Every metric of one sidecar, in its own registry.

    :param bucket_names: bucket labels.
    :param pools: pool labels.
    :param upstream_names: upstream labels.
    :param control_state: the control state at scrape time.
    """

    def __init__(self, bucket_names: tuple[str, ...], pools: tuple[str, ...],
                 upstream_names: tuple[str, ...],
                 control_state: Callable[[], ControlState]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.snapshot = SnapshotMetrics(reg, MetricContext(bucket_names, pools))
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
        truncated = Counter("rlbatch:prompts_truncated", "Prompts truncated to max_model_len",
                            ["bucket"], registry=reg)
        self.truncated = [truncated.labels(name) for name in bucket_names]
        retries = Counter("rlbatch:upstream_retries", "Requests retried on another replica",
                          ["pool"], registry=reg)
        self.retries = {p: retries.labels(p) for p in pools}
        ejections = Counter("rlbatch:upstream_ejections", "Times an upstream was ejected "
                            "after consecutive failures", ["upstream"], registry=reg)
        self.ejections = {u: ejections.labels(u) for u in upstream_names}
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
        trips = Counter("rlbatch:limit_trips", "Times a request or connection hit one of the "
                        "sidecar's bounds", ["limit"], registry=reg)
        self.limit_trips = {name: trips.labels(name) for name in LIMITS}
        #: read when /metrics is scraped: the request path only changes plain integers
        self.load = LoadGauges()
        reg.register(_Live(self.load.families))
        reg.register(_Live(lambda: control_state_families(control_state())))

    def trip(self, limit: str) -> None:
        """Count one trip of ``limit`` (one of :data:`LIMITS`).

        :param limit: the bound.
        """
        self.limit_trips[limit].inc()
