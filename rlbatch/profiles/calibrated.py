"""The calibrated step-time model of a live engine and its profile file (``--profile FILE``).

``rlbatch calibrate`` (:mod:`rlbatch.tools.calibrate`) measures a live vLLM engine and fits,
per pool, :class:`CalibratedStepTimeModel`:

    step = fixed + prefill_fixed * [prefill tokens > 0]
           + per_token * (prefill tokens + decoding sequences)
           + per_seq * sampled sequences (decodes, +1 when a prefill chunk is present)
           + per_attn_work * causal prefill attention work (token pairs)
           + (per_kv_token + per_kv_token_seq * decoding sequences) * decode KV tokens

plus the engine's overheads outside the forward pass (:class:`~rlbatch.profiles.step_time.
EngineOverheads`, measured per pool since profile version 3; the simulator adds them, see
:mod:`rlbatch.engine.sim_exact`):

    + per_new_seq * requests scheduled for the first time (``add_request``, the model
      runner's new request state)
    + per_finished * requests that finished in the previous iteration (output processing
      and rlbatch's bookkeeping, after their finish time; an idle wait absorbs it)
    + wake * (1 - exp(-idle / wake_tau)) * wake_decay ** k at the k-th iteration after the
      engine waited ``idle`` seconds with nothing to do (the engine's working set left the
      CPU caches while other processes ran: the first iterations after a wait run slower,
      :func:`wake_penalty_s`)
    + (new_shape + new_shape_per_token * tokens) * [the iteration's token count is not among
      the last ``shape_cache`` counts the engine ran] (vLLM's CPU backend builds oneDNN
      matmul primitives, a JIT compile, for each row count and keeps the recent ones)
    + first_shape * [the engine never ran that count] (the first build costs more)

with non-negative coefficients. A :class:`CalibratedProfile` holds each pool's coefficients,
KV block count and fit quality plus the engine's block size and budgets: everything the
simulator needs to stand in for the live engine (the simulated engines are built by
:func:`rlbatch.serving.builders.build_deployment` with ``DeploymentSpec(profile=FILE)``).
:func:`save_profile` / :func:`load_profile` are the JSON file format (``kind``
``rlbatch-step-profile``, version 3; versions 1 and 2, without the overheads, are still
read and simulate as before).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlbatch.profiles.overheads import (
    WAKE_FLOOR,
    EngineOverheads,
    WakeShape,
    shape_miss,
    wake_penalty_s,
)
from rlbatch.profiles.relative_error import RelativeErrors
from rlbatch.profiles.step_time import StepTimeModel

__all__ = [
    "PROFILE_KIND",
    "PROFILE_VERSION",
    "WAKE_FLOOR",
    "CalibratedProfile",
    "CalibratedStepTimeModel",
    "FitReport",
    "PoolProfile",
    "StepCoefficients",
    "WakeShape",
    "load_profile",
    "profile_from_dict",
    "save_profile",
    "shape_miss",
    "step_features",
    "wake_penalty_s",
]

PROFILE_KIND = "rlbatch-step-profile"
PROFILE_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)



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
    :param per_new_seq_s: per request scheduled for the first time (or again after a
        preemption): rlbatch's ``add_request`` and vLLM's input processing, the model
        runner's new request state.
    :param per_finished_s: per request finished in the previous iteration: vLLM's output
        processing and rlbatch's record of it, after the request's finish time.
    :param wake_s: extra time of the first iteration after a long idle wait (scaled by
        :class:`WakeShape` for shorter waits and later iterations).
    :param new_shape_s: extra time of an iteration whose token count the engine runs for the
        first time.
    :param new_shape_per_token_s: the same, per token of that count.
    :param first_shape_s: extra time when the engine runs that count for the first time (the
        first build of its primitives costs more than building them again after the cache
        dropped them).
    """

    fixed_s: float
    prefill_fixed_s: float
    per_token_s: float
    per_seq_s: float
    per_attn_work_s: float
    per_kv_token_s: float
    per_kv_token_seq_s: float = 0.0
    per_new_seq_s: float = 0.0
    per_finished_s: float = 0.0
    wake_s: float = 0.0
    new_shape_s: float = 0.0
    new_shape_per_token_s: float = 0.0
    first_shape_s: float = 0.0

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
        """The coefficients in field order (the fit's parameter vector)."""
        return [float(getattr(self, f.name)) for f in fields(self)]


