"""The sidecar's Prometheus metrics: the snapshot table's, its control state, its HTTP path.

Each app owns its registry (no process-global collectors, so several sidecars can live in
one process). Names follow Prometheus' rules: ``rlbatch_`` and snake case (the colon is
reserved for recording rules: ``deploy/prometheus/rlbatch-rules.yaml``), base units,
``_total`` on counters, ``_ratio`` on 0-1 fractions. A value the sidecar does not know (no
GPU reading, no host KV tier, an empty latency window, a bucket not routed to a pool or not
capped) is left out of the page: no 0, +Inf or NaN stands in for it, because a NaN sample
turns every sum over replicas into NaN and a 0 reads as a measurement. Three kinds of series:

* **The tick's snapshot**, named by :data:`rlbatch.control.stats_metrics.METRICS` (the names
  training's TensorBoard uses too; :data:`SNAPSHOT_RENAMES` where Prometheus' suffixes
  differ): gauges are read from the last tick's
  :class:`~rlbatch.control.types.DeploymentStats` when ``/metrics`` is scraped; counters
  (arrivals, rejections, finished, preemptions, KV overflows, guard overrides) add the tick's
  increments at each tick, and so do the sidecar's own counters of the snapshot (tokens,
  finished requests meeting the SLA). The table's ``batch_cap`` / ``pool_index`` are not
  exported: the control-state families below say more (per bucket *and* pool, in force *and*
  decided); nor is its per-tick ``throughput_tok_s``: the token counters, read with
  ``rate()``, give it over any range.
* **Control state** read at scrape time: the action in force and the last decision, upstream
  health, shadow mode, the controller in charge.
* **The HTTP path**, counted by the handlers: per-request series are resolved to their label
  children once, when the app is built, so the request path only calls ``inc()`` /
  ``observe()``.

docs/sidecar.md lists every name with its old (``rlbatch:``) spelling.

================================================  =========  ============================
name                                              type       labels
================================================  =========  ============================
``rlbatch_queue_length``                          gauge      bucket
``rlbatch_oldest_wait_seconds``                   gauge      bucket (0: queue empty)
``rlbatch_oldest_unserved_seconds``               gauge      (0: none waiting)
``rlbatch_arrivals_total``                        counter    bucket
``rlbatch_rejections_total``                      counter    bucket
``rlbatch_finished_total``                        counter
``rlbatch_goodput_requests_total``                counter    (finished meeting the SLA)
``rlbatch_prompt_tokens_total``                   counter    pool (prefilled, upstreams)
``rlbatch_generation_tokens_total``               counter    pool (decoded, upstreams)
``rlbatch_ttft_p99_seconds``, ``tpot_p99_seconds``  gauge    bucket (sliding window)
``rlbatch_{ttft,tpot,e2e}_p99_all_seconds``       gauge      (sliding window)
``rlbatch_sla_attainment_ratio``                  gauge      (sliding window)
``rlbatch_requests_running``                      gauge      bucket
``rlbatch_requests_waiting``                      gauge      bucket (in the sidecar's
                                                             engine-wide FIFO)
``rlbatch_kv_cache_usage_ratio``                  gauge      pool (max over its upstreams)
``rlbatch_kv_offload_usage_ratio``                gauge      pool (host KV tier; absent
                                                             behind vLLM: not read)
``rlbatch_kv_committed_ratio``                    gauge      (absent: no KV capacity read)
``rlbatch_gpu_memory_used_ratio``                 gauge      (absent: no GPU reading)
``rlbatch_max_num_seqs``                          gauge      pool (engine-wide cap applied)
``rlbatch_batch_efficiency_ratio``                gauge      (absent behind vLLM)
``rlbatch_preemptions_total``                     counter
``rlbatch_kv_overflows_total``                    counter
``rlbatch_kv_budget_blocked``                     gauge      (0/1)
``rlbatch_guard_overrides_total``                 counter    rule
``rlbatch_tpot_fit_ceiling``                      gauge      (the guard's TPOT ceiling on the
                                                             total; absent: rule off or none)
``rlbatch_tpot_fit_slowdown``                     gauge      (observed / predicted iteration
                                                             time x spread; absent: rule off)
``rlbatch_bucket_routed``                         gauge      bucket, pool (1: the bucket's
                                                             requests may go there)
``rlbatch_batch_cap``                             gauge      bucket, pool (cap in force;
                                                             absent where not routed or
                                                             not capped)
``rlbatch_decided_bucket_routed``,                gauge      bucket, pool (the controller's
``rlbatch_decided_batch_cap``                                last decision)
``rlbatch_decision_differs``                      gauge      bucket (1: the decision is
                                                             not in force: shadow mode,
                                                             fallback ticks)
``rlbatch_upstream_up``                           gauge      upstream, pool
``rlbatch_shadow_mode``                           gauge
``rlbatch_controller_info``                       gauge      controller
``rlbatch_sla_target_seconds``                    gauge      metric (``ttft``, ``tpot``)
``rlbatch_decision_seconds``                      histogram
``rlbatch_tick_seconds``                          histogram  (scrape + stats + decide + apply)
``rlbatch_control_ticks_total``                   counter
``rlbatch_fallback_ticks_total``                  counter
``rlbatch_scrape_failures_total``                 counter    upstream
``rlbatch_requests_total``                        counter    bucket, outcome
``rlbatch_bad_requests_total``                    counter
``rlbatch_prompts_truncated_total``               counter    bucket
``rlbatch_upstream_retries_total``                counter    pool
``rlbatch_upstream_ejections_total``              counter    upstream
``rlbatch_e2e_request_latency_seconds``           histogram  bucket
``rlbatch_time_to_first_token_seconds``           histogram  bucket (streamed requests)
``rlbatch_request_queue_time_seconds``            histogram  bucket
``rlbatch_tokenize_seconds``                      histogram  counter
``rlbatch_limit_trips_total``                     counter    limit (see :data:`LIMITS`)
``rlbatch_held_body_bytes``                       gauge      (request bodies held now)
``rlbatch_connections_open``                      gauge      (client connections)
``rlbatch_requests_counting``                     gauge      (prompts being tokenised)
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
from rlbatch.control.types import ANY_POOL, SLA, ControlAction, DeploymentStats, meets_sla

PREFIX = "rlbatch_"
"""Every family's prefix."""

