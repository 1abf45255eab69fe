"""Discrete-event simulator of one vLLM V1 engine.

Semantics follow vLLM V1's scheduler (``v1/core/sched/scheduler.py``) with the FCFS policy:

* continuous batching: every iteration first schedules the running requests in order (a
  decode needs one token; a request still in prefill gets the next chunk), then admits
  requests from the engine's waiting queue while ``len(running) < max_num_seqs``, all within
  the iteration's ``max_num_batched_tokens`` budget (chunked prefill);
* paged KV cache of ``block_size``-token blocks; a request holds ``ceil(computed / block)``
  blocks;
* when a running request cannot get a block, the newest running request is preempted by
  recompute (its blocks are freed, it returns to the front of the waiting queue, and its
  prompt plus the tokens generated so far are prefilled again later); waiting requests are
  not admitted in an iteration that preempted;
* a waiting request is admitted only if its first chunk's blocks are free;
* prefix caching (``EngineConfig.enable_prefix_caching``, on as in vLLM V1): a request with
  prefix information (Mooncake ``hash_ids``) skips the prefill of its longest cached prefix
  of full blocks, shared blocks are held once, and blocks nobody holds stay cached until an
  allocation evicts them, least recently freed first (:mod:`rlbatch.engine.prefix_cache`);
* host KV tier (``EngineConfig.kv_offload_gib``, off by default; vLLM's native CPU
  offloading): every prompt block computed is copied to a host pool (LRU), and a prefix
  that left the GPU cache but is still there is copied back over the host link while its
  request waits outside the running list, the copy overlapping the iterations
  (:mod:`rlbatch.engine.host_tier`, :mod:`rlbatch.engine.sim_caches`);
* aborts (:meth:`SimEngine.abort`, vLLM's ``abort_request`` when a client disconnects): a
  request leaves at an iteration boundary from wherever it is, its blocks returned as a
  finished request's (those of one waiting for a copy from the host once the copy
  completed), recorded as an :class:`~rlbatch.engine.stats.AbortedRequest`, never finished.

Event skipping: requests in steady decode advance together in a
:class:`~rlbatch.engine.decode_lane.DecodeLane` (an iteration costs O(1) for them plus the
requests that start, finish or grow their KV reserve), and when every running request decodes
one token and none can be admitted, the following iterations have the same composition until
a request finishes, a block allocation would fail, or the clock passes ``bound_s`` (next
arrival or control tick): those are advanced in one go. The clock accumulates exactly the
same floating-point sums as stepping one by one, so both give identical request timings
(tests/test_sim.py). The iterations live in :mod:`rlbatch.engine.sim_exact` (request by
request, the reference) and :mod:`rlbatch.engine.sim_scheduler` (the faster paths).
"""

from __future__ import annotations

from operator import sub

from rlbatch.engine.base import PrefillTime
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.decode_lane import DecodeLane
from rlbatch.engine.fork import fork_state
from rlbatch.engine.host_tier import HostLink
from rlbatch.engine.reserve import PEAK_KEY_SHIFT, KvCommitMode, peak_of_keys
from rlbatch.engine.sim_scheduler import SimScheduler
from rlbatch.engine.sim_seq import SimSeq
from rlbatch.engine.stats import AbortedRequest, EngineStats
from rlbatch.profiles import StepTimeModel
from rlbatch.request import Request


