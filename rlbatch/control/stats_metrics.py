"""The one table of metric names read off a DeploymentStats snapshot.

Each :class:`StatMetric` names a quantity once: its base name (the sidecar's Prometheus
name derives from it: :func:`rlbatch.sidecar.prom.prom_name`), its TensorBoard tag
(``<group>/<name>[/<label value>]``), its kind, its label and the function that reads it from
a tick's stats. The sidecar's ``/metrics`` and TensorBoard writer and training's TensorBoard
callback all derive their names and values from :data:`METRICS`, so they agree.

Counters are read as the tick's increments (arrivals, rejections, preemptions, guard
overrides in the tick): Prometheus adds them up, TensorBoard plots them per tick (training
averages them over its logging period). Gauges are levels at the tick. NaN means "no signal"
(e.g. no completion in the window); writers drop non-finite values where their format cannot
hold them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from rlbatch.control.guard import RULES, Guard
from rlbatch.control.types import DeploymentStats, route_choices

MetricKind = Literal["gauge", "counter"]
LabelKind = Literal["none", "bucket", "pool", "rule"]


@dataclass(frozen=True)
class MetricContext:
    """What a reader needs besides the stats.

    :param bucket_names: bucket labels, in bucket order.
    :param pool_names: pool labels, in the deployment's order.
    :param overrides: guard overrides in the tick, by rule (missing rules: 0).
    :param tpot_fit_ceiling: the guard's ``tpot_fit`` ceiling on the total after the tick's
        decision (NaN: no guard, the rule off, or no ceiling); on two pools the largest
        pool's (each pool's cap in force is its ``max_num_seqs``).
    :param tpot_fit_slowdown: the slowdown that rule applied to its TPOT prediction
        (calibration x spread; NaN: no guard or the rule off).
    """

    bucket_names: tuple[str, ...]
    pool_names: tuple[str, ...]
    overrides: Mapping[str, int] = field(default_factory=dict)
    tpot_fit_ceiling: float = math.nan
    tpot_fit_slowdown: float = math.nan


def guard_readings(guard: Guard | None) -> dict[str, float]:
    """The guard's levels the table reads besides the stats, as :class:`MetricContext`
    keywords: the ``tpot_fit`` rule's ceiling on the total and the slowdown it applied (NaN
    where there is no guard, the rule is off or sets no ceiling).

    :param guard: the guard of the controller in charge (``None``: unguarded).
    """
    if guard is None or not guard.config.tpot_fit:
        return {"tpot_fit_ceiling": math.nan, "tpot_fit_slowdown": math.nan}
    ceiling = guard.state.tpot_fit_total
    return {"tpot_fit_ceiling": math.nan if ceiling is None else float(ceiling),
            "tpot_fit_slowdown": float(guard.state.tpot_fit_slowdown)}


Reader = Callable[[DeploymentStats, MetricContext], tuple[float, ...]]


@dataclass(frozen=True)
class StatMetric:
    """One metric of the table.

    :param name: base name (Prometheus ``rlbatch_<name>``, a 0-1 fraction renamed
        ``..._ratio``; TensorBoard ``<group>/<name>``).
    :param group: TensorBoard prefix: ``rollout``, ``engine``, ``decision`` or ``guard``.
    :param help: one line for Prometheus' HELP and the docs.
    :param kind: ``gauge`` (a level) or ``counter`` (the tick's increment).
    :param label: what one value is per: ``none``, ``bucket``, ``pool`` or ``rule``.
    :param read: values from the stats: one per label value (bucket order, pool order,
        :data:`~rlbatch.control.guard.RULES` order), or one for ``none``.
    """

    name: str
    group: str
    help: str
    kind: MetricKind
    label: LabelKind
    read: Reader

    @property
    def tb_name(self) -> str:
        return f"{self.group}/{self.name}"

    def label_values(self, ctx: MetricContext) -> tuple[str, ...]:
        """The label values, in the order :attr:`read` returns values ("" for ``none``).

        :param ctx: bucket and pool names.
        """
        if self.label == "bucket":
            return ctx.bucket_names
        if self.label == "pool":
            return ctx.pool_names
        if self.label == "rule":
            return RULES
        return ("",)

    def values(self, stats: DeploymentStats, ctx: MetricContext) -> list[tuple[str, float]]:
        """``(label value, value)`` pairs of one tick.

        :param stats: the tick's snapshot.
        :param ctx: names and guard overrides.
        """
        return list(zip(self.label_values(ctx), self.read(stats, ctx), strict=True))

    def tb_tag(self, label_value: str) -> str:
        """The TensorBoard tag of one value.

        :param label_value: the label value ("" for ``none``).
        """
        return f"{self.tb_name}/{label_value}" if label_value else self.tb_name


def _per_pool(stats: DeploymentStats, ctx: MetricContext,
              value: Callable[[DeploymentStats, str], float]) -> tuple[float, ...]:
    return tuple(value(stats, pool) for pool in ctx.pool_names)


def _pool_max(attr: str) -> Reader:
    def read(stats: DeploymentStats, ctx: MetricContext) -> tuple[float, ...]:
        return _per_pool(stats, ctx, lambda s, pool: float(max(
            (getattr(es, attr) for es in s.pool_engines(pool)), default=math.nan)))
    return read


def _cap(cap: int | None) -> float:
    return math.inf if cap is None else float(cap)


def _pool_index(ctx: MetricContext, pool: str) -> float:
    routes = route_choices(ctx.pool_names)
    return float(routes.index(pool)) if pool in routes else math.nan


def _sla_attainment(stats: DeploymentStats) -> float:
    completed = sum(stats.window.completed)
    return sum(stats.window.sla_met) / completed if completed else math.nan


def _floats(values: tuple[int, ...] | tuple[float, ...]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


METRICS: tuple[StatMetric, ...] = (
    # rollout: what reaches admission and what the requests see
    StatMetric("queue_length", "rollout", "Requests in the admission queue", "gauge",
               "bucket", lambda s, c: _floats(s.queued)),
    StatMetric("oldest_wait_seconds", "rollout", "Wait of the admission queue's head",
               "gauge", "bucket", lambda s, c: _floats(s.oldest_wait_s or (0.0,) * len(s.queued))),
    StatMetric("oldest_unserved_seconds", "rollout",
               "Wait of the oldest request still waiting to be served (a replay: without a "
               "first token, wherever it waits; the sidecar: not forwarded yet)",
               "gauge", "none", lambda s, c: (s.oldest_unserved_s,)),
    StatMetric("arrivals", "rollout", "Requests that arrived at admission", "counter",
               "bucket", lambda s, c: _floats(s.arrived)),
    StatMetric("rejections", "rollout", "Requests refused (too long, queue full, unavailable)",
               "counter", "bucket", lambda s, c: _floats(s.rejected)),
    StatMetric("finished", "rollout", "Requests that finished", "counter", "none",
               lambda s, c: (float(s.finished_count),)),
    StatMetric("ttft_p99_seconds", "rollout", "Sliding-window TTFT P99 per bucket", "gauge",
               "bucket", lambda s, c: s.window.ttft_p99_s),
    StatMetric("tpot_p99_seconds", "rollout", "Sliding-window TPOT P99 per bucket", "gauge",
               "bucket", lambda s, c: s.window.tpot_p99_s),
    StatMetric("ttft_p99_all_seconds", "rollout", "Sliding-window TTFT P99, all buckets",
               "gauge", "none", lambda s, c: (s.window.ttft_p99_all_s,)),
    StatMetric("tpot_p99_all_seconds", "rollout", "Sliding-window TPOT P99, all buckets",
               "gauge", "none", lambda s, c: (s.window.tpot_p99_all_s,)),
    StatMetric("e2e_p99_all_seconds", "rollout", "Sliding-window end-to-end P99, all buckets",
               "gauge", "none", lambda s, c: (s.window.e2e_p99_all_s,)),
    StatMetric("sla_attainment", "rollout", "Window completions meeting the SLA (fraction)",
               "gauge", "none", lambda s, c: (_sla_attainment(s),)),
    # engine: inside the engines
    StatMetric("requests_running", "engine", "Requests running inside the engines", "gauge",
               "bucket", lambda s, c: _floats(s.running_per_bucket)),
    StatMetric("requests_waiting", "engine", "Requests admitted to an engine, waiting for "
               "its engine-wide cap", "gauge", "bucket",
               lambda s, c: _floats(s.waiting_per_bucket)),
    StatMetric("kv_cache_usage", "engine", "KV cache usage (fraction), max over the pool's "
               "engines", "gauge", "pool", _pool_max("kv_cache_usage")),
    StatMetric("kv_offload_usage", "engine", "Host KV tier occupancy (fraction), max over the "
               "pool's engines (0: no host tier)", "gauge", "pool",
               _pool_max("kv_offload_usage")),
    StatMetric("kv_committed", "engine", "Committed KV (prompt + expected output admitted) as a "
               "fraction of the pool, max over engines", "gauge", "none",
               lambda s, c: (s.kv_committed_max,)),
    StatMetric("gpu_memory_used", "engine", "GPU memory used (fraction), max over engines",
               "gauge", "none", lambda s, c: (s.gpu_memory_used_max,)),
    StatMetric("max_num_seqs", "engine", "Engine-wide cap on running sequences, max over the "
               "pool's engines", "gauge", "pool", _pool_max("max_num_seqs")),
    StatMetric("throughput_tok_s", "engine", "Output tokens per second in the tick", "gauge",
               "none", lambda s, c: (s.throughput_tok_s,)),
    StatMetric("batch_efficiency", "engine", "Useful / computed tokens in the tick (NaN: "
               "nothing computed)", "gauge", "none", lambda s, c: (s.batch_efficiency,)),
    StatMetric("preemptions", "engine", "Requests preempted (recompute)", "counter", "none",
               lambda s, c: (float(s.preemptions),)),
    StatMetric("kv_overflows", "engine", "Iterations in which a running request could not "
               "get a KV block", "counter", "none", lambda s, c: (float(s.kv_overflows),)),
    # decision: the action in force during the tick
    StatMetric("batch_cap", "decision", "Batch cap in force (+Inf: no cap)", "gauge",
               "bucket", lambda s, c: tuple(_cap(cap) for cap in s.action.caps)),
    StatMetric("pool_index", "decision", "Index of the route of the bucket (the pools in "
               "order, then any pool: the least-loaded engine)",
               "gauge", "bucket", lambda s, c: tuple(_pool_index(c, p) for p in s.action.pools)),
    StatMetric("kv_budget_blocked", "decision", "The KV budget held a request back (0/1)",
               "gauge", "none", lambda s, c: (float(s.kv_budget_blocked),)),
    # guard
    StatMetric("guard_overrides", "guard", "Guard rule overrides of the policy's proposal",
               "counter", "rule", lambda s, c: tuple(float(c.overrides.get(r, 0))
                                                     for r in RULES)),
    StatMetric("tpot_fit_ceiling", "guard", "Largest total whose calibrated TPOT prediction "
               "meets the SLA: the tpot_fit rule's ceiling (absent: rule off or no ceiling)",
               "gauge", "none", lambda s, c: (c.tpot_fit_ceiling,)),
    StatMetric("tpot_fit_slowdown", "guard", "Observed over predicted iteration time times the "
               "spread allowance, as the tpot_fit rule applied it (absent: rule off)",
               "gauge", "none", lambda s, c: (c.tpot_fit_slowdown,)),
)
"""Every metric read off the snapshot, in display order."""


def metric(name: str) -> StatMetric:
    """The table entry called ``name``.

    :param name: base name.
    :raises KeyError: no such metric.
    """
    for m in METRICS:
        if m.name == name:
            return m
    raise KeyError(f"no metric {name!r}; known: {', '.join(m.name for m in METRICS)}")


def tensorboard_scalars(stats: DeploymentStats, ctx: MetricContext) -> dict[str, float]:
    """Every table value of one tick as ``{TensorBoard tag: value}`` (NaN included; drop
    non-finite values before writing where the writer needs to).

    :param stats: the tick's snapshot.
    :param ctx: names and guard overrides.
    """
    return {m.tb_tag(label): value for m in METRICS for label, value in m.values(stats, ctx)}
