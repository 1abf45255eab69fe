"""The simulated engine's scheduler, request by request: vLLM V1's ``schedule()``.

:class:`ExactScheduler` holds a simulated engine's requests, KV blocks, clock and interval
counters, and runs one iteration the way vLLM V1 does (``v1/core/sched/scheduler.py``, FCFS;
the rules are listed in :mod:`rlbatch.engine.sim`): every running request in order, then
admissions from the waiting queue, within the token budget, preempting the newest running
request when a block allocation fails. This is the reference every faster path is held to
(:class:`~rlbatch.engine.sim_scheduler.SimScheduler` adds those, bit-identical).

With prefix caching (:mod:`rlbatch.engine.prefix_cache`) a waiting request with prefix
information looks up its cached prefix when it is admitted: those tokens are computed already (its
first chunk starts after them), the blocks it takes are held by reference, the blocks it
fills get their hashes as they are scheduled, and a request that leaves the running list
(finished or preempted) returns its blocks tail first, the cached ones to the LRU queue.
"""

from __future__ import annotations

from collections import deque

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.prefix_cache import Layout, PrefixCache, prefix_layout
from rlbatch.engine.reserve import OutputReserve
from rlbatch.engine.sim_seq import SimSeq
from rlbatch.engine.stats import FinishedRequest
from rlbatch.profiles import StepTimeModel