REJECTIONS: tuple[str, ...] = ("rejected_queue_full", "rejected_too_long",
                               "rejected_predicted_ttft", "rejected_queued_tokens",
                               "expired_queue_ttl", "unavailable")
"""The outcomes that refuse a request (the dashboard's and alerts' rejection reasons): one
per admission refusal reason (:data:`rlbatch.sidecar.dispatch.REFUSALS`)."""

OUTCOMES: tuple[str, ...] = ("ok", *REJECTIONS, "upstream_error", "upstream_client_error",
                             "cancelled", "upstream_timeout")
"""How a request that reached admission left the sidecar."""

LIMITS: tuple[str, ...] = (
    "body_size", "held_bytes", "header_size", "header_timeout", "body_timeout",
    "connections", "tokenize_timeout", "tokenize_error", "tokenize_breaker",
    "upstream_connect", "upstream_first_byte", "upstream_idle", "upstream_total", "event_size",
    "json_depth", "sequences")
"""Every bound the sidecar enforces, as the ``limit`` label of ``rlbatch_limit_trips_total``:
request body size, bytes held by waiting requests, header size, slow header / body,
connection count, ``/tokenize`` time / failure / not called while its breaker is open
(approximate count used), the upstream's connect / first-byte / idle / total time, the size
of one upstream stream event, JSON nesting, sequences per request."""

LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 20.0, 40.0, 80.0, 160.0)
FAST_BUCKETS: tuple[float, ...] = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                   1e-2, 2.5e-2, 5e-2, 0.1, 0.25)

NOT_EXPORTED: frozenset[str] = frozenset({"batch_cap", "pool_index", "throughput_tok_s"})
"""Table metrics the sidecar exports otherwise (see the module docstring)."""

SNAPSHOT_RENAMES: dict[str, str] = {
    "sla_attainment": "sla_attainment_ratio",
    "kv_cache_usage": "kv_cache_usage_ratio",
    "kv_offload_usage": "kv_offload_usage_ratio",
    "kv_committed": "kv_committed_ratio",
    "gpu_memory_used": "gpu_memory_used_ratio",
    "batch_efficiency": "batch_efficiency_ratio",
}
"""Table names whose Prometheus name differs: 0-1 fractions end in ``_ratio``."""

Known = Callable[[DeploymentStats, MetricContext], tuple[bool, ...]]

KNOWN: dict[str, Known] = {
    # the table reads 0 where no upstream reports the quantity
    "gpu_memory_used": lambda s, c: (any(es.gpu_memory_total_bytes > 0 for es in s.engines),),
    "kv_committed": lambda s, c: (any(es.kv_capacity_tokens > 0 for es in s.engines),),
    "kv_offload_usage": lambda s, c: tuple(
        any(es.kv_offload_num_blocks > 0 for es in s.pool_engines(p)) for p in c.pool_names),
}
"""Per table gauge whose reader cannot say "unknown" itself: which of its values are known
(the others are left out, as NaN values are)."""


