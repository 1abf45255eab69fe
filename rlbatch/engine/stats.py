"""EngineStats: the one snapshot type every consumer reads.

The observation, the reward, the metrics summary, TensorBoard and Prometheus all read these
snapshots; nothing reads engine internals (vLLM's SchedulerStats -> StatLoggerBase pattern).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlbatch.frozen import quick_init


def batch_efficiency(computed_tokens: int, recomputed_tokens: int) -> float:
    """Useful tokens / computed tokens: the one batch-efficiency formula.

    With continuous batching and paged KV there is no padding; the waste is KV that was
    computed and then thrown away by preemption (recompute). 1.0 when nothing was preempted,
    lower in preemption storms; NaN before any token was computed.

    :param computed_tokens: prefill + decode tokens computed.
    :param recomputed_tokens: KV tokens thrown away by preemption.
    """
    if computed_tokens == 0:
        return math.nan
    return max(0.0, computed_tokens - recomputed_tokens) / computed_tokens


@quick_init  # one per request
@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """Timings of one request that left the system (finished or rejected).

    :param request_id: id from the workload.
    :param bucket: prompt-length bucket index.
    :param pool: pool the request ran in ("" when it never reached an engine).
    :param arrival_s: arrival time.
    :param prompt_tokens: prompt length actually served (after any truncation).
    :param output_tokens: tokens generated.
    :param ttft_s: time to first token (arrival -> first token), NaN if rejected.
    :param tpot_s: time per output token after the first (0 for one-token outputs), NaN if
        rejected.
    :param e2e_s: arrival -> last token, NaN if rejected.
    :param finish_s: time the request left the system.
    :param preemptions: times this request was preempted (recomputed).
    :param truncated: the prompt was cut to fit ``max_model_len``.
    :param rejected: the request was refused (too long, or queue full); no timings.
    """

    request_id: int
    bucket: int
    pool: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    finish_s: float
    preemptions: int = 0
    truncated: bool = False
    rejected: bool = False

    def comparable(self) -> tuple[object, ...]:
        """Every field, with NaN timings (rejected requests) as ``None`` so that equal
        records compare equal."""
        return tuple(None if isinstance(v, float) and v != v else v
                     for v in (self.request_id, self.bucket, self.pool, self.arrival_s,
                               self.prompt_tokens, self.output_tokens, self.ttft_s, self.tpot_s,
                               self.e2e_s, self.finish_s, self.preemptions, self.truncated,
                               self.rejected))


@quick_init  # one per aborted request
@dataclass(frozen=True, slots=True)
class AbortedRequest:
    """A request an engine removed before it finished (the client gave up: vLLM aborts a
    request whose connection closed), with what it had cost. It never has a
    :class:`FinishedRequest`.

    :param request_id: id from the workload.
    :param bucket: prompt-length bucket index.
    :param pool: pool of the engine that held it.
    :param arrival_s: arrival time.
    :param abort_s: the engine clock when it was removed (an iteration boundary).
    :param prefill_tokens_computed: prompt tokens the engine computed for it, the tokens
        recomputed after each preemption included (prompt and output so far), prefix-cache
        hits and copies from the host KV tier excluded.
    :param output_tokens: tokens it had generated.
    :param first_token: it had produced its first token.
    """

    request_id: int
    bucket: int
    pool: str
    arrival_s: float
    abort_s: float
    prefill_tokens_computed: int
    output_tokens: int
    first_token: bool


@quick_init  # one per engine and control tick
@dataclass(frozen=True, slots=True)
class EngineStats:
    """State and counters of one engine over one interval (a control tick).

    Counters (``*_total`` excluded) cover the interval ``[start_s, time_s)``; gauges are read
    at ``time_s``.

    :param engine_id: index of the engine in its deployment.
    :param pool: pool name (``fp16`` / ``fp8``).
    :param start_s: interval start.
    :param time_s: interval end (engine clock when the snapshot was taken).
    :param running: running sequences per bucket (admitted and scheduled in the engine).
    :param waiting: sequences per bucket inside the engine waiting for their (re)prefill.
    :param kv_cache_usage: fraction of KV blocks in use at ``time_s``.
    :param kv_cache_usage_peak: highest fraction of KV blocks in use during the interval.
    :param committed_tokens: KV the admission budget counts for the requests inside the
        engine (prompt + expected output, whole blocks: :mod:`rlbatch.engine.reserve`).
    :param kv_capacity_tokens: tokens the KV pool holds.
    :param num_kv_blocks: KV blocks in the pool.
    :param gpu_memory_used_bytes: GPU memory in use (the simulator models vLLM's
        pre-allocation: weights + activation reserve + the whole KV pool).
    :param gpu_memory_total_bytes: GPU memory on one device.
    :param iterations: engine iterations (forward passes) in the interval.
    :param busy_s: engine time spent in iterations (the rest was idle).
    :param prefill_tokens: prompt tokens computed (recomputation after preemption included).
    :param decode_tokens: output tokens generated.
    :param preemptions: requests preempted (recompute) in the interval.
    :param recomputed_tokens: KV tokens thrown away by preemption (to be computed again).
    :param kv_overflows: iterations in which a running request could not get a KV block.
    :param max_num_seqs: engine-wide cap on running sequences in force.
    :param finished: requests that finished in the interval on this engine.
    :param first_tokens: ``(request_id, time)`` of every request whose first output token
        came in the interval (what the control loop's TTFT-deadline accounting reads);
        empty from an engine that does not report them (the sidecar's HTTP upstreams).
    :param prefix_cache_queries: prompt tokens of requests admitted for the first time in
        the interval, looked up in the prefix cache (vLLM ``prefix_cache_queries``; 0 with
        prefix caching off or from an engine that does not report it).
    :param prefix_cache_hits: of those, tokens found cached (vLLM ``prefix_cache_hits``).
    :param prefix_cache_evictions: cached KV blocks that lost their hash to an allocation.
    :param kv_offload_hits: prompt tokens of first admissions found in the host KV tier past
        their GPU hit, and loaded from it (0 without the tier: ``kv_offload_num_blocks``).
    :param kv_offload_loads: copies from the host tier issued (one per request admitted
        with a host hit, first admissions and re-admissions after preemption).
    :param kv_offload_loaded_blocks: KV blocks those copies move to the GPU.
    :param kv_offload_load_bytes: bytes of those copies (every tensor-parallel rank's share).
    :param kv_offload_load_s: summed seconds from each load's issue to its completion (time
        its request waited on the host link, queueing behind earlier copies included).
    :param kv_offload_stored_blocks: KV blocks copied from the GPU to the host tier.
    :param kv_offload_store_bytes: bytes of those copies.
    :param kv_offload_evictions: blocks the host tier dropped to make room.
    :param kv_offload_usage: fraction of the host tier's blocks holding KV at ``time_s``
        (vLLM's ``vllm:kv_offload_cpu_cache_usage_perc`` counts only blocks pinned by copies
        in flight; this is the occupancy). The guard's memory rule reads ``kv_cache_usage``.
    :param kv_offload_num_blocks: KV blocks the host tier holds (0: no host tier).
    :param aborted: requests removed from the engine in the interval before finishing
        (:meth:`~rlbatch.engine.base.Engine.abort`); empty from an engine that does not
        report them.
    """

    engine_id: int
    pool: str
    start_s: float
    time_s: float
    running: tuple[int, ...]
    waiting: tuple[int, ...]
    kv_cache_usage: float
    kv_cache_usage_peak: float
    committed_tokens: int
    kv_capacity_tokens: int
    num_kv_blocks: int
    gpu_memory_used_bytes: int
    gpu_memory_total_bytes: int
    iterations: int
    busy_s: float
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    recomputed_tokens: int
    kv_overflows: int
    max_num_seqs: int
    finished: tuple[FinishedRequest, ...]
    first_tokens: tuple[tuple[int, float], ...] = ()
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
    kv_offload_usage: float = 0.0
    kv_offload_num_blocks: int = 0
    aborted: tuple[AbortedRequest, ...] = ()

    @property
    def running_total(self) -> int:
        """Running sequences, all buckets."""
        return sum(self.running)

    @property
    def waiting_total(self) -> int:
        """Sequences waiting inside the engine, all buckets."""
        return sum(self.waiting)

    @property
    def computed_tokens(self) -> int:
        """Prefill + decode tokens computed in the interval."""
        return self.prefill_tokens + self.decode_tokens
