"""The control vocabulary: actions, SLA, what a controller is told and shown.

A controller is consulted once per control tick with the deployment's stats snapshot
(:class:`DeploymentStats`) and returns a :class:`ControlAction`; the controllers themselves
and their registry are in :mod:`rlbatch.control.controllers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlbatch.buckets import Buckets
from rlbatch.engine.stats import EngineStats, FinishedRequest, batch_efficiency
from rlbatch.frozen import quick_init

ANY_POOL = "any"
"""Route a bucket to the least-loaded engine of the whole deployment, whatever its pool (what
a load balancer in front of several ``vllm serve`` replicas does)."""


def route_choices(pool_names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The routes a controller may set for a bucket: each pool, plus :data:`ANY_POOL` when
    there is more than one (with one pool the two are the same route)."""
    names = tuple(pool_names)
    return (*names, ANY_POOL) if len(names) > 1 else names


def balanced_route(pool_names: tuple[str, ...] | list[str]) -> str:
    """The route of a controller that does not choose pools: the least-loaded engine of the
    deployment (:data:`ANY_POOL`; with one pool, that pool's name)."""
    return ANY_POOL if len(pool_names) > 1 else pool_names[0]


@dataclass(frozen=True)
class ControlAction:
    """What a controller sets at a control tick: caps, routes and the total. How admission
    serves its queues (their order, the KV budget) is its discipline for the whole run
    (:mod:`rlbatch.control.discipline`), not part of an action.

    :param caps: per bucket, the most requests of that bucket an engine may hold (running or
        waiting inside it); ``None`` = no admission control for that bucket (requests go
        straight to the engine's own FIFO queue, as with a plain vLLM server).
    :param pools: per bucket, the pool (``fp16`` / ``fp8``) its requests are routed to, or
        :data:`ANY_POOL`: the least-loaded engine of any pool.
    :param max_num_seqs: engine-wide cap on running sequences (vLLM ``--max-num-seqs``;
        live: the scheduler's ``max_num_active_reqs``); ``None`` keeps the engine default.
    :param pool_max_num_seqs: ``(pool, cap)`` pairs that lower ``max_num_seqs`` for that
        pool's engines (the guard's TPOT ceiling per precision: an FP8 engine meets a TPOT
        at a bigger batch than an FP16 one); a pool not named runs at ``max_num_seqs``. Only
        under a total.
    """

    caps: tuple[int | None, ...]
    pools: tuple[str, ...]
    max_num_seqs: int | None = None
    pool_max_num_seqs: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.caps) != len(self.pools):
            raise ValueError(f"caps ({len(self.caps)}) and pools ({len(self.pools)}) must have "
                             f"one entry per bucket")
        for cap in self.caps:
            if cap is not None and cap < 1:
                raise ValueError(f"bucket caps must be >= 1 or None, got {self.caps}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")
        if self.pool_max_num_seqs:
            if self.max_num_seqs is None:
                raise ValueError("pool_max_num_seqs lowers max_num_seqs per pool: it needs a "
                                 "max_num_seqs")
            pools = [p for p, _ in self.pool_max_num_seqs]
            if len(set(pools)) != len(pools) or any(c < 1 for _, c in self.pool_max_num_seqs):
                raise ValueError(f"pool_max_num_seqs must name each pool once with a cap >= 1, "
                                 f"got {self.pool_max_num_seqs}")