def prom_name(m: StatMetric) -> str:
    """The Prometheus name of a table metric (counters without the ``_total`` the client
    library adds).

    :param m: the table entry.
    """
    return PREFIX + SNAPSHOT_RENAMES.get(m.name, m.name)


class _Live(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


class SnapshotMetrics:
    """The snapshot table's series and the sidecar's counters of each tick: counters
    advanced every tick, gauges read from the last tick's stats at scrape time.

    :param registry: the sidecar's registry.
    :param ctx: bucket and pool names.
    :param sla: the SLA the goodput counter judges finished requests by.
    """

    def __init__(self, registry: CollectorRegistry, ctx: MetricContext,
                 sla: SLA | None = None) -> None:
        self.ctx = ctx
        self.sla = sla or SLA()
        exported = [m for m in METRICS if m.name not in NOT_EXPORTED]
        self._gauges = [m for m in exported if m.kind == "gauge"]
        self._counters: list[tuple[StatMetric, list[Counter]]] = []
        for m in exported:
            if m.kind != "counter":
                continue
            if m.label == "none":
                counter = Counter(prom_name(m), m.help, registry=registry)
                self._counters.append((m, [counter]))
            else:
                family = Counter(prom_name(m), m.help, [m.label], registry=registry)
                self._counters.append((m, [family.labels(v) for v in m.label_values(ctx)]))
        self.goodput = Counter(PREFIX + "goodput_requests", "Finished requests that met the "
                               "SLA (TTFT and TPOT): goodput, read with rate()",
                               registry=registry)
        prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens the pool's upstreams "
                         "computed", ["pool"], registry=registry)
        generation = Counter(PREFIX + "generation_tokens", "Output tokens the pool's "
                             "upstreams generated", ["pool"], registry=registry)
        self._tokens = [(pool, prompt.labels(pool), generation.labels(pool))
                        for pool in ctx.pool_names]
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
        met = sum(meets_sla(rec, self.sla) for rec in stats.finished)
        if met:
            self.goodput.inc(met)
        for pool, prompt, generation in self._tokens:
            engines = stats.pool_engines(pool)
            prompt.inc(sum(es.prefill_tokens for es in engines))
            generation.inc(sum(es.decode_tokens for es in engines))

    def _collect(self) -> Iterator[Metric]:
        if self._last is None:
            return
        stats, ctx = self._last
        for m in self._gauges:
            labels = [] if m.label == "none" else [m.label]
            family = GaugeMetricFamily(prom_name(m), m.help, labels=labels)
            pairs = m.values(stats, ctx)
            known = KNOWN[m.name](stats, ctx) if m.name in KNOWN else (True,) * len(pairs)
            for (label, value), ok in zip(pairs, known, strict=True):
                if ok and not math.isnan(value):  # NaN is "no signal": no sample
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
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(getattr(self, name)))


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


def action_families(state: ControlState, action: ControlAction, prefix: str,
                    what: str) -> Iterator[Metric]:
    """Routes and caps of one action: ``<prefix>bucket_routed`` (every bucket and pool, 0/1)
    and ``<prefix>batch_cap`` (only where the bucket is routed and capped: "no cap" and "not
    routed there" have no number).

    :param state: bucket and pool names.
    :param action: the action shown.
    :param prefix: the families' name prefix.
    :param what: which action, for the help text.
    """
    routed = GaugeMetricFamily(prefix + "bucket_routed", f"1 where {what} routes the "
                               "bucket's requests to the pool (a bucket routed to any pool "
                               "has 1 under each), else 0", labels=["bucket", "pool"])
    caps = GaugeMetricFamily(prefix + "batch_cap", f"Batch cap of {what} per bucket and pool "
                             "(absent where the bucket is not routed to the pool or has no "
                             "cap)", labels=["bucket", "pool"])
    for b, name in enumerate(state.bucket_names):
        cap = action.caps[b]
        for pool in state.pools:
            on = action.pools[b] in (pool, ANY_POOL)
            routed.add_metric([name, pool], float(on))
            if on and cap is not None:
                caps.add_metric([name, pool], float(cap))
    yield routed
    yield caps


