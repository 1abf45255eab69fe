"""The control vocabulary: actions, SLA, what a controller is told and shown.

A controller is consulted once per control tick with the deployment's stats snapshot and
returns a ControlAction. Controllers living outside the core package (rule controllers and
PPO in ``policies/``) register through the ``rlbatch.controllers`` entry-point group, so the
core never imports them: ``make_controller("playbook")`` finds them by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.buckets import Buckets
from rlbatch.engine.stats import EngineStats, FinishedRequest

ENTRY_POINT_GROUP = "rlbatch.controllers"


@dataclass(frozen=True)
class ControlAction:
    """What a controller sets at a control tick.

    :param caps: per bucket, the most requests of that bucket an engine may hold (running or
        waiting inside it); ``None`` = no admission control for that bucket (requests go
        straight to the engine's own FIFO queue, as with a plain vLLM server).
    :param pools: per bucket, the pool (``fp16`` / ``fp8``) its requests are routed to.
    :param max_num_seqs: engine-wide cap on running sequences (vLLM ``--max-num-seqs``;
        live: the scheduler's ``max_num_active_reqs``); ``None`` keeps the engine default.
    :param kv_budget_fraction: admit a request into an engine only while the KV its
        requests may need (prompt + max output, committed) stays within this fraction of the
        KV pool; an empty engine always takes its oldest request. ``None`` = no budget. Set by
        the guard's KV-budget rule.
    """

    caps: tuple[int | None, ...]
    pools: tuple[str, ...]
    max_num_seqs: int | None = None
    kv_budget_fraction: float | None = None

    def __post_init__(self) -> None:
        if len(self.caps) != len(self.pools):
            raise ValueError(f"caps ({len(self.caps)}) and pools ({len(self.pools)}) must have "
                             f"one entry per bucket")
        for cap in self.caps:
            if cap is not None and cap < 1:
                raise ValueError(f"bucket caps must be >= 1 or None, got {self.caps}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")
        if self.kv_budget_fraction is not None and not 0 < self.kv_budget_fraction <= 1:
            raise ValueError(f"kv_budget_fraction must be in (0, 1] or None, got "
                             f"{self.kv_budget_fraction}")


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

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(self.pools)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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

def meets_sla(rec: FinishedRequest, sla: SLA) -> bool:
    """A finished request meets the SLA when both its TTFT and TPOT are within limits."""
    return (not rec.rejected) and rec.ttft_s <= sla.ttft_s and rec.tpot_s <= sla.tpot_s
