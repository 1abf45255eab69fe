"""Tests for rlbatch.workload: trace loading, rate scaling, windows, jitter, malformed input."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rlbatch.request import Request
from rlbatch.workload import (
    TraceFormatError,
    Workload,
    declare_max_tokens,
    detect_tick_s,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
)

AZURE = "azure_conv_2023.csv"
MOONCAKE = "mooncake_synthetic.jsonl"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.fixture(scope="module")
def azure(trace_path: Callable[[str], Path]) -> Workload:
    return load_trace(trace_path(AZURE))


def arrivals(workload: Workload) -> list[float]:
    return [r.arrival_s for r in workload.requests]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def moon(ts: float, prompt: object = 100, output: object = 10, **extra: object) -> str:
    return json.dumps({"timestamp": ts, "input_length": prompt, "output_length": output, **extra})


# --- shipped traces ---------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "rows", "span_min", "rate"), [
    (AZURE, 19_366, 58, 5.53),
    (MOONCAKE, 3_993, 17, 3.91),
])
def test_shipped_trace_matches_readme(trace_path: Callable[[str], Path], name: str, rows: int,
                                      span_min: int, rate: float) -> None:
    workload = load_trace(trace_path(name))
    times = arrivals(workload)
    assert len(workload) == rows
    assert times[0] == 0.0
    assert times == sorted(times)
    assert [r.request_id for r in workload.requests] == list(range(rows))
    assert span_min * 60 <= workload.duration_s < (span_min + 1) * 60
    assert workload.mean_rate_rps == pytest.approx(rate, abs=0.01)
    assert workload.skipped_rows == 0 and workload.skipped_reasons == {}
    assert workload.transforms == ()  # neither shipped trace is quantised: no auto jitter
    assert workload.name == Path(name).stem and workload.source.endswith(name)


def test_prefix_ids_only_from_mooncake(trace_path: Callable[[str], Path],
                                       azure: Workload) -> None:
    mooncake = load_mooncake_jsonl(trace_path(MOONCAKE))
    assert all(r.prefix_ids is None for r in azure.requests)
    first = mooncake.requests[0]
    assert first.prefix_ids is not None and first.prefix_ids[:3] == (0, 1, 2)
    assert first.prompt_tokens == 40160


def test_azure_loads_fast(trace_path: Callable[[str], Path]) -> None:
    start = time.perf_counter()
    load_azure_csv(trace_path(AZURE))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_rate_scale_compresses_time(azure: Workload, trace_path: Callable[[str], Path],
                                    scale: float) -> None:
    scaled = load_trace(trace_path(AZURE), rate_scale=scale)
    assert len(scaled) == len(azure)
    assert scaled.duration_s == pytest.approx(azure.duration_s / scale)
    assert scaled.mean_rate_rps == pytest.approx(azure.mean_rate_rps * scale)


def test_window_selects_original_time_and_rebases(azure: Workload,
                                                  trace_path: Callable[[str], Path]) -> None:
    inside = [r for r in azure.requests if 600.0 <= r.arrival_s < 1200.0]
    windowed = load_trace(trace_path(AZURE), window_s=(600.0, 1200.0), rate_scale=2.0)
    assert len(windowed) == len(inside)
    assert windowed.requests[0].arrival_s == 0.0
    assert [r.prompt_tokens for r in windowed.requests] == [r.prompt_tokens for r in inside]
    offset = inside[0].arrival_s
    assert arrivals(windowed) == pytest.approx([(r.arrival_s - offset) / 2 for r in inside])
    assert windowed.duration_s < 300.0
    assert windowed.transforms == ("window [600, 1200) s", "rate_scale x2")


def test_max_requests_keeps_first(azure: Workload, trace_path: Callable[[str], Path]) -> None:
    head = load_trace(trace_path(AZURE), max_requests=100)
    assert head.requests == azure.requests[:100]


def test_window_outside_trace_is_an_error(trace_path: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="selects no request"):
        load_trace(trace_path(MOONCAKE), window_s=(5000.0, 6000.0))


@pytest.mark.parametrize("kwargs", [
    {"rate_scale": 0.0}, {"rate_scale": -1.0}, {"rate_scale": math.nan},
    {"window_s": (10.0, 5.0)}, {"window_s": (-1.0, 5.0)}, {"max_requests": 0},
    {"jitter_s": -1.0}, {"on_bad_row": "ignore"},
])
def test_invalid_options(tmp_path: Path, kwargs: dict[str, object]) -> None:
    path = write(tmp_path, "t.jsonl", moon(0) + "\n")
    with pytest.raises(ValueError):
        load_trace(path, **kwargs)  # type: ignore[arg-type]


# --- jitter -----------------------------------------------------------------------------------

TICK_MS = [0, 0, 3000, 3000, 3000, 9000, 12000, 12000]


@pytest.fixture
def tick_file(tmp_path: Path) -> Path:
    lines = [moon(ts, prompt=100 + i) for i, ts in enumerate(TICK_MS)]
    return write(tmp_path, "conv.jsonl", "\n".join(lines) + "\n")


def test_detect_tick() -> None:
    assert detect_tick_s(np.array([0, 3_000, 9_000, 12_000], dtype=np.int64) * 10**6) == 3.0
    assert detect_tick_s(np.array([0, 3_000], dtype=np.int64) * 10**6) == 0.0


def test_jitter_off_keeps_ticks(tick_file: Path) -> None:
    workload = load_trace(tick_file, jitter_s=0)
    assert arrivals(workload) == [ts / 1000 for ts in TICK_MS]
    assert workload.transforms == ()


def test_auto_jitter_spreads_within_ticks(tick_file: Path) -> None:
    workload = load_trace(tick_file, seed=7)
    assert len(set(arrivals(workload))) == len(TICK_MS)
    assert workload.requests[0].arrival_s == 0.0
    assert "auto" in workload.transforms[0] and "3 s" in workload.transforms[0]
    # Each request moved by offset_i - offset_first with offset in [0, 3): its arrival minus
    # its original tick spans less than one tick across all requests.
    original = {100 + i: ts / 1000 for i, ts in enumerate(TICK_MS)}
    shifts = [r.arrival_s - original[r.prompt_tokens] for r in workload.requests]
    assert max(shifts) - min(shifts) < 3.0
    assert load_trace(tick_file, seed=7).requests == workload.requests
    assert arrivals(load_trace(tick_file, seed=8)) != arrivals(workload)


def test_explicit_jitter_width(tick_file: Path) -> None:
    workload = load_trace(tick_file, jitter_s=0.5, seed=1)
    original = {100 + i: ts / 1000 for i, ts in enumerate(TICK_MS)}
    shifts = [r.arrival_s - original[r.prompt_tokens] for r in workload.requests]
    assert max(shifts) - min(shifts) < 0.5
    assert workload.transforms == ("jitter 0.5 s",)


# --- malformed input --------------------------------------------------------------------------

GOOD_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
MALFORMED = [
    # (file name, content, 1-based line, reason)
    ("bad_number.csv", AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.0000000,abc,5\n"
     + GOOD_ROW, 3, "bad_number"),
    ("bad_time.csv", AZURE_HEADER + "2023-13-16 18:15:46.68,374,44\n" + GOOD_ROW, 2,
     "bad_timestamp"),
    ("neg_output.csv", AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:48.1,10,-3\n", 3,
     "negative_output"),
    ("fields.csv", AZURE_HEADER + GOOD_ROW + GOOD_ROW + "2023-11-16 18:15:48.1,10\n", 4,
     "bad_field_count"),
    ("empty_fields.csv", AZURE_HEADER + GOOD_ROW + ",,\n", 3, "bad_timestamp"),
    ("bad_json.jsonl", moon(0) + "\n" + '{"timestamp": 5, "input_length": \n' + moon(9) + "\n",
     2, "invalid_json"),
    ("neg_prompt.jsonl", moon(0) + "\n" + moon(1) + "\n" + moon(2, prompt=-5) + "\n", 3,
     "nonpositive_prompt"),
    ("zero_prompt.jsonl", moon(0, prompt=0) + "\n" + moon(1) + "\n", 1, "nonpositive_prompt"),
    ("missing.jsonl", moon(0) + "\n" + '{"timestamp": 3, "input_length": 7}\n', 2,
     "missing_field"),
    ("string_len.jsonl", moon(0) + "\n" + moon(3, prompt="12") + "\n", 2, "bad_number"),
    ("neg_time.jsonl", moon(-1) + "\n" + moon(3) + "\n", 1, "bad_timestamp"),
    ("array.jsonl", moon(0) + "\n" + "[1, 2]\n", 2, "not_an_object"),
    ("hashes.jsonl", moon(0) + "\n" + moon(3, hash_ids=["a"]) + "\n", 2, "bad_hash_ids"),
]


@pytest.mark.parametrize(("name", "content", "line", "reason"), MALFORMED,
                         ids=[case[0] for case in MALFORMED])
def test_malformed_row_raises_with_file_and_line(tmp_path: Path, name: str, content: str,
                                                 line: int, reason: str) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert name in str(info.value)
    assert f"{name}:{line}: " in str(info.value)
    assert (info.value.line, info.value.reason) == (line, reason)


@pytest.mark.parametrize(("name", "content", "line", "reason"), MALFORMED,
                         ids=[case[0] for case in MALFORMED])
def test_skip_counts_malformed_rows(tmp_path: Path, name: str, content: str, line: int,
                                    reason: str) -> None:
    path = write(tmp_path, name, content)
    data_rows = sum(1 for text in content.splitlines() if text.strip()) - name.endswith(".csv")
    workload = load_trace(path, on_bad_row="skip")
    assert workload.skipped_rows == 1
    assert workload.skipped_reasons == {reason: 1}
    assert len(workload) == data_rows - 1
    assert f"{reason}=1" in workload.describe()


@pytest.mark.parametrize(("name", "content", "line", "message"), [
    ("header.csv", "time,ctx,gen\n2023-11-16 18:15:46.68,1,2\n", 1, "header"),
    ("partial_header.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,1\n", 1,
     "GeneratedTokens"),
    ("blank_then_header.csv", "\n\nfoo\n", 3, "header"),
])
def test_bad_header_raises_even_when_skipping(tmp_path: Path, name: str, content: str, line: int,
                                              message: str) -> None:
    path = write(tmp_path, name, content)
    for mode in ("raise", "skip"):
        with pytest.raises(TraceFormatError, match=message) as info:
            load_trace(path, on_bad_row=mode)
        assert f"{name}:{line}: " in str(info.value)


def test_load_azure_csv_rejects_jsonl(tmp_path: Path) -> None:
    path = write(tmp_path, "m.jsonl", moon(0) + "\n")
    with pytest.raises(TraceFormatError, match=r"m\.jsonl:1: .*header"):
        load_azure_csv(path)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("empty.csv", "", "empty"),
    ("blank.jsonl", "\n  \n", "empty"),
    ("header_only.csv", AZURE_HEADER, "no valid data rows"),
])
def test_empty_file(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    assert name in str(info.value)


def test_all_rows_skipped_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "junk.jsonl", "{oops\n{nope\n")
    with pytest.raises(TraceFormatError, match=r"junk\.jsonl: no valid data rows \(2 malformed"):
        load_trace(path, on_bad_row="skip")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.csv"
    with pytest.raises(FileNotFoundError, match=r"nowhere\.csv"):
        load_trace(path)


def test_unsorted_rows_are_sorted(tmp_path: Path) -> None:
    path = write(tmp_path, "unsorted.csv", AZURE_HEADER
                 + "2023-11-16 18:00:05.5,30,3\n2023-11-16 18:00:01.25,10,1\n"
                 + "2023-11-16 18:00:02.0000001,20,2\n")
    workload = load_trace(path)
    assert arrivals(workload) == [0.0, pytest.approx(0.7500001), 4.25]
    assert [r.prompt_tokens for r in workload.requests] == [10, 20, 30]
    assert [r.request_id for r in workload.requests] == [0, 1, 2]


def test_zero_output_is_clamped_and_counted(tmp_path: Path) -> None:
    path = write(tmp_path, "zero.csv", AZURE_HEADER + GOOD_ROW
                 + "2023-11-16 18:15:47.0,50,0\n")
    workload = load_trace(path)
    assert workload.requests[1].max_output_tokens == 1
    assert workload.adjustments == {"zero_output_clamped": 1}
    assert workload.skipped_rows == 0
    assert "zero_output_clamped=1" in workload.describe()


def test_format_detected_by_content_crlf_and_bom(tmp_path: Path) -> None:
    mooncake = write(tmp_path, "actually_jsonl.csv", moon(0) + "\n" + moon(1500, 7, 0) + "\n")
    assert arrivals(load_trace(mooncake)) == [0.0, 1.5]
    azure = tmp_path / "crlf.txt"
    azure.write_bytes(("\ufeff" + AZURE_HEADER + GOOD_ROW).replace("\n", "\r\n").encode())
    assert load_trace(azure).requests == [Request(0, 0.0, 374, 44)]


def test_extra_columns_and_timezone(tmp_path: Path) -> None:
    path = write(tmp_path, "cols.csv", "ContextTokens,Foo,GeneratedTokens,TIMESTAMP\n"
                 "5,x,6,2023-11-16T18:00:00+01:00\n7,y,8,2023-11-16 17:00:02Z\n")
    assert arrivals(load_trace(path)) == [0.0, 2.0]


def test_declared_max_tokens_changes_only_the_declared_limit(azure: Workload) -> None:
    declared = declare_max_tokens(azure, 512)
    assert [r.max_output_tokens for r in declared.requests] == [
        r.max_output_tokens for r in azure.requests]
    assert [r.max_tokens for r in declared.requests] == [
        max(512, r.max_output_tokens) for r in azure.requests]
    assert declared.transforms[-1] == "clients declare max_tokens=512"
    with pytest.raises(ValueError, match="below"):
        Request(0, 0.0, 10, 20, max_tokens=19)
    with pytest.raises(ValueError, match=">= 1"):
        declare_max_tokens(azure, 0)