def step_features(num_prefill_tokens: float, prefill_attn_work: float, num_decode_seqs: float,
                  decode_kv_tokens: float, num_new_seqs: float = 0.0,
                  num_finished: float = 0.0, wake: float = 0.0,
                  new_shape: bool = False, first_shape: bool = False) -> list[float]:
    """The model's regressors of one iteration, in :class:`StepCoefficients` field order.

    :param num_prefill_tokens: prompt tokens scheduled.
    :param prefill_attn_work: causal attention work of the prefill chunks, token pairs.
    :param num_decode_seqs: sequences decoding one token each.
    :param decode_kv_tokens: context the decoding sequences attend to.
    :param num_new_seqs: requests scheduled for the first time.
    :param num_finished: requests finished in the iteration (processed after it).
    :param wake: the wake factor ``scale(idle) * decay ** k`` (0 when warm).
    :param new_shape: the engine runs this token count without its matmul primitives (never,
        or not among the last ``shape_cache`` counts: :func:`shape_miss`).
    :param first_shape: it has never run this token count.
    """
    has_prefill = 1.0 if num_prefill_tokens > 0 else 0.0
    tokens = num_prefill_tokens + num_decode_seqs
    shape = 1.0 if new_shape else 0.0
    return [1.0, has_prefill, tokens, num_decode_seqs + has_prefill, prefill_attn_work,
            decode_kv_tokens, decode_kv_tokens * num_decode_seqs, num_new_seqs,
            num_finished, wake, shape, shape * tokens, 1.0 if first_shape else 0.0]


class CalibratedStepTimeModel(StepTimeModel):
    """Step-time model fitted to a live engine (the formula is in the module docstring).

    A decode-only iteration of ``n`` sequences costs
    ``fixed + (per_token + per_seq) * n + (per_kv_token + per_kv_token_seq * n) * kv``, linear
    in ``kv`` for a given ``n``, which is what
    :meth:`decode_coefficients` returns, so the simulator's event skipping stays exact.

    The overhead terms (per new and finished request, wake-up, new token counts) are not
    part of :meth:`step_time_s`: the simulated engine adds them from :meth:`overheads`, since
    they depend on the engine's history (what finished, how long it idled, which iteration
    sizes it ran), not on the batch alone.

    :param coefficients: the fitted coefficients.
    :param name: label (profile and pool).
    :param wake: shape of the wake penalty.
    :param shape_cache: iteration sizes whose matmul primitives the engine keeps (LRU; 0: all).
    """

    def __init__(self, coefficients: StepCoefficients, name: str = "calibrated",
                 wake: WakeShape | None = None, shape_cache: int = 0) -> None:
        if shape_cache < 0:
            raise ValueError(f"shape_cache must be >= 0, got {shape_cache}")
        self.coefficients = coefficients
        self.name = name
        self.wake = wake or WakeShape()
        self.shape_cache = shape_cache
        c = coefficients
        self._w = np.array(c.as_vector(), dtype=np.float64)
        self._overheads: EngineOverheads | None = None
        if c.per_new_seq_s or c.per_finished_s or c.wake_s or c.new_shape_s \
                or c.new_shape_per_token_s or c.first_shape_s:
            shape = self.wake
            self._overheads = EngineOverheads(
                per_new_seq_s=c.per_new_seq_s, per_finished_s=c.per_finished_s,
                wake=tuple(wake_penalty_s(c.wake_s, shape, math.inf, k)
                           for k in range(shape.iterations)) if c.wake_s else (),
                wake_tau_s=shape.tau_s, new_shape_s=c.new_shape_s,
                new_shape_per_token_s=c.new_shape_per_token_s, shape_cache=shape_cache,
                first_shape_s=c.first_shape_s)

    def overheads(self) -> EngineOverheads | None:
        """The engine overheads the simulator adds (``None`` when the profile has none:
        versions 1 and 2)."""
        return self._overheads

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
        return f"CalibratedStepTimeModel({self.name!r}, {self.coefficients}, {self.wake})"