class SimEngine(SimScheduler):
    """One simulated vLLM V1 engine.

    :param engine_id: index in the deployment.
    :param pool: pool name (``fp16`` / ``fp8``).
    :param config: scheduler and cache settings.
    :param step_model: step-time model for this engine's GPU, model and precision.
    :param num_kv_blocks: KV blocks in the pool.
    :param max_model_len: longest sequence (prompt + output) accepted.
    :param gpu_memory_total_bytes: memory of one GPU.
    :param num_buckets: number of prompt-length buckets (for per-bucket counts).
    :param event_skipping: advance steady decodes together and runs of pure-decode
        iterations in one go (identical result).
    :param start_s: initial clock.
    :param host_link: the host tier's block bytes and copy time
        (:func:`~rlbatch.engine.host_tier.host_link_of`), needed when
        ``config.kv_offload_gib > 0``.
    """

    def __init__(
        self,
        engine_id: int,
        pool: str,
        config: EngineConfig,
        step_model: StepTimeModel,
        num_kv_blocks: int,
        max_model_len: int,
        gpu_memory_total_bytes: int,
        num_buckets: int,
        *,
        event_skipping: bool = True,
        start_s: float = 0.0,
        host_link: HostLink | None = None,
    ) -> None:
        if num_kv_blocks * config.block_size < max_model_len:
            raise ValueError(
                f"engine {engine_id} ({pool}): the KV cache holds {num_kv_blocks} blocks x "
                f"{config.block_size} = {num_kv_blocks * config.block_size} tokens, fewer than "
                f"max_model_len={max_model_len}; lower max_model_len or raise "
                f"gpu_memory_utilization")
        super().__init__(pool, config, step_model, num_kv_blocks, num_buckets, max_model_len,
                         event_skipping=event_skipping, start_s=start_s, host_link=host_link)
        self.engine_id = engine_id
        self.max_model_len = max_model_len
        self.gpu_memory_total_bytes = gpu_memory_total_bytes
        self.num_buckets = num_buckets
        # kv_budget_exceeded's last peak figure and the version and need it was taken at
        self._over_version = -1
        self._over_need = -1
        self._over_value = 0
        self._reset_interval()

    # ----------------------------------------------------------------- Engine protocol
    @property
    def now_s(self) -> float:
        return self._now

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    def set_max_num_seqs(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {value}")
        self._max_num_seqs = value

    def num_unfinished(self, bucket: int) -> int:
        return self._unfinished[bucket]

    def num_unfinished_total(self) -> int:
        return len(self._running) + len(self._waiting) + len(self._loading)

    def num_waiting(self, bucket: int) -> int:
        return self._unfinished[bucket] - self._in_running[bucket]

    @property
    def last_start_s(self) -> float:
        """When the last iteration started (a boundary where arrivals were due)."""
        return self._last_start

    def holds_new_arrivals(self) -> bool:
        """A request added now would not be admitted by the next iterations while nothing
        finishes: the running count is at ``max_num_seqs`` or the token budget, or the
        waiting queue's head does not fit the free blocks (which only shrink meanwhile)."""
        n = len(self._running)
        if n >= self._max_num_seqs or self._budget - n <= 0:
            return True
        if self._aborted_loads:
            return False  # blocks return when their copies complete: the free ones grow
        return bool(self._waiting) and self._admission_blocked(hits_may_grow=True)

    def committed_tokens(self) -> int:
        self._sync_growth()
        return self._committed_tokens

    def kv_tokens_to_admit(self, request: Request, bucket: int, prompt_tokens: int) -> int:
        return self._reserve.at_admission(request, bucket, prompt_tokens)

    def committed_with(self, need: int, commit: KvCommitMode) -> int:
        committed = self.committed_tokens()  # also brings the counts below up to date
        if commit == "final":
            return committed + need
        epoch = self._lane.epoch
        keys: list[int] = []  # the decoding requests, packed for peak_of_keys
        counts = 0
        for seq in self._running:
            if seq.in_lane:
                tokens = seq.prompt_len + seq.out_base + epoch
            elif seq.num_computed and seq.num_computed == seq.prompt_len + seq.num_output - 1:
                # one token left to compute: a decode to the scheduler (the last prompt token
                # too, which an iteration the engine counts as pure decode computes)
                tokens = seq.prompt_len + seq.num_output
            else:
                continue  # in prefill (or recomputing after a preemption): held
            count = seq.committed
            counts += count
            keys.append(((count - tokens if count > tokens else 0) << PEAK_KEY_SHIFT) | tokens)
        # the rest (waiting, loading, in prefill, the one admitted) is held throughout
        return peak_of_keys(need + committed - counts, keys, counts, self.kv_block_size)

    def kv_budget_exceeded(self, need: int, commit: KvCommitMode, limit: float) -> bool:
        # While the budget holds a request back the deployment asks at every boundary. The
        # peak figure never falls while only pure-decode iterations run and counts grow
        # (self._kv_version; rlbatch.engine.reserve), so a figure over the limit stays over.
        if (self._over_value > limit and self._over_need == need
                and self._over_version == self._kv_version and commit == "peak"):
            return True
        committed = self.committed_tokens()
        if committed == 0 or committed + need <= limit:
            return False
        value = self.committed_with(need, commit)
        if commit == "peak":
            self._over_version = self._kv_version
            self._over_need = need
            self._over_value = value
        return value > limit

    @property
    def kv_block_size(self) -> int:
        return self._block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self._block_size

    def is_idle(self) -> bool:
        return not self._running and not self._waiting and not self._loading

    def advance_idle(self, to_s: float) -> None:
        if not self.is_idle():
            raise RuntimeError("advance_idle called on a busy engine")
        if to_s > self._now:
            self._note_idle(to_s - self._now)
            self._now = to_s
            if self._aborted_loads:
                self._free_aborted_loads()

    def add_request(self, request: Request, bucket: int, prompt_tokens: int,
                    truncated: bool) -> None:
        if prompt_tokens + request.max_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt {prompt_tokens} + output "
                f"{request.max_output_tokens} exceeds max_model_len {self.max_model_len}")
        ids = request.prefix_ids
        prefix = None
        if ids and self._cache is not None:
            prefix = (ids, request.prompt_tokens - prompt_tokens)  # a truncated prompt's tail
        seq = SimSeq(request, bucket, prompt_tokens, truncated, prefix)
        seq.kv_limit, seq.committed, seq.grow_at = self._reserve.admission(
            request, bucket, prompt_tokens)
        self._waiting.append(seq)
        self._unfinished[bucket] += 1
        self._committed_tokens += seq.committed
        self._kv_version += 1

    def prefill_time_s(self, request: Request, prompt_tokens: int) -> PrefillTime:
        model, budget = self.step_model, self._budget
        alone = model.prefill_time_s(prompt_tokens,
                                     self.cached_prompt_tokens(request, prompt_tokens), budget)
        ahead = 0.0
        for seq in self._running:  # scheduled before any newcomer, their chunks first
            if seq.in_lane:  # decoding (its counts live in the lane, not in its fields)
                continue
            total = seq.prompt_len + seq.num_output
            if total - seq.num_computed > 1 or seq.num_computed == 0:  # not decoding
                ahead += model.prefill_time_s(total, seq.num_computed, budget)
        return PrefillTime(alone, ahead + alone)

    def abort(self, request_id: int, *,
              before_first_token: bool = False) -> AbortedRequest | None:
        """Remove a request at the current iteration boundary (the Engine protocol's
        :meth:`~rlbatch.engine.base.Engine.abort`): from the decode lane or the running list
        (its blocks returned, cached ones kept cached and evictable), the loading list (its
        blocks returned once its copy from the host completes) or the waiting queue. Its
        host-tier blocks are ranked again as a finished request's; its output is not an
        observation for the KV reserve. O(requests).

        :param request_id: the workload's request id.
        :param before_first_token: only if it has not produced its first token.
        :returns: its record, or ``None`` (not held here; or it already has its first
            token and ``before_first_token`` is set: it goes on).
        """
        found = self._locate(request_id)
        if found is None:
            return None
        seq, where = found
        if before_first_token and seq.first_token_s >= 0.0:
            return None
        return self._withdraw(seq, where)

    def fork(self) -> SimEngine:
        """An independent copy of the engine's state (a digital twin's fork): the step-time
        model and config shared, every sequence and counter copied (see
        :func:`~rlbatch.engine.fork.fork_state`), the prefix cache and the host tier forked;
        the decode lane is emptied first (its requests back to their own fields), so the copy
        starts with an empty lane of its own.
        """
        self._leave_lane()
        new = fork_state(self, SimSeq, share=("_reserve", "_lane", "_cache", "_host"))
        new._reserve = self._reserve.fork()
        new._lane = DecodeLane(self._block_size)
        if self._cache is not None:
            new._cache = self._cache.fork()
            for seq in (*new._running, *new._loading, *new._aborted_loads):
                if seq.layout is not None:
                    seq.extents = seq.extents[:]  # a waiting one gets a new list when admitted
        if self._host is not None:
            new._host = self._host.fork()
        return new

    def pending(self) -> list[tuple[int, float, float, int, int]]:
        """Requests inside the engine (running, then waiting) as ``(bucket, arrival_s,
        first_token_s, num_output, max_output)``; ``first_token_s`` is -1 before the first
        token. What a twin's rollout scores at its horizon."""
        lane = self._lane
        return [(s.bucket, s.arrival_s, s.first_token_s,
                 lane.num_output_of(s) if s.in_lane else s.num_output, s.max_output)
                for q in (self._running, self._loading, self._waiting) for s in q]

    # ----------------------------------------------------------------- stats
    def _reset_interval(self) -> None:
        self._interval_start = self._now
        self._busy_s = 0.0
        self._iterations = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._preemptions = 0
        self._recomputed_tokens = 0
        self._kv_overflows = 0
        self._peak_used_blocks = self.num_kv_blocks - self._free_blocks
        self._finished = []
        self._first_tokens = []
        self._aborted = []
        cache = self._cache
        # the prefix cache counts from its start: the interval's are the differences
        self._prefix_counts = ((cache.queries, cache.hits, cache.evictions)
                               if cache is not None else (0, 0, 0))
        host = self._host
        self._host_counts = host.counters() if host is not None else (0, 0, 0, 0.0, 0, 0)

    def snapshot(self) -> EngineStats:
        running = self._in_running
        # The waiting queue can hold thousands under overload: derive its counts.
        unfinished = self._unfinished
        waiting = tuple(map(sub, unfinished, running))  # per bucket: unfinished - running
        used = self.num_kv_blocks - self._free_blocks
        assert 0 <= self._free_blocks <= self.num_kv_blocks, self._free_blocks
        queries, hits, evictions = self._prefix_counts
        cache = self._cache
        if cache is not None:
            cache.sync(self._free_blocks)  # the evictions of the allocations made so far
            queries, hits, evictions = (cache.queries - queries, cache.hits - hits,
                                        cache.evictions - evictions)
        host = self._host
        host_hits, loads, loaded, load_s, stored, host_evictions = self._host_counts
        host_usage = 0.0
        block_bytes = 0
        if host is not None:  # the interval's counts: the differences
            now = host.counters()
            host_hits, loads, loaded = now[0] - host_hits, now[1] - loads, now[2] - loaded
            load_s, stored, host_evictions = (now[3] - load_s, now[4] - stored,
                                              now[5] - host_evictions)
            host_usage = host.used / host.num_blocks
            block_bytes = host.link.block_bytes
        stats = EngineStats(
            engine_id=self.engine_id,
            pool=self.pool,
            start_s=self._interval_start,
            time_s=self._now,
            running=tuple(running),
            waiting=waiting,
            kv_cache_usage=used / self.num_kv_blocks,
            kv_cache_usage_peak=self._peak_used_blocks / self.num_kv_blocks,
            committed_tokens=self.committed_tokens(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_kv_blocks=self.num_kv_blocks,
            # vLLM pre-allocates its whole budget (weights, activations, KV pool) at start-up.
            gpu_memory_used_bytes=int(self.gpu_memory_total_bytes
                                      * self.config.gpu_memory_utilization),
            gpu_memory_total_bytes=self.gpu_memory_total_bytes,
            iterations=self._iterations,
            busy_s=self._busy_s,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            preemptions=self._preemptions,
            recomputed_tokens=self._recomputed_tokens,
            kv_overflows=self._kv_overflows,
            max_num_seqs=self._max_num_seqs,
            finished=tuple(self._finished),
            first_tokens=tuple(self._first_tokens),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_evictions=evictions,
            kv_offload_hits=host_hits,
            kv_offload_loads=loads,
            kv_offload_loaded_blocks=loaded,
            kv_offload_load_bytes=loaded * block_bytes,
            kv_offload_load_s=load_s,
            kv_offload_stored_blocks=stored,
            kv_offload_store_bytes=stored * block_bytes,
            kv_offload_evictions=host_evictions,
            kv_offload_usage=host_usage,
            kv_offload_num_blocks=host.num_blocks if host is not None else 0,
            aborted=tuple(self._aborted),
        )
        self._reset_interval()
        return stats

    def check_invariants(self) -> None:
        """Internal consistency of the block and KV accounting, request by request (O(all
        requests): the tests call it at every iteration; a snapshot checks only that the free
        blocks are within the pool)."""
        held = 0
        block = self._block_size
        lane = self._lane
        in_lane = 0
        extents: dict[int, list[int]] = {}
        for seq in (*self._running, *self._loading, *self._aborted_loads):
            layout = seq.layout
            if layout is None:
                continue
            assert seq.cached == sum(seq.extents)
            registered = (layout[2][-1] if layout[2] else 0) - seq.uncached
            assert seq.cached <= registered <= (
                lane.blocks_of(seq) if seq.in_lane else seq.blocks)
            for key, extent in zip(layout[0], seq.extents, strict=True):
                if extent:
                    extents.setdefault(key, []).append(extent)
        for seq in self._waiting:
            assert not seq.cached and seq.blocks == 0 and seq.num_computed == 0
        for seq in (*self._loading, *self._aborted_loads):
            # its GPU hit held, registered; the blocks copied not yet
            assert not seq.in_lane and seq.layout is not None
            assert seq.cached == seq.layout[2][-1] - seq.uncached
            assert seq.blocks * block == seq.num_computed > seq.cached * block
            held += seq.blocks
        if self._host is not None:
            self._host.check()
        for seq in self._running:
            if seq.in_lane:
                in_lane += 1
                held += lane.blocks_of(seq)
            else:
                held += seq.blocks
                assert seq.blocks == -(-seq.num_computed // block), (seq.blocks,
                                                                      seq.num_computed)
        assert in_lane == lane.n, (in_lane, lane.n)
        # one finish entry per lane request (an abort takes its entries out)
        assert len(lane.finish_heap) == lane.n and all(e[2].in_lane for e in lane.finish_heap)
        if self._cache is not None:
            self._cache.check(self._free_blocks, extents)
            # a group's blocks held by several requests are held once: its largest extent
            held -= sum(sum(e) - max(e) for e in extents.values())
        per_bucket = [0] * self.num_buckets
        for seq in self._running:
            per_bucket[seq.bucket] += 1
        assert per_bucket == self._in_running, (per_bucket, self._in_running)
        assert held + self._free_blocks == self.num_kv_blocks, (held, self._free_blocks)
        assert 0 <= self._free_blocks <= self.num_kv_blocks
        assert sum(self._unfinished) == (len(self._running) + len(self._waiting)
                                         + len(self._loading))
        assert self._committed_tokens == sum(
            seq.committed for q in (self._running, self._waiting, self._loading) for seq in q)
