"""The simulated engine's scheduler, request by request: vLLM V1's ``schedule()``.

:class:`ExactScheduler` holds a simulated engine's requests, KV blocks, clock and interval
counters, and runs one iteration the way vLLM V1 does (``v1/core/sched/scheduler.py``, FCFS;
the rules are listed in :mod:`rlbatch.engine.sim`): every running request in order, then
admissions from the waiting queue, within the token budget, preempting the newest running
request when a block allocation fails. This is the reference every faster path is held to
(:class:`~rlbatch.engine.sim_scheduler.SimScheduler` adds those, bit-identical).

What happens to a request's KV blocks in the prefix cache and the host tier (lookups at
admission, hashes as blocks fill, loads from the host, release) lives in its base,
:class:`~rlbatch.engine.sim_caches.CacheScheduler`; with the host tier, a request waiting for
a copy from the host sits in the *loading* list, which joins the running list ahead of the
waiting queue once its copy completed, and an engine with nothing else to run waits for it.

A step-time model with :class:`~rlbatch.profiles.overheads.EngineOverheads` (a calibrated
profile; the roofline GPU models have none, and their iterations are untouched) adds them to
each iteration in :meth:`ExactScheduler._advance`: per request admitted, the finished
requests' processing in the iteration after, the wake-up penalty of the iterations after an
idle wait (:meth:`ExactScheduler._note_idle`) and a token count not run recently. Decode
runs are skipped in closed form only when none of these is pending (the first iteration after
a completion never is skipped, and the decode runs wait for the wake-up iterations to pass
and for their size to be cached; a skipped run marks its size as just run).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.host_tier import HostLink
from rlbatch.engine.reserve import OutputReserve, shift_trigger
from rlbatch.engine.sim_caches import CacheScheduler
from rlbatch.engine.sim_seq import SimSeq
from rlbatch.engine.stats import AbortedRequest, FinishedRequest
from rlbatch.profiles import StepTimeModel


class ExactScheduler(CacheScheduler):
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
    :param host_link: the host tier's block bytes and copy time, needed when
        ``config.kv_offload_gib > 0``.
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
    _aborted: list[AbortedRequest]

    def __init__(self, pool: str, config: EngineConfig, step_model: StepTimeModel,
                 num_kv_blocks: int, num_buckets: int, max_model_len: int, *,
                 event_skipping: bool, start_s: float,
                 host_link: HostLink | None = None) -> None:
        super().__init__(config, host_link)
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
        # Bumped by everything that can lower the KV budget's peak projection (an admission,
        # a finish, an iteration that is not pure decode): between two bumps only pure-decode
        # iterations ran and counts grew, which never lower it (rlbatch.engine.reserve), so
        # SimEngine.kv_budget_exceeded may reuse a figure over the budget.
        self._kv_version = 0
        self._reserve = OutputReserve(config.kv_reserve, num_buckets, config.block_size,
                                      max_model_len, quantile=config.kv_reserve_quantile,
                                      shift_trigger=shift_trigger(config.kv_reserve_shift))
        self._decode_coeffs: dict[int, tuple[float, float]] = {}
        # engine overheads (calibrated profiles only): the finished requests' processing due
        # in the next iteration, the idle time before it (an engine starts cold), the wake-up
        # penalty's scale and the iterations of it left
        self._overheads = step_model.overheads()
        self._carry_s = 0.0
        self._idle_s = math.inf if self._overheads is not None else 0.0
        self._wake_scale = 0.0
        self._wake_k = 0
        self._wake_left = 0
        # token counts run, least recently first (the engine's matmul primitive cache)
        self._shapes: OrderedDict[int, None] | None = (
            OrderedDict() if self._overheads is not None and self._overheads.tracks_shapes
            else None)
        self._ever: set[int] = set()  # every token count run (the cache drops some)

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
    def _iterate_exact(self, bound_s: float) -> None:
        """One iteration, request by request (vLLM V1's ``schedule()`` order); with nothing
        to run but copies from the host tier, a wait for the first one (at most to
        ``bound_s``)."""
        self._kv_version += 1
        if self._aborted_loads:
            self._free_aborted_loads()
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
                    if victim.num_computed < victim.prefill_end:  # its prefill cut short
                        victim.prefilled -= victim.prefill_end - victim.num_computed
                    victim.prefill_end = 0
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
                self._register(seq, seq.num_computed + n, free)
            if remaining == 1 and seq.num_computed > 0:
                num_decode += 1
                kv_decode += seq.num_computed + 1
            else:
                prefill_tokens += n
                attn_work += n * (seq.num_computed + (n + 1) / 2)
            budget -= n
            i += 1

        scheduled = len(sched)
        if not preempted:
            budget, free, prefill_tokens, attn_work = self._admit_waiting(
                sched, None, budget, free, prefill_tokens, attn_work)

        self._free_blocks = free
        if not sched:
            # Everything was preempted (the next iteration re-admits from the waiting queue),
            # or nothing is running or admissible.
            if not preempted and (self._loading or self._aborted_loads):
                self._wait_for_loads(bound_s)
            return
        now = self._advance(prefill_tokens, attn_work, num_decode, kv_decode,
                            len(sched) - scheduled)
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
        if self._loading:
            budget, free, prefill_tokens, attn_work, blocked = self._promote_loaded(
                sched, admitted, budget, free, prefill_tokens, attn_work)
            if blocked:  # a loaded request's first chunk does not fit: admission stops
                return budget, free, prefill_tokens, attn_work
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
            # the prefill this admission is to compute (its hit or copy excluded)
            end = seq.prompt_len + seq.num_output
            seq.prefilled += end - seq.num_computed
            seq.prefill_end = end
            if cache is not None and not seq.preemptions:
                cache.queries += seq.prompt_len  # vLLM counts first lookups apart
            if n < 0:  # its prefix is copied from the host tier first
                self._loading.append(seq)
                continue
            self._start(seq, n, sched, admitted, free)
            prefill_tokens += n
            attn_work += n * (seq.num_computed + (n + 1) / 2)
            budget -= n
        return budget, free, prefill_tokens, attn_work

    def _advance(self, prefill_tokens: int, attn_work: float, num_decode: int,
                 kv_decode: int, num_new: int = 0) -> float:
        """Run the clock over one iteration of that composition (``num_new`` requests
        admitted in it); the new time."""
        if prefill_tokens == 0:
            base, per_kv = self._coefficients(num_decode)
            dt = base + per_kv * kv_decode
        else:
            dt = self.step_model.step_time_s(prefill_tokens, attn_work, num_decode, kv_decode)
        if self._overheads is not None:
            dt += self._overhead_s(num_new, prefill_tokens + num_decode)
        self._last_start = self._now
        self._now += dt
        self._busy_s += dt
        self._iterations += 1
        self._prefill_tokens += prefill_tokens
        self._decode_tokens += num_decode
        return self._now

    def _overhead_s(self, num_new: int, tokens: int) -> float:
        """The engine overheads of the iteration being run (calibrated profiles)."""
        oh = self._overheads
        assert oh is not None
        extra = oh.per_new_seq_s * num_new + self._carry_s
        self._carry_s = 0.0
        shapes = self._shapes
        if shapes is not None:
            if tokens in shapes:
                shapes.move_to_end(tokens)
            else:
                self._run_shape(tokens)
                extra += oh.new_shape_s + oh.new_shape_per_token_s * tokens
                if tokens not in self._ever:
                    self._ever.add(tokens)
                    extra += oh.first_shape_s
        if self._idle_s > 0.0:  # the first iteration after an idle wait
            if oh.wake:
                self._wake_scale = 1.0 - math.exp(-self._idle_s / oh.wake_tau_s)
                self._wake_k = 0
                self._wake_left = len(oh.wake)
            self._idle_s = 0.0
        if self._wake_left:
            extra += self._wake_scale * oh.wake[self._wake_k]
            self._wake_k += 1
            self._wake_left -= 1
        return extra

    def _run_shape(self, tokens: int) -> None:
        """``tokens`` becomes the most recently run size (the least recent one dropped when the
        cache is full)."""
        shapes = self._shapes
        assert shapes is not None and self._overheads is not None
        if tokens in shapes:
            shapes.move_to_end(tokens)
            return
        shapes[tokens] = None
        if 0 < self._overheads.shape_cache < len(shapes):
            shapes.popitem(last=False)

    def assume_token_counts(self, counts: Sequence[int]) -> None:
        """Start as an engine that has run iterations of these sizes already, least recently
        first (a live engine's :meth:`~rlbatch.engine.vllm.engine.VllmEngine.token_counts`,
        to replay from its state); nothing without new-size costs.

        :param counts: token counts of iterations run, least recently run first.
        """
        if self._shapes is not None:
            for tokens in counts:
                self._run_shape(tokens)
            self._ever.update(counts)

    def _note_idle(self, idle_s: float) -> None:
        """The engine waited ``idle_s`` seconds with nothing to do: the next iteration wakes
        it (the wait absorbs the finished requests' processing due)."""
        if self._overheads is not None and idle_s > 0.0:
            self._idle_s += idle_s
            self._carry_s = max(0.0, self._carry_s - idle_s)

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
        if self._overheads is not None:
            self._carry_s += self._overheads.per_finished_s
        self._kv_version += 1
        self._running.remove(seq)
        self._in_running[seq.bucket] -= 1
        self._reserve.observe(seq.bucket, seq.num_output)
        if self._host is not None and seq.host_low >= 0:
            assert seq.layout is not None
            self._host.finish(seq.layout, seq.host_low, seq.host_done)
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

    # ----------------------------------------------------------------- aborts
    def _locate(self, request_id: int) -> tuple[SimSeq, str] | None:
        """The request ``request_id`` inside the engine and where it is (``running``,
        ``loading`` or ``waiting``); ``None`` when the engine does not hold it. O(requests)."""
        for where, queue in (("running", self._running), ("loading", self._loading),
                             ("waiting", self._waiting)):
            for seq in queue:
                if seq.request_id == request_id:
                    return seq, where
        return None

    def _drop_running(self, seq: SimSeq) -> None:
        """An aborted running request leaves the running list; its blocks return as a
        finished request's do (cached ones stay cached, evictable)."""
        self._running.remove(seq)
        self._in_running[seq.bucket] -= 1
        self._free_blocks = self._release(seq, self._free_blocks)
        seq.blocks = 0

    def _withdraw(self, seq: SimSeq, where: str) -> AbortedRequest:
        """Take an aborted request out of the engine (``where`` from :meth:`_locate`): its
        queue, its blocks, its counts; the record of it (also kept for the snapshot)."""
        if where == "running":
            self._drop_running(seq)  # a subclass takes it out of the decode lane first
        elif where == "loading":
            self._drop_loading(seq)
        else:
            self._waiting.remove(seq)
        self._kv_version += 1
        if self._host is not None and seq.host_low >= 0:
            assert seq.layout is not None
            self._host.finish(seq.layout, seq.host_low, seq.host_done)  # as vLLM's finish
        self._unfinished[seq.bucket] -= 1
        self._committed_tokens -= seq.committed
        # Its output is cut short: not an observation of the output lengths (the reserve).
        # No engine overhead either: vLLM takes an abort from its input queue between steps,
        # not in an iteration's output processing (a finished request's per_finished_s).
        unfinished = seq.prefill_end - seq.num_computed
        record = AbortedRequest(
            seq.request_id, seq.bucket, self.pool, seq.arrival_s, self._now,
            seq.prefilled - unfinished if unfinished > 0 else seq.prefilled,
            seq.num_output, seq.first_token_s >= 0.0)
        self._aborted.append(record)
        return record

    def _note_usage(self) -> None:
        used = self.num_kv_blocks - self._free_blocks
        if used > self._peak_used_blocks:
            self._peak_used_blocks = used
