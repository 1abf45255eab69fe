"""Turn a workload spec string (a trace path or a generator spec) into a Workload.

Valid forms::

    PATH                                     an Azure CSV or Mooncake JSONL trace
    poisson:rate=R,duration=D[,mix=M]
    bursty:rate=R,duration=D[,mix=M][,burst=F][,on=S][,off=S]
    diurnal:rate=R,duration=D[,mix=M][,period=S][,amplitude=A]
    surge:rate=R,duration=D[,mix=M][,factor=F][,start=S][,length=S]
    F:load=X,duration=D  (or rate=R)        a traffic family (rlbatch.workload.families)
    drift:families=F/F...,load=X,duration=D[,segment=S]

with ``M`` one of ``day``, ``night``, ``azure-like`` (default), ``code``, ``chat``,
``report``, and ``F`` one of ``chat``, ``code``, ``rag``, ``report``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from rlbatch.workload.base import Workload
from rlbatch.workload.families import FAMILIES, chat_mix, drift, report_mix
from rlbatch.workload.generators import bursty, diurnal, poisson, surge
from rlbatch.workload.lengths import (
    LengthDist,
    azure_like_mix,
    code_completion_mix,
    day_mix,
    night_mix,
)
from rlbatch.workload.traces import load_trace

MIXES: dict[str, Callable[[], LengthDist]] = {
    "day": day_mix, "night": night_mix, "azure-like": azure_like_mix,
    "code": code_completion_mix, "chat": chat_mix, "report": report_mix}

#: Generator name -> optional keys beyond rate, duration and mix.
GENERATOR_KEYS: dict[str, tuple[str, ...]] = {
    "poisson": (), "bursty": ("burst", "on", "off"), "diurnal": ("period", "amplitude"),
    "surge": ("factor", "start", "length")}

VALID_FORMS = (
    "PATH (Azure CSV or Mooncake JSONL trace); "
    "poisson:rate=R,duration=D[,mix=M]; "
    "bursty:rate=R,duration=D[,mix=M][,burst=F][,on=S][,off=S]; "
    "diurnal:rate=R,duration=D[,mix=M][,period=S][,amplitude=A]; "
    "surge:rate=R,duration=D[,mix=M][,factor=F][,start=S][,length=S]; "
    "F:load=X,duration=D (or rate=R req/s); "
    "drift:families=F/F...,load=X,duration=D[,segment=S]; "
    f"M in {'|'.join(MIXES)} (default azure-like); F in {'|'.join(FAMILIES)}")

_SPEC = re.compile(r"([A-Za-z][\w-]*):(.*)")


def resolve_workload(spec: str, seed: int = 0, *, rate_scale: float = 1.0) -> Workload:
    """Load a trace file or run a generator, as the spec string says.

    :param spec: a trace path or a generator spec (see the module docstring).
    :param seed: seed for the generator or for trace jitter.
    :param rate_scale: multiplies the request rate: a trace's arrivals are compressed by it
        (``load_trace(rate_scale=...)``), a generator's ``rate`` is multiplied by it.
    :raises ValueError: for a malformed generator spec (the message lists the valid forms).
    :raises FileNotFoundError: for a path that does not exist (the message lists the forms).
    """
    match = _SPEC.fullmatch(spec.strip())
    if match is not None and (match.group(1).lower() in FAMILIES
                              or match.group(1).lower() == "drift"):
        return _family(match.group(1).lower(), match.group(2), spec, seed, rate_scale)
    if match is not None and match.group(1).lower() in GENERATOR_KEYS:
        return _generate(match.group(1).lower(), match.group(2), spec, seed, rate_scale)
    path = Path(spec)
    if path.exists():
        return load_trace(path, rate_scale=rate_scale, seed=seed)
    if match is not None and "=" in match.group(2):
        raise ValueError(f"unknown workload generator {match.group(1)!r} in {spec!r}; "
                         f"valid forms: {VALID_FORMS}")
    raise FileNotFoundError(f"workload {spec!r} is neither an existing trace file nor a "
                            f"generator spec; valid forms: {VALID_FORMS}")


def _generate(kind: str, body: str, spec: str, seed: int, rate_scale: float) -> Workload:
    params = _parse_params(body, spec)
    _check_keys(params, kind, spec, ("rate", "duration", "mix", *GENERATOR_KEYS[kind]),
                [key for key in ("rate", "duration") if key not in params])
    mix_name = params.pop("mix", "azure-like").lower()
    if mix_name not in MIXES:
        raise ValueError(f"{spec!r}: unknown mix {mix_name!r}; choose one of "
                         f"{', '.join(MIXES)}")
    numbers = {key: _number(key, value, spec) for key, value in params.items()}
    rate, duration, lengths = numbers["rate"] * rate_scale, numbers["duration"], MIXES[mix_name]()
    if kind == "poisson":
        return poisson(rate, duration, lengths, seed)
    if kind == "bursty":
        return bursty(rate, duration, lengths, seed, burst_factor=numbers.get("burst", 4.0),
                      mean_on_s=numbers.get("on", 10.0), mean_off_s=numbers.get("off", 30.0))
    if kind == "surge":
        return surge(rate, duration, lengths, seed, surge_factor=numbers.get("factor", 3.75),
                     surge_start_s=numbers.get("start", 300.0),
                     surge_s=numbers.get("length", 60.0))
    return diurnal(rate, duration, lengths, seed, period_s=numbers.get("period"),
                   amplitude=numbers.get("amplitude", 0.5))


def _family(kind: str, body: str, spec: str, seed: int, rate_scale: float) -> Workload:
    params = _parse_params(body, spec)
    allowed = (("families", "load", "duration", "segment") if kind == "drift"
               else ("load", "rate", "duration"))
    needed = ("families", "load", "duration") if kind == "drift" else ("duration",)
    missing = [key for key in needed if key not in params]
    if kind != "drift" and ("load" in params) == ("rate" in params):
        missing.append("exactly one of load and rate")
    _check_keys(params, kind, spec, allowed, missing)
    names = tuple(n.strip().lower() for n in params.pop("families", "").split("/") if n)
    for name in names:
        if name not in FAMILIES:
            raise ValueError(f"{spec!r}: unknown family {name!r}; choose from "
                             f"{', '.join(FAMILIES)}")
    numbers = {key: _number(key, value, spec) for key, value in params.items()}
    for key, value in numbers.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{spec!r}: {key} must be a finite number > 0, got {value:g}")
    duration = numbers["duration"]
    if kind == "drift":
        return drift(names, numbers["load"] * rate_scale, duration,
                     numbers.get("segment", duration / 2), seed)
    family = FAMILIES[kind]
    rate = numbers["rate"] if "rate" in numbers else numbers["load"] * family.reference_rps
    return family.make(rate * rate_scale, duration, seed)


def _check_keys(params: dict[str, str], kind: str, spec: str, allowed: tuple[str, ...],
                missing: list[str]) -> None:
    """Refuse keys ``kind`` does not take, then the ``missing`` required ones."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{spec!r}: unknown key(s) {', '.join(unknown)} for {kind}; allowed: "
                         f"{', '.join(allowed)}; valid forms: {VALID_FORMS}")
    if missing:
        raise ValueError(f"{spec!r}: missing {' and '.join(missing)}; valid forms: {VALID_FORMS}")


def _parse_params(body: str, spec: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise ValueError(f"{spec!r}: expected key=value, got {item!r}; "
                             f"valid forms: {VALID_FORMS}")
        if key in params:
            raise ValueError(f"{spec!r}: key {key!r} given twice")
        params[key] = value.strip()
    return params


def _number(key: str, value: str, spec: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{spec!r}: {key}={value!r} is not a number") from None