class ExactScheduler:
    """Requests, KV blocks and clock of one simulated engine; one iteration at a time.

    :param pool: pool name (``fp16`` / ``fp8``), for the finished records.
    :param config: scheduler and cache settings.
    :param step_model: step-time model for this engine's GPU, model and precision.
    :param num_kv_blocks: KV blocks in the pool.
    :param num_buckets: number of prompt-length buckets.
    :param max_model_len: longest sequence (the KV reserve's ceiling).
    :param event_skipping: whether the faster paths of a subclass may run (kept here so the
        engine's settings live in one place).
    :param start_s: initial clock.
    """

    # interval counters, reset by every snapshot (see _reset_interval)
    _interval_start: float
    _busy_s: float
    _iterations: int
    _prefill_tokens: int
    _decode_tokens: int
    _preemptions: int
    _recomputed_tokens: int
    _kv_overflows: int
    _peak_used_blocks: int
    _finished: list[FinishedRequest]
    _first_tokens: list[tuple[int, float]]

    def __init__(self, pool: str, config: EngineConfig, step_model: StepTimeModel,
                 num_kv_blocks: int, num_buckets: int, max_model_len: int, *,
                 event_skipping: bool, start_s: float) -> None:
        self.pool = pool
        self.config = config
        self.step_model = step_model
        self.num_kv_blocks = num_kv_blocks
        self.event_skipping = event_skipping
        self._block_size = config.block_size
        self._budget = config.max_num_batched_tokens
        self._max_num_seqs = config.max_num_seqs
        self._now = start_s
        self._last_start = start_s
        self._free_blocks = num_kv_blocks
        self._running: list[SimSeq] = []
        self._waiting: deque[SimSeq] = deque()
        self._order = 0  # running-order keys, taken as requests enter the running list
        self._unfinished = [0] * num_buckets
        self._in_running = [0] * num_buckets  # per bucket, requests in the running list
        self._committed_tokens = 0
        self._reserve = OutputReserve(config.kv_reserve, num_buckets, config.block_size,
                                      max_model_len, quantile=config.kv_reserve_quantile)
        self._decode_coeffs: dict[int, tuple[float, float]] = {}
        self._cache = PrefixCache() if config.enable_prefix_caching else None

    def _admission_blocked(self, hits_may_grow: bool = False) -> bool:
        """No waiting request can be admitted at the next iteration, nor at any pure-decode
        iteration after it (the running count stays, free blocks only shrink; an eviction
        only shortens a prefix hit, which never lowers the first chunk's new blocks). With
        ``hits_may_grow``, nor at any iteration before a request finishes (prefills may
        cache more of the head's prefix: the hit is taken at its largest)."""
        waiting = self._waiting
        if not waiting:
            return True
        n = len(self._running)
        budget = self._budget - n
        if n >= self._max_num_seqs or budget <= 0:
            return True
        seq = waiting[0]
        remaining = seq.prompt_len + seq.num_output - seq.num_computed
        if seq.prefix is not None:
            # the first chunk's new blocks; a free cached block in the hit would cost one more
            layout = self._layout(seq)
            max_blocks = min(seq.uncached, (remaining - 1) // self._block_size)
            if not hits_may_grow:
                assert self._cache is not None
                max_blocks = self._cache.lookup(layout, max_blocks, self._free_blocks)
            remaining -= max_blocks * self._block_size
        chunk = remaining if remaining < budget else budget
        need = -(-(seq.num_computed + chunk) // self._block_size) - seq.blocks
        return need > self._free_blocks

    # ----------------------------------------------------------------- request by request
    def _iterate_exact(self) -> None:
        """One iteration, request by request (vLLM V1's ``schedule()`` order)."""
        running = self._running
        waiting = self._waiting
        block = self._block_size
        budget = self._budget
        free = self._free_blocks
        sched: list[tuple[SimSeq, int]] = []
        prefill_tokens = 0
        attn_work = 0.0
        num_decode = 0
        kv_decode = 0
        preempted = False

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            remaining = seq.prompt_len + seq.num_output - seq.num_computed
            n = remaining if remaining < budget else budget
            need = -(-(seq.num_computed + n) // block) - seq.blocks
            if need > free:
                self._kv_overflows += 1
                self_preempted = False
                while need > free:
                    victim = running.pop()
                    self._in_running[victim.bucket] -= 1
                    free = self._release(victim, free)
                    self._recomputed_tokens += victim.num_computed
                    victim.blocks = 0
                    victim.num_computed = 0
                    victim.preemptions += 1
                    waiting.appendleft(victim)
                    self._preemptions += 1
                    preempted = True
                    if victim is seq:
                        self_preempted = True
                        break
                if self_preempted:
                    break
            if need > 0:
                free -= need
                seq.blocks += need
            sched.append((seq, n))
            if seq.uncached:
                self._register(seq, seq.num_computed + n)
            if remaining == 1 and seq.num_computed > 0:
                num_decode += 1
                kv_decode += seq.num_computed + 1
            else:
                prefill_tokens += n
                attn_work += n * (seq.num_computed + (n + 1) / 2)
            budget -= n
            i += 1

        if not preempted:
            budget, free, prefill_tokens, attn_work = self._admit_waiting(
                sched, None, budget, free, prefill_tokens, attn_work)

        self._free_blocks = free
        if not sched:
            # Everything was preempted; the next iteration re-admits from the waiting queue.
            return
        now = self._advance(prefill_tokens, attn_work, num_decode, kv_decode)
        for seq, n in sched:
            self._account(seq, n, now)
        self._note_usage()

    # ----------------------------------------------------------------- shared pieces
    def _admit_waiting(self, sched: list[tuple[SimSeq, int]], admitted: list[SimSeq] | None,
                       budget: int, free: int, prefill_tokens: int,
                       attn_work: float) -> tuple[int, int, int, float]:
        """Start waiting requests (FIFO, vLLM's scheduler) while the token budget, the free
        blocks and ``max_num_seqs`` allow: each joins ``running`` and ``sched`` (and
        ``admitted`` when given). Returns the budget, free blocks, prefill tokens and
        attention work after them."""
        waiting = self._waiting
        running = self._running
        block = self._block_size
        cache = self._cache
        while waiting and budget > 0 and len(running) < self._max_num_seqs:
            seq = waiting[0]
            if seq.prefix is None:
                remaining = seq.prompt_len + seq.num_output - seq.num_computed
                n = remaining if remaining < budget else budget
                need = -(-(seq.num_computed + n) // block) - seq.blocks
                if need > free:
                    break
                free -= need
                seq.blocks += need
            else:
                n, free = self._take_cached_prefix(seq, budget, free)
                if not n:
                    break
            waiting.popleft()
            if cache is not None and not seq.preemptions:
                cache.queries += seq.prompt_len  # vLLM counts first lookups apart
            seq.order = self._order
            self._order += 1
            running.append(seq)
            self._in_running[seq.bucket] += 1
            sched.append((seq, n))
            if admitted is not None:
                admitted.append(seq)
            prefill_tokens += n
            attn_work += n * (seq.num_computed + (n + 1) / 2)
            budget -= n
            if seq.uncached:
                self._register(seq, seq.num_computed + n)
        return budget, free, prefill_tokens, attn_work

    # ----------------------------------------------------------------- prefix caching
    def _take_cached_prefix(self, seq: SimSeq, budget: int, free: int) -> tuple[int, int]:
        """Admit a waiting request with prefix information if its first chunk fits: its
        cached prefix (at most ``num_tokens - 1`` tokens, whole blocks) is held and counts as
        computed, the chunk after it gets new blocks (vLLM's ``get_computed_blocks`` then
        ``allocate_slots``: a free cached block taken costs a free block as well).

        :returns: the chunk's tokens (0: it does not fit, nothing changed) and the free
            blocks after.
        """
        cache = self._cache
        assert cache is not None
        layout = self._layout(seq)
        block = self._block_size
        num_tokens = seq.prompt_len + seq.num_output
        max_blocks = min(seq.uncached, (num_tokens - 1) // block)
        least = num_tokens - max_blocks * block  # the chunk after the longest possible hit
        if -(-(least if least < budget else budget) // block) > free:
            return 0, free  # hopeless whatever is cached: no lookup
        hit = cache.lookup(layout, max_blocks, free)
        cached_tokens = hit * block
        remaining = num_tokens - cached_tokens
        n = remaining if remaining < budget else budget
        taken = cache.evictable(layout, hit) if hit else 0
        need = -(-n // block) + taken
        if need > free:
            return 0, free
        seq.extents = [0] * len(layout[0])  # its own list (a fork shares a waiting one's)
        if hit:
            cache.touch(layout, hit, seq.extents)
            seq.num_computed = cached_tokens
        seq.cached = hit
        seq.uncached -= hit
        seq.blocks = hit + need - taken
        if not seq.preemptions:
            cache.hits += cached_tokens
        return n, free - need

    def _layout(self, seq: SimSeq) -> Layout:
        """A request's block groups, derived at its first lookup (the waiting queue can hold
        thousands of long prompts); ``uncached`` set to its hashed blocks."""
        layout = seq.layout
        if layout is None:
            assert seq.prefix is not None
            ids, start = seq.prefix
            layout = seq.layout = prefix_layout(ids, start + seq.prompt_len, seq.prompt_len,
                                                self._block_size)
            seq.uncached = layout[2][-1] if layout[2] else 0
        return layout

    def _register(self, seq: SimSeq, tokens: int) -> None:
        """The blocks a request's first ``tokens`` fill get their hashes (when scheduled, as
        vLLM's ``cache_blocks``)."""
        cache = self._cache
        layout = seq.layout
        assert cache is not None and layout is not None
        total = layout[2][-1]
        done = total - seq.uncached
        end = tokens // self._block_size
        if end > done:
            if end > total:
                end = total
            seq.cached += cache.register(layout, seq.extents, done, end)
            seq.uncached = total - end

    def _release(self, seq: SimSeq, free: int) -> int:
        """Free blocks after a running request returned its blocks (its ``blocks`` field is
        left for the caller); its registration starts over when it is admitted again."""
        cache = self._cache
        layout = seq.layout
        if layout is None:
            if cache is None or not cache.free_cached:
                return free + seq.blocks
            return cache.release(None, seq.extents, 0, seq.blocks, free)
        assert cache is not None
        total = layout[2][-1] if layout[2] else 0
        done = total - seq.uncached
        seq.uncached = total
        if not seq.cached and not cache.free_cached:
            return free + seq.blocks
        seq.cached = 0
        return cache.release(layout, seq.extents, done, seq.blocks, free)

    def _advance(self, prefill_tokens: int, attn_work: float, num_decode: int,
                 kv_decode: int) -> float:
        """Run the clock over one iteration of that composition; the new time."""
        if prefill_tokens == 0:
            base, per_kv = self._coefficients(num_decode)
            dt = base + per_kv * kv_decode
        else:
            dt = self.step_model.step_time_s(prefill_tokens, attn_work, num_decode, kv_decode)
        self._last_start = self._now
        self._now += dt
        self._busy_s += dt
        self._iterations += 1
        self._prefill_tokens += prefill_tokens
        self._decode_tokens += num_decode
        return self._now

    def _account(self, seq: SimSeq, n: int, now: float) -> None:
        """A request computed ``n`` tokens in the iteration that ended at ``now``."""
        seq.num_computed += n
        if seq.num_computed == seq.prompt_len + seq.num_output:
            seq.num_output += 1
            if seq.first_token_s < 0.0:
                seq.first_token_s = now
                self._first_tokens.append((seq.request_id, now))
            if seq.num_output >= seq.max_output:
                self._finish(seq, now)
            elif seq.num_output >= seq.grow_at:
                self._grow(seq)

    def _coefficients(self, num_decode: int) -> tuple[float, float]:
        coeffs = self._decode_coeffs.get(num_decode)
        if coeffs is None:
            coeffs = self.step_model.decode_coefficients(num_decode)
            self._decode_coeffs[num_decode] = coeffs
        return coeffs

    def _grow(self, seq: SimSeq) -> None:
        """Raise a running request's counted KV as it outgrows its reserve (a pure function
        of its output so far: skipping and stepping agree)."""
        reserve = self._reserve
        grown = reserve.grown(seq.committed, seq.kv_limit, seq.prompt_len, seq.num_output)
        self._committed_tokens += grown - seq.committed
        seq.committed = grown
        seq.grow_at = reserve.next_growth_at(grown, seq.kv_limit, seq.prompt_len)

    def _finish(self, seq: SimSeq, now: float) -> None:
        self._running.remove(seq)
        self._in_running[seq.bucket] -= 1
        self._reserve.observe(seq.bucket, seq.num_output)
        self._free_blocks = self._release(seq, self._free_blocks)
        seq.blocks = 0
        self._unfinished[seq.bucket] -= 1
        self._committed_tokens -= seq.committed
        tpot = (now - seq.first_token_s) / (seq.num_output - 1) if seq.num_output > 1 else 0.0
        # positional (the field order of FinishedRequest): one per request, on the hot path
        self._finished.append(FinishedRequest(
            seq.request_id, seq.bucket, self.pool, seq.arrival_s, seq.prompt_len,
            seq.num_output, seq.first_token_s - seq.arrival_s, tpot, now - seq.arrival_s,
            now, seq.preemptions, seq.truncated))

    def _note_usage(self) -> None:
        used = self.num_kv_blocks - self._free_blocks
        if used > self._peak_used_blocks:
            self._peak_used_blocks = used
