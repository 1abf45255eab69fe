"""Load a real request trace (Azure CSV or Mooncake JSONL) as a replayable Workload.

The pipeline, in order: parse (format detected from the content) -> sort by timestamp
(stable; unsorted files are fine) -> re-base to the first row -> jitter (spread arrivals
inside their timestamp tick) -> window (on the un-jittered trace time) -> rate scaling ->
first ``max_requests`` arrivals -> number and re-base so the first request arrives at 0.

Jitter draws come from ``numpy.random.default_rng(seed)``, one draw per parsed row in
timestamp order, so the same file and seed give the same workload, and a window or a
``max_requests`` cut gives a subset of the full replay's arrivals (up to a shift).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from rlbatch.workload.azure import looks_like_azure_header, parse_azure_csv
from rlbatch.workload.base import RequestRow, Workload, build_workload
from rlbatch.workload.mooncake import parse_mooncake_jsonl
from rlbatch.workload.raw import OnBadRow, RawTrace, TraceFormatError, check_on_bad_row

TraceFormat = Literal["azure", "mooncake"]
Parser = Callable[[Path, str, OnBadRow], RawTrace]

#: Auto jitter only spreads arrivals when the detected tick is at least this coarse.
AUTO_JITTER_MIN_TICK_S = 0.01
#: ... and only when the trace has at least this many distinct timestamps.
AUTO_JITTER_MIN_DISTINCT = 3

_PARSERS: dict[TraceFormat, Parser] = {"azure": parse_azure_csv,
                                       "mooncake": parse_mooncake_jsonl}


def load_trace(path: str | Path, *, rate_scale: float = 1.0,
               window_s: tuple[float, float] | None = None, max_requests: int | None = None,
               jitter_s: float | None = None, seed: int = 0,
               on_bad_row: OnBadRow = "raise") -> Workload:
    """Load an Azure CSV or Mooncake JSONL trace, detecting the format from the content.

    :param path: the trace file.
    :param rate_scale: > 1 compresses time (arrival / rate_scale: more requests per second),
        < 1 stretches it.
    :param window_s: ``(start, end)``: keep requests whose trace time (re-based to the first
        row, before jitter and scaling) lies in ``[start, end)``.
    :param max_requests: keep only the first N arrivals (after window and scaling).
    :param jitter_s: width of the uniform spread added to each arrival. ``None`` = auto:
        if the timestamps are quantised (their greatest common granularity, the tick, is
        >= 10 ms, e.g. Mooncake's 3 s conversation-trace ticks) spread each arrival
        uniformly inside its tick, else none. ``0`` = off.
    :param seed: seed of the per-call ``numpy.random.Generator`` used for jitter.
    :param on_bad_row: ``"raise"`` a :class:`TraceFormatError` at the first malformed row,
        or ``"skip"`` malformed rows and count them in ``skipped_rows``/``skipped_reasons``.
    :raises FileNotFoundError: if the file does not exist.
    :raises TraceFormatError: if the file is empty, of unknown format or malformed.
    :raises ValueError: for invalid arguments, or a window that selects no request.
    """
    return _load(path, None, rate_scale=rate_scale, window_s=window_s,
                 max_requests=max_requests, jitter_s=jitter_s, seed=seed, on_bad_row=on_bad_row)


def load_azure_csv(path: str | Path, *, rate_scale: float = 1.0,
                   window_s: tuple[float, float] | None = None,
                   max_requests: int | None = None, jitter_s: float | None = None,
                   seed: int = 0, on_bad_row: OnBadRow = "raise") -> Workload:
    """Load an Azure LLM inference trace CSV; parameters as :func:`load_trace`.

    :param path: the trace file.
    :param rate_scale: see :func:`load_trace`.
    :param window_s: see :func:`load_trace`.
    :param max_requests: see :func:`load_trace`.
    :param jitter_s: see :func:`load_trace`.
    :param seed: see :func:`load_trace`.
    :param on_bad_row: see :func:`load_trace`.
    """
    return _load(path, "azure", rate_scale=rate_scale, window_s=window_s,
                 max_requests=max_requests, jitter_s=jitter_s, seed=seed, on_bad_row=on_bad_row)


def load_mooncake_jsonl(path: str | Path, *, rate_scale: float = 1.0,
                        window_s: tuple[float, float] | None = None,
                        max_requests: int | None = None, jitter_s: float | None = None,
                        seed: int = 0, on_bad_row: OnBadRow = "raise") -> Workload:
    """Load a Mooncake JSON-lines trace; parameters as :func:`load_trace`.

    :param path: the trace file.
    :param rate_scale: see :func:`load_trace`.
    :param window_s: see :func:`load_trace`.
    :param max_requests: see :func:`load_trace`.
    :param jitter_s: see :func:`load_trace`.
    :param seed: see :func:`load_trace`.
    :param on_bad_row: see :func:`load_trace`.
    """
    return _load(path, "mooncake", rate_scale=rate_scale, window_s=window_s,
                 max_requests=max_requests, jitter_s=jitter_s, seed=seed, on_bad_row=on_bad_row)


def detect_format(path: Path, text: str) -> TraceFormat:
    """Tell the trace format from the first non-blank line.

    :param path: the file (for error messages).
    :param text: the decoded file content.
    :raises TraceFormatError: if the file is empty or the first line fits neither format.
    """
    for line_no, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("{"):
            return "mooncake"
        if looks_like_azure_header(stripped):
            return "azure"
        raise TraceFormatError(path, line_no, "bad_header",
                               f"unrecognised header {stripped[:80]!r}: expected an Azure CSV "
                               "header (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake "
                               "JSON lines (timestamp, input_length, output_length)")
    raise TraceFormatError(path, None, "empty", "file is empty: expected an Azure CSV or "
                           "Mooncake JSONL trace")


def detect_tick_s(relative_ns: npt.NDArray[np.int64]) -> float:
    """The timestamps' greatest common granularity in seconds (0.0 if undeterminable).

    :param relative_ns: timestamps in integer nanoseconds, re-based so the smallest is 0.
    :returns: the gcd of the distinct non-zero timestamps, or 0.0 when fewer than
        ``AUTO_JITTER_MIN_DISTINCT`` distinct timestamps make the estimate unreliable.
    """
    distinct = np.unique(relative_ns)
    if distinct.size < AUTO_JITTER_MIN_DISTINCT:
        return 0.0
    return int(np.gcd.reduce(distinct[1:])) / 1e9


def read_trace_text(path: Path) -> str:
    """Read a trace file as UTF-8 text (a leading byte-order mark is dropped).

    :param path: the trace file.
    :raises FileNotFoundError: if it does not exist (the message names the path).
    :raises TraceFormatError: if it is not UTF-8 text.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise TraceFormatError(path, line, "not_utf8",
                               f"not UTF-8 text (byte {exc.start}): {exc.reason}") from exc


def _load(path: str | Path, fmt: TraceFormat | None, *, rate_scale: float,
          window_s: tuple[float, float] | None, max_requests: int | None,
          jitter_s: float | None, seed: int, on_bad_row: OnBadRow) -> Workload:
    _check_options(rate_scale, window_s, max_requests, jitter_s)
    mode = check_on_bad_row(on_bad_row)
    trace_path = Path(path)
    text = read_trace_text(trace_path)
    parser = _PARSERS[fmt if fmt is not None else detect_format(trace_path, text)]
    raw = parser(trace_path, text, mode)
    return _replay(raw, rate_scale=rate_scale, window_s=window_s, max_requests=max_requests,
                   jitter_s=jitter_s, seed=seed)


def _check_options(rate_scale: float, window_s: tuple[float, float] | None,
                   max_requests: int | None, jitter_s: float | None) -> None:
    if not (math.isfinite(rate_scale) and rate_scale > 0.0):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale}")
    if window_s is not None:
        start, end = window_s
        if not (math.isfinite(start) and start >= 0.0 and end > start):
            raise ValueError(f"window_s must be (start, end) with 0 <= start < end, "
                             f"got {window_s}")
    if max_requests is not None and (isinstance(max_requests, bool) or max_requests < 1):
        raise ValueError(f"max_requests must be an integer >= 1 or None, got {max_requests}")
    if jitter_s is not None and not (math.isfinite(jitter_s) and jitter_s >= 0.0):
        raise ValueError(f"jitter_s must be None (auto), 0 (off) or a finite number > 0, "
                         f"got {jitter_s}")