@dataclass(frozen=True)
class FitReport:
    """How well the fitted model reproduces the measured iterations.

    :param rows: iterations fitted.
    :param dropped: iterations left out as outliers (stalls > 5x the model after a first fit).
    :param errors: per-iteration relative errors of the model's step time.
    :param total_rel_err: ``|sum pred - sum measured| / sum measured`` (busy time error).
    :param measured_s: summed measured iteration time.
    """

    rows: int
    dropped: int
    errors: RelativeErrors
    total_rel_err: float
    measured_s: float

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FitReport:
        """Parse the ``fit`` object of a profile (version 2, or version 1's flat fields).

        :param raw: the parsed JSON object.
        """
        rows = int(raw["rows"])
        if "errors" in raw:
            errors = RelativeErrors(**raw["errors"])
        else:  # version 1: median/p90/p99 only
            errors = RelativeErrors(n=rows, median=float(raw["median_rel_err"]),
                                    p90=float(raw["p90_rel_err"]),
                                    p99=float(raw["p99_rel_err"]), max=math.nan,
                                    bias=math.nan, median_signed=math.nan)
        return cls(rows=rows, dropped=int(raw["dropped"]), errors=errors,
                   total_rel_err=float(raw["total_rel_err"]),
                   measured_s=float(raw["measured_s"]))


@dataclass(frozen=True)
class PoolProfile:
    """One pool's calibration.

    :param coefficients: the fitted step-time coefficients.
    :param num_kv_blocks: KV blocks of the engine measured.
    :param kv_cache_dtype: vLLM ``kv_cache_dtype`` of the pool.
    :param fit: fit quality.
    :param wake: shape of the wake penalty (version 3).
    :param shape_cache: iteration sizes whose matmul primitives the engine keeps (version 3;
        0: all).
    """

    coefficients: StepCoefficients
    num_kv_blocks: int
    kv_cache_dtype: str
    fit: FitReport
    wake: WakeShape = field(default_factory=WakeShape)
    shape_cache: int = 0


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

    def with_pool(self, pool: str, **changes: Any) -> CalibratedProfile:
        """This profile with fields of ``pool``'s calibration changed (another fit of the
        same engine, for comparisons).

        :param pool: a pool of the profile.
        :param changes: :class:`PoolProfile` fields and their new values.
        """
        return replace(self, pools={**self.pools, pool: replace(self.pool(pool), **changes)})

    def step_time_model(self, pool: str) -> CalibratedStepTimeModel:
        """The fitted step-time model of ``pool``.

        :param pool: ``fp16`` or ``fp8``.
        """
        p = self.pool(pool)
        return CalibratedStepTimeModel(p.coefficients, f"{self.name}:{pool}", p.wake,
                                       p.shape_cache)

    def num_kv_blocks(self, pool: str) -> int:
        """KV blocks of ``pool``'s engine.

        :param pool: ``fp16`` or ``fp8``.
        """
        return self.pool(pool).num_kv_blocks

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
    if data.get("version") not in _READABLE_VERSIONS:
        raise ValueError(f"{source}: profile version {data.get('version')!r}, this rlbatch "
                         f"reads versions {', '.join(map(str, _READABLE_VERSIONS))}")
    try:
        pools: dict[str, PoolProfile] = {}
        for pool, raw in data["pools"].items():
            if pool not in ("fp16", "fp8"):
                raise ValueError(f"unknown pool {pool!r}")
            pools[pool] = PoolProfile(
                coefficients=StepCoefficients(**raw["coefficients"]),
                num_kv_blocks=int(raw["num_kv_blocks"]),
                kv_cache_dtype=str(raw["kv_cache_dtype"]),
                fit=FitReport.from_dict(raw["fit"]),
                wake=WakeShape(**raw.get("wake", {})),
                shape_cache=int(raw.get("shape_cache", 0)))
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
