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
* a waiting request is admitted only if its first chunk's blocks are free.

Event skipping: after an iteration in which every running request decoded one token and
nothing else happened, the following iterations have the same composition until a request
finishes, a block allocation would fail, or the clock passes ``bound_s`` (next arrival or
control tick). Those iterations are advanced in one go; the clock accumulates exactly the same
floating-point sums as stepping one by one, so both give identical request timings.
"""

from __future__ import annotations

from collections import deque

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.fork import fork_state
from rlbatch.engine.reserve import OutputReserve
from rlbatch.engine.stats import EngineStats, FinishedRequest
from rlbatch.profiles import StepTimeModel
from rlbatch.request import Request


class _Seq:
    """Mutable scheduler state of one request inside the engine."""

    __slots__ = (
        "arrival_s",
        "blocks",
        "bucket",
        "committed",
        "first_token_s",
        "grow_at",
        "kv_limit",
        "max_output",
        "num_computed",
        "num_output",
        "preemptions",
        "prompt_len",
        "request_id",
        "truncated",
    )

    def __init__(self, request: Request, bucket: int, prompt_len: int, truncated: bool) -> None:
        self.request_id = request.request_id
        self.arrival_s = request.arrival_s
        self.bucket = bucket
        self.prompt_len = prompt_len
        self.max_output = request.max_output_tokens
        self.truncated = truncated
        self.num_output = 0
        self.num_computed = 0
        self.blocks = 0
        self.first_token_s = -1.0
        self.preemptions = 0
        # KV the admission budget counts (rlbatch.engine.reserve), its ceiling, and the
        # output count at which the count grows next.
        self.committed = 0
        self.kv_limit = 0
        self.grow_at = 0


class SimEngine:
    """One simulated vLLM V1 engine.

    :param engine_id: index in the deployment.
    :param pool: pool name (``fp16`` / ``fp8``).
    :param config: scheduler and cache settings.
    :param step_model: step-time model for this engine's GPU, model and precision.
    :param num_kv_blocks: KV blocks in the pool.
    :param max_model_len: longest sequence (prompt + output) accepted.
    :param gpu_memory_total_bytes: memory of one GPU.
    :param num_buckets: number of prompt-length buckets (for per-bucket counts).
    :param event_skipping: advance runs of pure-decode iterations in one go (identical result).
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
    ) -> None:
        if num_kv_blocks * config.block_size < max_model_len:
            raise ValueError(
                f"engine {engine_id} ({pool}): the KV cache holds {num_kv_blocks} blocks x "
                f"{config.block_size} = {num_kv_blocks * config.block_size} tokens, fewer than "
                f"max_model_len={max_model_len}; lower max_model_len or raise "
                f"gpu_memory_utilization")
        self.engine_id = engine_id
        self.pool = pool
        self.config = config
        self.step_model = step_model
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.gpu_memory_total_bytes = gpu_memory_total_bytes
        self.num_buckets = num_buckets
        self.event_skipping = event_skipping
        self._block_size = config.block_size
        self._budget = config.max_num_batched_tokens
        self._max_num_seqs = config.max_num_seqs
        self._now = start_s
        self._free_blocks = num_kv_blocks
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._unfinished = [0] * num_buckets
        self._committed_tokens = 0
        self._reserve = OutputReserve(config.kv_reserve, num_buckets, config.block_size,
                                      max_model_len, quantile=config.kv_reserve_quantile)
        self._decode_coeffs: dict[int, tuple[float, float]] = {}
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
        return len(self._running) + len(self._waiting)

    def num_waiting(self, bucket: int) -> int:
        # The running list is bounded by max_num_seqs; the waiting queue is not.
        return self._unfinished[bucket] - sum(1 for s in self._running if s.bucket == bucket)

    def committed_tokens(self) -> int:
        return self._committed_tokens

    def kv_tokens_to_admit(self, request: Request, bucket: int, prompt_tokens: int) -> int:
        return self._reserve.at_admission(request, bucket, prompt_tokens)

    @property
    def kv_block_size(self) -> int:
        return self._block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self._block_size

    def is_idle(self) -> bool:
        return not self._running and not self._waiting

    def advance_idle(self, to_s: float) -> None:
        if not self.is_idle():
            raise RuntimeError("advance_idle called on a busy engine")
        if to_s > self._now:
            self._now = to_s

    def add_request(self, request: Request, bucket: int, prompt_tokens: int,
                    truncated: bool) -> None:
        if prompt_tokens + request.max_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt {prompt_tokens} + output "
                f"{request.max_output_tokens} exceeds max_model_len {self.max_model_len}")
        seq = _Seq(request, bucket, prompt_tokens, truncated)
        reserve = self._reserve
        seq.kv_limit = reserve.limit_tokens(request, prompt_tokens)
        seq.committed = reserve.within(seq.kv_limit, bucket, prompt_tokens)
        seq.grow_at = reserve.next_growth_at(seq.committed, seq.kv_limit, prompt_tokens)
        self._waiting.append(seq)
        self._unfinished[bucket] += 1
        self._committed_tokens += seq.committed

    def fork(self) -> SimEngine:
        """An independent copy of the engine's state (a digital twin's fork): the step-time
        model and config shared, every sequence and counter copied (see
        :func:`~rlbatch.engine.fork.fork_state`)."""
        new = fork_state(self, _Seq, share=("_reserve",))
        new._reserve = self._reserve.fork()
        return new

    def pending(self) -> list[tuple[int, float, float, int, int]]:
        """Requests inside the engine (running, then waiting) as ``(bucket, arrival_s,
        first_token_s, num_output, max_output)``; ``first_token_s`` is -1 before the first
        token. What a twin's rollout scores at its horizon."""
        return [(s.bucket, s.arrival_s, s.first_token_s, s.num_output, s.max_output)
                for q in (self._running, self._waiting) for s in q]

    # ----------------------------------------------------------------- scheduling
    def step(self, bound_s: float) -> None:
        running = self._running
        waiting = self._waiting
        block = self._block_size
        budget = self._budget
        free = self._free_blocks
        sched: list[tuple[_Seq, int]] = []
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
                    free += victim.blocks
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
            if remaining == 1 and seq.num_computed > 0:
                num_decode += 1
                kv_decode += seq.num_computed + 1
            else:
                prefill_tokens += n
                attn_work += n * (seq.num_computed + (n + 1) / 2)
            budget -= n
            i += 1
        all_running_scheduled = i == len(running)

        if not preempted:
            while waiting and budget > 0 and len(running) < self._max_num_seqs:
                seq = waiting[0]
                remaining = seq.prompt_len + seq.num_output - seq.num_computed
                n = remaining if remaining < budget else budget
                need = -(-(seq.num_computed + n) // block) - seq.blocks
                if need > free:
                    break
                waiting.popleft()
                free -= need
                seq.blocks += need
                running.append(seq)
                sched.append((seq, n))
                prefill_tokens += n
                attn_work += n * (seq.num_computed + (n + 1) / 2)
                budget -= n

        self._free_blocks = free
        if not sched:
            # Everything was preempted; the next iteration re-admits from the waiting queue.
            return

        if prefill_tokens == 0:
            base, per_kv = self._coefficients(num_decode)
            dt = base + per_kv * kv_decode
        else:
            dt = self.step_model.step_time_s(prefill_tokens, attn_work, num_decode, kv_decode)
        self._now += dt
        self._busy_s += dt
        self._iterations += 1
        self._prefill_tokens += prefill_tokens
        self._decode_tokens += num_decode

        now = self._now
        finished_any = False
        for seq, n in sched:
            seq.num_computed += n
            if seq.num_computed == seq.prompt_len + seq.num_output:
                seq.num_output += 1
                if seq.first_token_s < 0.0:
                    seq.first_token_s = now
                    self._first_tokens.append((seq.request_id, now))
                if seq.num_output >= seq.max_output:
                    self._finish(seq, now)
                    finished_any = True
                elif seq.num_output >= seq.grow_at:
                    self._grow(seq)
        self._note_usage()

        if (self.event_skipping and prefill_tokens == 0 and not preempted
                and all_running_scheduled and not finished_any and now < bound_s):
            self._skip_decodes(bound_s)

    def _skip_decodes(self, bound_s: float) -> None:
        """Advance the pure-decode iterations that follow, up to (not including) the first one
        in which a request finishes, a block allocation could fail, or that starts at or after
        ``bound_s``."""
        running = self._running
        n = len(running)
        if n > self._budget:
            return
        steps_cap = min(seq.max_output - seq.num_output for seq in running) - 1
        if steps_cap <= 0:
            return
        block = self._block_size
        free = self._free_blocks
        if free < n * -(-steps_cap // block):
            steps_cap = self._max_steps_within_blocks(steps_cap, free)
            if steps_cap <= 0:
                return
        base, per_kv = self._coefficients(n)
        kv = n
        for seq in running:
            kv += seq.num_computed
        now = self._now
        busy = self._busy_s
        k = 0
        while k < steps_cap and now < bound_s:
            dt = base + per_kv * kv
            now += dt
            busy += dt
            kv += n
            k += 1
        if k == 0:
            return
        self._now = now
        self._busy_s = busy
        self._iterations += k
        self._decode_tokens += n * k
        for seq in running:
            seq.num_computed += k
            seq.num_output += k
            blocks = -(-seq.num_computed // block)
            free -= blocks - seq.blocks
            seq.blocks = blocks
            if seq.num_output >= seq.grow_at:
                self._grow(seq)
        self._free_blocks = free
        self._note_usage()

    def _max_steps_within_blocks(self, steps_cap: int, free: int) -> int:
        """Largest k <= steps_cap whose k decode steps need at most ``free`` new blocks."""
        block = self._block_size
        computed = [seq.num_computed for seq in self._running]

        def need(k: int) -> int:
            return sum(-(-(c + k) // block) - -(-c // block) for c in computed)

        lo, hi = 0, steps_cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _coefficients(self, num_decode: int) -> tuple[float, float]:
        coeffs = self._decode_coeffs.get(num_decode)
        if coeffs is None:
            coeffs = self.step_model.decode_coefficients(num_decode)
            self._decode_coeffs[num_decode] = coeffs
        return coeffs

    def _grow(self, seq: _Seq) -> None:
        """Raise a running request's counted KV as it outgrows its reserve (a pure function
        of its output so far: skipping and stepping agree)."""
        reserve = self._reserve
        grown = reserve.grown(seq.committed, seq.kv_limit, seq.prompt_len, seq.num_output)
        self._committed_tokens += grown - seq.committed
        seq.committed = grown
        seq.grow_at = reserve.next_growth_at(grown, seq.kv_limit, seq.prompt_len)

    def _finish(self, seq: _Seq, now: float) -> None:
        self._running.remove(seq)
        self._reserve.observe(seq.bucket, seq.num_output)
        self._free_blocks += seq.blocks
        seq.blocks = 0
        self._unfinished[seq.bucket] -= 1
        self._committed_tokens -= seq.committed
        tpot = (now - seq.first_token_s) / (seq.num_output - 1) if seq.num_output > 1 else 0.0
        self._finished.append(FinishedRequest(
            request_id=seq.request_id,
            bucket=seq.bucket,
            pool=self.pool,
            arrival_s=seq.arrival_s,
            prompt_tokens=seq.prompt_len,
            output_tokens=seq.num_output,
            ttft_s=seq.first_token_s - seq.arrival_s,
            tpot_s=tpot,
            e2e_s=now - seq.arrival_s,
            finish_s=now,
            preemptions=seq.preemptions,
            truncated=seq.truncated,
        ))

    def _note_usage(self) -> None:
        used = self.num_kv_blocks - self._free_blocks
        if used > self._peak_used_blocks:
            self._peak_used_blocks = used

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

    def snapshot(self) -> EngineStats:
        running = [0] * self.num_buckets
        for seq in self._running:
            running[seq.bucket] += 1
        # The waiting queue can hold thousands under overload: derive its counts instead.
        waiting = [u - r for u, r in zip(self._unfinished, running, strict=True)]
        used = self.num_kv_blocks - self._free_blocks
        self.check_invariants()
        stats = EngineStats(
            engine_id=self.engine_id,
            pool=self.pool,
            start_s=self._interval_start,
            time_s=self._now,
            running=tuple(running),
            waiting=tuple(waiting),
            kv_cache_usage=used / self.num_kv_blocks,
            kv_cache_usage_peak=self._peak_used_blocks / self.num_kv_blocks,
            committed_tokens=self._committed_tokens,
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
        )
        self._reset_interval()
        return stats

    def check_invariants(self) -> None:
        """Internal consistency of the block accounting (cheap; called at every snapshot)."""
        held = sum(seq.blocks for seq in self._running)
        assert held + self._free_blocks == self.num_kv_blocks, (held, self._free_blocks)
        assert 0 <= self._free_blocks <= self.num_kv_blocks
        assert sum(self._unfinished) == len(self._running) + len(self._waiting)
        assert self._committed_tokens == sum(
            seq.committed for q in (self._running, self._waiting) for seq in q)
        assert all(seq.blocks == -(-seq.num_computed // self._block_size)
                   for seq in self._running)