@dataclass(frozen=True)
class SLA:
    """Per-request service-level objective (DistServe-style goodput counts requests meeting
    both).

    :param ttft_s: time-to-first-token limit.
    :param tpot_s: time-per-output-token limit.
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLA limits must be > 0, got ttft_s={self.ttft_s}, "
                             f"tpot_s={self.tpot_s}")


@dataclass(frozen=True)
class DeploymentInfo:
    """What a controller knows about the deployment it controls.

    :param buckets: the prompt-length buckets.
    :param pools: the pools present, each with its number of engines.
    :param gpu: GPU profile name.
    :param model: model profile name.
    :param default_max_num_seqs: the engines' configured ``max_num_seqs``.
    :param max_num_batched_tokens: the engines' token budget per iteration.
    :param num_kv_blocks: KV blocks per engine, by pool.
    :param block_size: tokens per KV block.
    :param max_model_len: longest sequence an engine accepts.
    :param tick_s: control interval.
    :param sla: the SLA in force.
    :param cold_start: the engines have just started (cold caches, graphs still compiling):
        the guard's warm-up ramp applies. Simulated engines are warm from t=0 and a trace
        slice starts mid-service, so simulated runs say ``False`` unless asked otherwise.
    :param capacity_rps: reference requests per second the whole deployment serves
        (:func:`rlbatch.profiles.capacity.reference_capacity_rps` summed over engines; 0:
        unknown). Observation version 3 states rates in this unit and needs it.
    """

    buckets: Buckets
    pools: dict[str, int]
    gpu: str
    model: str
    default_max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: dict[str, int]
    block_size: int
    max_model_len: int
    tick_s: float
    sla: SLA
    cold_start: bool = False
    capacity_rps: float = 0.0

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(self.pools)


@quick_init  # once per control tick
@dataclass(frozen=True, slots=True)
class WindowStats:
    """Latency percentiles over the sliding window ending at the tick (NaN when empty).

    :param window_s: window length.
    :param ttft_p99_s: per bucket.
    :param tpot_p99_s: per bucket.
    :param ttft_p99_all_s: all buckets together.
    :param tpot_p99_all_s: all buckets together.
    :param e2e_p99_all_s: all buckets together.
    :param completed: per bucket, completions in the window.
    :param sla_met: per bucket, completions in the window that met the SLA.
    """

    window_s: float
    ttft_p99_s: tuple[float, ...]
    tpot_p99_s: tuple[float, ...]
    ttft_p99_all_s: float
    tpot_p99_all_s: float
    e2e_p99_all_s: float
    completed: tuple[int, ...]
    sla_met: tuple[int, ...]


@quick_init  # once per control tick
@dataclass(frozen=True, slots=True)
class DeploymentStats:
    """One control tick's snapshot of the whole deployment.

    :param time_s: tick time.
    :param tick_s: interval length.
    :param engines: one EngineStats per engine.
    :param queued: per bucket, requests waiting in rlbatch's admission queues.
    :param arrived: per bucket, arrivals during the tick.
    :param rejected: per bucket, requests refused during the tick.
    :param window: sliding-window latency percentiles.
    :param action: the action in force during the tick.
    :param kv_budget_blocked: the KV budget held a request back during the tick.
    :param oldest_wait_s: per bucket, how long the head of its admission queue has waited
        (0 when empty).
    :param doomed: per bucket, requests that became unable to meet the TTFT SLA in the tick:
        their deadline (arrival + ``sla.ttft_s``) passed by the tick time without a first
        token, whether they wait in admission or inside an engine (or an engine already
        reported their late first token). Each request is counted once, in one tick; its
        later completion is not a new miss. ``()`` when the loop does not track deadlines.
    :param doomed_pending: per bucket, requests counted in ``doomed`` (this tick or before)
        that are still unfinished at the tick time. ``()`` when not tracked.
    :param oldest_unserved_s: how long the oldest accepted request still without a first
        token has waited, wherever it waits (admission queue, an engine's waiting queue, or
        mid-prefill); 0 when there is none or the loop does not track deadlines. The sidecar,
        which sees no first token of a non-streamed answer, reports the oldest request not
        forwarded yet (an admission queue, or held at an upstream by the engine-wide cap).
    """

    time_s: float
    tick_s: float
    engines: tuple[EngineStats, ...]
    queued: tuple[int, ...]
    arrived: tuple[int, ...]
    rejected: tuple[int, ...]
    window: WindowStats
    action: ControlAction
    kv_budget_blocked: bool = False
    oldest_wait_s: tuple[float, ...] = ()
    doomed: tuple[int, ...] = ()
    doomed_pending: tuple[int, ...] = ()
    oldest_unserved_s: float = 0.0

    @property
    def deadlines_tracked(self) -> bool:
        """The loop counted TTFT-deadline misses (``doomed``) for this tick: a completion
        that missed its TTFT was then already counted there."""
        return len(self.doomed) > 0

    # ------------------------------------------------------------------ derived, per bucket
    @property
    def running_per_bucket(self) -> tuple[int, ...]:
        """Per bucket, running sequences summed over engines."""
        return tuple(sum(es.running[b] for es in self.engines) for b in range(len(self.queued)))

    @property
    def waiting_per_bucket(self) -> tuple[int, ...]:
        """Per bucket, sequences waiting inside engines, summed over engines."""
        return tuple(sum(es.waiting[b] for es in self.engines) for b in range(len(self.queued)))

    @property
    def in_engines_per_bucket(self) -> tuple[int, ...]:
        """Per bucket, requests inside engines (running + engine-waiting)."""
        return tuple(sum(es.running[b] + es.waiting[b] for es in self.engines)
                     for b in range(len(self.queued)))

    # ------------------------------------------------------------------ derived, totals
    @property
    def running_total(self) -> int:
        """Running sequences over all engines and buckets."""
        return sum(es.running_total for es in self.engines)

    @property
    def waiting_total(self) -> int:
        """Sequences waiting inside engines, all engines and buckets."""
        return sum(es.waiting_total for es in self.engines)

    @property
    def preemptions(self) -> int:
        """Preemptions in the tick, all engines."""
        return sum(es.preemptions for es in self.engines)

    @property
    def kv_overflows(self) -> int:
        """KV overflow iterations in the tick, all engines."""
        return sum(es.kv_overflows for es in self.engines)

    @property
    def finished(self) -> tuple[FinishedRequest, ...]:
        """Requests that finished in the tick, engine by engine."""
        return tuple(rec for es in self.engines for rec in es.finished)

    @property
    def finished_count(self) -> int:
        """Requests that finished in the tick, all engines."""
        return sum(len(es.finished) for es in self.engines)

    @property
    def decode_tokens(self) -> int:
        """Output tokens generated in the tick, all engines."""
        return sum(es.decode_tokens for es in self.engines)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed in the tick, all engines."""
        return sum(es.prefill_tokens for es in self.engines)

    @property
    def computed_tokens(self) -> int:
        """Prefill + decode tokens computed in the tick, all engines."""
        return sum(es.prefill_tokens + es.decode_tokens for es in self.engines)

    @property
    def recomputed_tokens(self) -> int:
        """KV tokens thrown away by preemption in the tick, all engines."""
        return sum(es.recomputed_tokens for es in self.engines)

    @property
    def throughput_tok_s(self) -> float:
        """Output tokens per second of the tick."""
        return self.decode_tokens / self.tick_s

    @property
    def batch_efficiency(self) -> float:
        """Useful / computed tokens in the tick (NaN when nothing was computed); see
        :func:`rlbatch.engine.stats.batch_efficiency`."""
        return batch_efficiency(self.computed_tokens, self.recomputed_tokens)

    # ------------------------------------------------------------------ derived, maxima
    @property
    def kv_cache_usage_max(self) -> float:
        """Highest KV cache usage over engines (0 with no engine)."""
        return max((es.kv_cache_usage for es in self.engines), default=0.0)

    @property
    def kv_committed_max(self) -> float:
        """Highest committed KV (prompt + expected output of admitted requests) as a fraction of
        the engine's pool, over engines that report a pool (0 when none does)."""
        return max((es.committed_tokens / es.kv_capacity_tokens for es in self.engines
                    if es.kv_capacity_tokens > 0), default=0.0)

    @property
    def gpu_memory_used_max(self) -> float:
        """Highest GPU memory use (fraction of the device) over engines that report it."""
        return max((es.gpu_memory_used_bytes / es.gpu_memory_total_bytes for es in self.engines
                    if es.gpu_memory_total_bytes > 0), default=0.0)

    def pool_engines(self, pool: str) -> tuple[EngineStats, ...]:
        """The snapshots of ``pool``'s engines.

        :param pool: the pool name.
        """
        return tuple(es for es in self.engines if es.pool == pool)


def within_sla(ttft_s: Any, tpot_s: Any, sla: SLA) -> Any:
    """TTFT and TPOT both within the SLA's limits (NaN: not): the one formula, for a float or
    elementwise for numpy arrays (a run's summary takes every record's columns at once)."""
    return (ttft_s <= sla.ttft_s) & (tpot_s <= sla.tpot_s)


def meets_sla(rec: FinishedRequest, sla: SLA) -> bool:
    """A finished request meets the SLA when both its TTFT and TPOT are within limits."""
    return (not rec.rejected) and bool(within_sla(rec.ttft_s, rec.tpot_s, sla))