def _replay(raw: RawTrace, *, rate_scale: float, window_s: tuple[float, float] | None,
            max_requests: int | None, jitter_s: float | None, seed: int) -> Workload:
    if len(raw) == 0:
        skipped = sum(raw.skipped_reasons.values())
        detail = f" ({skipped} malformed rows skipped: {raw.skipped_reasons})" if skipped else ""
        raise TraceFormatError(raw.path, None, "no_rows", f"no valid data rows{detail}")
    origin = min(raw.timestamps_ns)
    stamps = np.asarray([t - origin for t in raw.timestamps_ns], dtype=np.int64)
    order = np.argsort(stamps, kind="stable")
    trace_s = stamps[order] / 1e9
    transforms: list[str] = []

    width = _jitter_width(stamps, jitter_s, transforms)
    rng = np.random.default_rng(seed)
    arrivals = trace_s + rng.uniform(0.0, width, size=trace_s.size) if width > 0 else trace_s

    if window_s is not None:
        start, end = window_s
        inside = (trace_s >= start) & (trace_s < end)
        if not inside.any():
            raise ValueError(f"{raw.path}: window_s {window_s} selects no request; the trace "
                             f"spans 0 to {trace_s[-1]:.3f} s")
        order, arrivals = order[inside], arrivals[inside] - start
        transforms.append(f"window [{start:g}, {end:g}) s")
    if rate_scale != 1.0:
        arrivals = arrivals / rate_scale
        transforms.append(f"rate_scale x{rate_scale:g}")
    by_arrival = np.argsort(arrivals, kind="stable")
    if max_requests is not None and max_requests < by_arrival.size:
        by_arrival = by_arrival[:max_requests]
        transforms.append(f"first {max_requests} requests")

    rows: list[RequestRow] = [
        (float(arrivals[i]), raw.prompt_tokens[row], raw.output_tokens[row], raw.prefix_ids[row])
        for i, row in zip(by_arrival.tolist(), order[by_arrival].tolist(), strict=True)]
    return build_workload(rows, name=raw.path.stem, source=str(raw.path),
                          skipped_reasons=raw.skipped_reasons, adjustments=raw.adjustments,
                          transforms=transforms)


def _jitter_width(stamps: npt.NDArray[np.int64], jitter_s: float | None,
                  transforms: list[str]) -> float:
    if jitter_s is not None:
        if jitter_s > 0.0:
            transforms.append(f"jitter {jitter_s:g} s")
        return jitter_s
    tick = detect_tick_s(stamps)
    if tick >= AUTO_JITTER_MIN_TICK_S:
        transforms.append(f"jitter {tick:g} s (auto: timestamps quantised to {tick:g} s ticks)")
        return tick
    return 0.0
