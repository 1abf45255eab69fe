"""What one live engine iteration holds: the scheduler probe, vLLM's stats, the record.

The scheduler probe and the stat logger feed :class:`~rlbatch.engine.vllm.engine.VllmEngine`;
:class:`IterationRecord` is what calibration fits on.

:class:`SchedulerProbe` wraps the scheduler's ``schedule`` output: it reads each scheduled
request's context before the chunk, so every iteration's prefill tokens, causal attention
work, decoding sequences and decode KV tokens are known exactly as the simulator's
:class:`~rlbatch.profiles.StepTimeModel` sees them; it also sees preemptions
(``preempted_req_ids``) and the tokens they throw away. :class:`StatCollector` is the stat
logger handed to vLLM (``SchedulerStats``: KV usage; ``IterationStats``: preemptions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["IterationRecord", "SchedulerProbe", "StatCollector"]


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
    """

    prev_end_s: float
    start_s: float
    end_s: float
    num_prefill_tokens: int
    prefill_attn_work: float
    num_decode_seqs: int
    decode_kv_tokens: int
    preempted: int


@dataclass
class SchedulerProbe:
    """What the wrapped ``Scheduler.schedule`` saw in the latest call."""

    scheduled: bool = False
    prefill_tokens: int = 0
    attn_work: float = 0.0
    num_decode: int = 0
    kv_decode: int = 0
    first_token_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    recomputed_tokens: int = 0
    computed: dict[str, int] = field(default_factory=dict)

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
        self.first_token_ids = []
        self.recomputed_tokens = 0
        preempted = getattr(out, "preempted_req_ids", None) or ()
        self.preempted_ids = list(preempted)
        for rid in self.preempted_ids:
            self.recomputed_tokens += self.computed.pop(rid, 0)
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
            if n == 1 and before > 0 and total - before == 1:
                self.num_decode += 1
                self.kv_decode += before + 1
            else:
                self.prefill_tokens += n
                self.attn_work += n * (before + (n + 1) / 2)
                if after >= total and int(req.num_output_tokens) == 0:
                    self.first_token_ids.append(rid)

    def forget(self, rid: str) -> None:
        """Drop a finished request's context.

        :param rid: vLLM request id.
        """
        self.computed.pop(rid, None)

    def clear_step(self) -> None:
        """Forget the latest iteration's events once the engine has consumed them."""
        self.scheduled = False
        self.first_token_ids = []
        self.preempted_ids = []
        self.recomputed_tokens = 0


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

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            usage = float(scheduler_stats.kv_cache_usage)
            self.kv_cache_usage = usage
            self.kv_cache_usage_peak = max(self.kv_cache_usage_peak, usage)
            self.num_running = int(scheduler_stats.num_running_reqs)
            self.num_waiting = int(scheduler_stats.num_waiting_reqs)
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
