"""What one live engine iteration holds: the scheduler probe, vLLM's stats, the record.

The scheduler probe and the stat logger feed :class:`~rlbatch.engine.vllm.engine.VllmEngine`;
:class:`IterationRecord` is what calibration fits on.

:class:`SchedulerProbe` wraps the scheduler's ``schedule`` output: it reads each scheduled
request's context before the chunk, so every iteration's prefill tokens, causal attention
work, decoding sequences and decode KV tokens are known exactly as the simulator's
:class:`~rlbatch.profiles.StepTimeModel` sees them; it also sees preemptions
(``preempted_req_ids``) and the tokens they throw away. :class:`StepTimer` splits each
iteration's wall time into vLLM's own phases (schedule, model forward with sampling, output
update), so calibration can tell the model's cost from the engine's per-request bookkeeping.
:class:`StatCollector` is the stat logger handed to vLLM (``SchedulerStats``: KV usage;
``IterationStats``: preemptions).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IterationRecord", "SchedulerProbe", "StatCollector", "StepTimer"]


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One engine iteration as the step-time model sees it (calibration input).

    :param prev_end_s: engine clock at the end of the engine's previous action (iteration
        or idle wait): the simulator's iteration starts there, so ``end_s - prev_end_s`` is
        the iteration's duration as the simulator must reproduce it (admission and
        rlbatch's loop included).
    :param start_s: engine clock when ``LLMEngine.step()`` was called.
    :param end_s: engine clock when the step (and rlbatch's bookkeeping of it) ended.
    :param num_prefill_tokens: prompt (or recomputed) tokens scheduled.
    :param prefill_attn_work: causal attention work of those chunks, token pairs.
    :param num_decode_seqs: sequences decoding one token.
    :param decode_kv_tokens: context the decoding sequences attend to.
    :param preempted: requests preempted while scheduling this iteration.
    :param num_prefill_seqs: requests holding a prefill chunk (each is a row of the batch's
        metadata and gets its logits computed, as a decode does).
    :param num_new_seqs: requests scheduled for the first time (or again after a preemption):
        vLLM builds their state in the model runner this iteration, and rlbatch admitted
        them (``add_request``) since the previous iteration.
    :param num_finished: requests that finished in this iteration (output processing and
        rlbatch's record of them, after their finish time but before ``end_s``).
    :param idle_s: how long the engine held no request before the iteration that started
        its current busy period (the wake-up: its working set left the CPU caches meanwhile).
    :param since_wake: iterations since that one (0: this iteration woke the engine).
    :param shape_distance: how many other token counts (prefill tokens + decodes) the engine
        ran since it last ran this iteration's (-1: never). vLLM's CPU backend builds oneDNN
        matmul primitives per row count (a JIT compile, milliseconds) and keeps the recently
        used ones (an LRU of a few hundred counts), so a count not run recently costs that
        again.
    :param schedule_s: wall time in vLLM's ``Scheduler.schedule`` (NaN: not measured).
    :param forward_s: wall time in the executor's ``execute_model`` and ``sample_tokens``:
        the model forward pass and sampling.
    :param update_s: wall time in ``Scheduler.update_from_output``.
    :param cpu_s: CPU time of the engine's thread over the iteration (``time.thread_time``
        from ``prev_end_s`` to ``end_s``): what is left of the duration is time the thread
        waited for a CPU other processes held.
    """

    prev_end_s: float
    start_s: float
    end_s: float
    num_prefill_tokens: int
    prefill_attn_work: float
    num_decode_seqs: int
    decode_kv_tokens: int
    preempted: int
    num_prefill_seqs: int = 0
    num_new_seqs: int = 0
    num_finished: int = 0
    idle_s: float = 0.0
    since_wake: int = 0
    shape_distance: int = 0
    schedule_s: float = math.nan
    forward_s: float = math.nan
    update_s: float = math.nan
    cpu_s: float = math.nan

    @property
    def duration_s(self) -> float:
        """The iteration as the simulator must reproduce it: end of the previous action to
        the end of this one."""
        return self.end_s - self.prev_end_s