def control_state_families(state: ControlState) -> Iterator[Metric]:
    """The control-state gauges.

    :param state: the state to show.
    """
    yield from action_families(state, state.in_force, PREFIX, "the action in force")
    yield from action_families(state, state.decided, PREFIX + "decided_",
                               "the controller's last decision")
    differs = GaugeMetricFamily(PREFIX + "decision_differs", "1 where the controller's last "
                                "decision (cap or route) is not the one in force (shadow "
                                "mode, fallback ticks)", labels=["bucket"])
    for b, name in enumerate(state.bucket_names):
        same = (state.decided.caps[b] == state.in_force.caps[b]
                and state.decided.pools[b] == state.in_force.pools[b])
        differs.add_metric([name], float(not same))
    yield differs
    up = GaugeMetricFamily(PREFIX + "upstream_up", "Upstream reachable (1) or not (0)",
                           labels=["upstream", "pool"])
    for name, pool, healthy in state.upstreams:
        up.add_metric([name, pool], float(healthy))
    yield up
    yield GaugeMetricFamily(PREFIX + "shadow_mode", "1 in shadow mode (decide, never act)",
                            value=float(state.shadow))
    ctl = GaugeMetricFamily(PREFIX + "controller_info", "The controller in charge",
                            labels=["controller"])
    ctl.add_metric([state.controller], 1.0)
    yield ctl
    sla = GaugeMetricFamily(PREFIX + "sla_target_seconds", "The SLA's per-request limit",
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
    :param sla: the SLA goodput is counted against.
    """

    def __init__(self, bucket_names: tuple[str, ...], pools: tuple[str, ...],
                 upstream_names: tuple[str, ...],
                 control_state: Callable[[], ControlState], sla: SLA | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.snapshot = SnapshotMetrics(reg, MetricContext(bucket_names, pools), sla)
        self.decision_seconds = Histogram(PREFIX + "decision_seconds", "Time of one control "
                                          "decision (observation + policy + guard)",
                                          buckets=FAST_BUCKETS, registry=reg)
        self.tick_seconds = Histogram(PREFIX + "tick_seconds", "Time of one control tick "
                                      "(scrape, stats, decision, apply)",
                                      buckets=FAST_BUCKETS, registry=reg)
        self.control_ticks = Counter(PREFIX + "control_ticks", "Control ticks run",
                                     registry=reg)
        self.fallback_ticks = Counter(PREFIX + "fallback_ticks", "Ticks that applied the "
                                      "guard's fallback caps (metrics scrape failed)",
                                      registry=reg)
        scrape_failures = Counter(PREFIX + "scrape_failures", "Failed /metrics scrapes",
                                  ["upstream"], registry=reg)
        self.scrape_failures = {u: scrape_failures.labels(u) for u in upstream_names}
        requests = Counter(PREFIX + "requests", "Requests that reached admission, by outcome",
                           ["bucket", "outcome"], registry=reg)
        self.requests = {(b, o): requests.labels(name, o)
                         for b, name in enumerate(bucket_names) for o in OUTCOMES}
        self.bad_requests = Counter(PREFIX + "bad_requests", "Requests answered 400 before "
                                    "admission (bad JSON, missing fields)", registry=reg)
        truncated = Counter(PREFIX + "prompts_truncated", "Prompts truncated to max_model_len",
                            ["bucket"], registry=reg)
        self.truncated = [truncated.labels(name) for name in bucket_names]
        retries = Counter(PREFIX + "upstream_retries", "Requests retried on another replica",
                          ["pool"], registry=reg)
        self.retries = {p: retries.labels(p) for p in pools}
        ejections = Counter(PREFIX + "upstream_ejections", "Times an upstream was ejected "
                            "after consecutive failures", ["upstream"], registry=reg)
        self.ejections = {u: ejections.labels(u) for u in upstream_names}
        e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival at the sidecar to "
                        "the last byte sent", ["bucket"], buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = [e2e.labels(name) for name in bucket_names]
        ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first "
                         "streamed chunk", ["bucket"], buckets=LATENCY_BUCKETS, registry=reg)
        self.ttft = [ttft.labels(name) for name in bucket_names]
        queue = Histogram(PREFIX + "request_queue_time_seconds", "Time in the admission "
                          "queue", ["bucket"], buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = [queue.labels(name) for name in bucket_names]
        self.tokenize_seconds = Histogram(PREFIX + "tokenize_seconds", "Prompt token count "
                                          "time", ["counter"], buckets=FAST_BUCKETS,
                                          registry=reg)
        trips = Counter(PREFIX + "limit_trips", "Times a request or connection hit one of the "
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