@dataclass
class SchedulerProbe:
    """What the wrapped ``Scheduler.schedule`` saw in the latest call, and per request
    inside the engine: its context (``computed``), where the prefill of its current
    admission ends (``prefill_end``: its tokens when first scheduled since it was admitted
    or resumed) and the prefill tokens computed for it so far (``prefilled``: recomputes
    after preemption included, prefix-cache hits excluded; what an abort reports).
    """

    scheduled: bool = False
    prefill_tokens: int = 0
    attn_work: float = 0.0
    num_decode: int = 0
    kv_decode: int = 0
    prefill_seqs: int = 0
    new_seqs: int = 0
    first_token_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    recomputed_tokens: int = 0
    computed: dict[str, int] = field(default_factory=dict)
    prefill_end: dict[str, int] = field(default_factory=dict)
    prefilled: dict[str, int] = field(default_factory=dict)

    def observe(self, out: Any, requests: Any) -> None:
        """Read one ``schedule()`` result.

        :param out: vLLM's ``SchedulerOutput``.
        :param requests: the scheduler's ``requests`` map (id -> ``Request``), read after
            scheduling (``num_computed_tokens`` already includes the chunk).
        """
        self.prefill_tokens = 0
        self.attn_work = 0.0
        self.num_decode = 0
        self.kv_decode = 0
        self.prefill_seqs = 0
        # first chunks: new requests, and preempted ones scheduled again (the simulator
        # admits both from its waiting queue)
        cached = getattr(out, "scheduled_cached_reqs", None)
        self.new_seqs = len(getattr(out, "scheduled_new_reqs", ()) or ()) + len(
            getattr(cached, "resumed_req_ids", ()) or ())
        self.first_token_ids = []
        self.recomputed_tokens = 0
        preempted = getattr(out, "preempted_req_ids", None) or ()
        self.preempted_ids = list(preempted)
        prefill_end = self.prefill_end
        for rid in self.preempted_ids:
            self.recomputed_tokens += self.computed.pop(rid, 0)
            prefill_end.pop(rid, None)  # resumed later with its output so far to prefill
        scheduled: dict[str, int] = out.num_scheduled_tokens
        self.scheduled = bool(out.total_num_scheduled_tokens > 0)
        computed = self.computed
        for rid, n in scheduled.items():
            req = requests.get(rid)
            if req is None:
                continue
            after = int(req.num_computed_tokens)
            before = after - n
            total = int(req.num_tokens)
            computed[rid] = after
            end = prefill_end.get(rid)
            if end is None:  # its first chunk since it was admitted or resumed
                end = prefill_end[rid] = total
            if before < end:
                self.prefilled[rid] = self.prefilled.get(rid, 0) + min(after, end) - before
            if n == 1 and before > 0 and total - before == 1:
                self.num_decode += 1
                self.kv_decode += before + 1
            else:
                self.prefill_seqs += 1
                self.prefill_tokens += n
                self.attn_work += n * (before + (n + 1) / 2)
                if after >= total and int(req.num_output_tokens) == 0:
                    self.first_token_ids.append(rid)

    def forget(self, rid: str) -> None:
        """Drop a finished (or aborted) request's context and counts.

        :param rid: vLLM request id.
        """
        self.computed.pop(rid, None)
        self.prefill_end.pop(rid, None)
        self.prefilled.pop(rid, None)

    def clear_step(self) -> None:
        """Forget the latest iteration's events once the engine has consumed them."""
        self.scheduled = False
        self.first_token_ids = []
        self.preempted_ids = []
        self.recomputed_tokens = 0


class StepTimer:
    """Wall time of vLLM's phases within one ``LLMEngine.step()``: wraps the scheduler's
    ``schedule`` and ``update_from_output`` and the executor's ``execute_model`` and
    ``sample_tokens`` (two ``perf_counter`` calls each). Read, then :meth:`clear` per step.
    """

    def __init__(self) -> None:
        self.schedule_s = 0.0
        self.forward_s = 0.0
        self.update_s = 0.0

    def clear(self) -> None:
        """Start the next step's split."""
        self.schedule_s = 0.0
        self.forward_s = 0.0
        self.update_s = 0.0

    def wrap(self, owner: Any, method: str, phase: str) -> None:
        """Replace ``owner.method`` by a timed call that adds to ``phase``'s counter.

        :param owner: the vLLM object (scheduler or executor).
        :param method: its method's name.
        :param phase: ``schedule``, ``forward`` or ``update``.
        """
        if phase not in ("schedule", "forward", "update"):
            raise ValueError(f"unknown phase {phase!r}")
        original: Callable[..., Any] = getattr(owner, method)
        attr = f"{phase}_s"
        timer = self
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(timer, attr, getattr(timer, attr) + clock() - t0)

        setattr(owner, method, timed)


class StatCollector:
    """A vLLM stat logger (duck-typed ``StatLoggerBase``) that keeps what rlbatch reads."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.kv_cache_usage_peak = 0.0
        self.num_running = 0
        self.num_waiting = 0
        self.preemptions = 0
        self.kv_overflows = 0
        self.generation_tokens = 0
        # prefix cache, since the engine started (first lookups; vLLM counts preempted
        # requests' lookups apart): prompt tokens looked up, tokens found cached
        self.prefix_queries = 0
        self.prefix_hits = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            usage = float(scheduler_stats.kv_cache_usage)
            self.kv_cache_usage = usage
            self.kv_cache_usage_peak = max(self.kv_cache_usage_peak, usage)
            self.num_running = int(scheduler_stats.num_running_reqs)
            self.num_waiting = int(scheduler_stats.num_waiting_reqs)
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                self.prefix_queries += int(prefix.queries)
                self.prefix_hits += int(prefix.hits)
        if iteration_stats is not None:
            preempted = int(iteration_stats.num_preempted_reqs)
            self.preemptions += preempted
            self.kv_overflows += 1 if preempted else 0
            self.generation_tokens += int(iteration_stats.num_generation_tokens)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def take_interval(self) -> tuple[int, int, float]:
        """Preemptions, KV-overflow iterations and peak usage since the last call."""
        out = (self.preemptions, self.kv_overflows, self.kv_cache_usage_peak)
        self.preemptions = 0
        self.kv_overflows = 0
        self.generation_tokens = 0
        self.kv_cache_usage_peak = self.kv_cache_usage
        return out


def stack_distance(order: OrderedDict[int, None], size: int) -> int:
    """Distinct sizes run since ``size`` was last run (0: it was the last one; -1: never),
    and ``size`` becomes the most recent."""
    if size not in order:
        order[size] = None
        return -1
    distance = 0
    for key in reversed(order):
        if key == size:
            break
        distance += 1
    order.move_to_end(size)
    return distance
