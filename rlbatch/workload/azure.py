"""Parser for the Azure LLM inference trace CSV (AzurePublicDataset).

Format: a header naming ``TIMESTAMP``, ``ContextTokens`` and ``GeneratedTokens`` (any order,
case-insensitive, extra columns allowed), then one row per request with a wall-clock
timestamp such as ``2023-11-16 18:15:46.6805900`` (100 ns resolution). Blank lines are
ignored; every other row is parsed or rejected.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rlbatch.workload.numbers import parse_count, parse_wallclock_ns
from rlbatch.workload.raw import OnBadRow, RawTrace, TraceFormatError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def looks_like_azure_header(line: str) -> bool:
    """Whether a first line is an Azure trace header (all three columns present).

    :param line: the first non-blank line of a file.
    """
    names = {cell.strip().lower() for cell in line.split(",")}
    return all(column.lower() in names for column in AZURE_COLUMNS)


def parse_azure_csv(path: Path, text: str, on_bad_row: OnBadRow) -> RawTrace:
    """Parse the text of an Azure trace CSV into raw rows.

    :param path: the file the text came from (for error messages).
    :param text: the whole file, decoded.
    :param on_bad_row: ``"raise"`` or ``"skip"`` malformed rows.
    :raises TraceFormatError: for a missing or wrong header, an empty file, or (when raising)
        any malformed row.
    """
    raw = RawTrace(path=path, on_bad_row=on_bad_row)
    reader = csv.reader(io.StringIO(text, newline=""))
    columns: tuple[int, int, int] | None = None
    width = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            if columns is None:
                raise TraceFormatError(path, reader.line_num, "bad_header",
                                       f"unreadable CSV header: {exc}") from exc
            raw.bad_row(reader.line_num, "bad_csv", f"unreadable CSV row: {exc}")
            continue
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # a blank line, not a row
        if columns is None:
            columns = _header_columns(path, line, row)
            width = len(row)
            continue
        if len(row) != width:
            raw.bad_row(line, "bad_field_count", f"expected {width} comma-separated fields "
                        f"as in the header, got {len(row)}")
            continue
        _parse_row(raw, line, row, columns)
    if columns is None:
        raise TraceFormatError(path, None, "empty", "file is empty: expected an Azure CSV "
                               "header (TIMESTAMP,ContextTokens,GeneratedTokens) and data rows")
    return raw


def _header_columns(path: Path, line: int, row: list[str]) -> tuple[int, int, int]:
    names = [cell.strip().lower() for cell in row]
    missing = [column for column in AZURE_COLUMNS if column.lower() not in names]
    if missing:
        raise TraceFormatError(path, line, "bad_header",
                               f"bad header {','.join(row)!r}: missing column(s) "
                               f"{', '.join(missing)}; expected an Azure CSV header with "
                               f"{','.join(AZURE_COLUMNS)} or Mooncake JSON lines")
    ts, prompt, output = (names.index(column.lower()) for column in AZURE_COLUMNS)
    return ts, prompt, output


def _parse_row(raw: RawTrace, line: int, row: list[str],
               columns: tuple[int, int, int]) -> None:
    ts_col, prompt_col, output_col = columns
    timestamp = parse_wallclock_ns(row[ts_col])
    if timestamp is None:
        raw.bad_row(line, "bad_timestamp", f"TIMESTAMP {row[ts_col]!r} is not a timestamp "
                    "like '2023-11-16 18:15:46.6805900'")
        return
    prompt = parse_count(row[prompt_col])
    if prompt is None:
        raw.bad_row(line, "bad_number",
                    f"ContextTokens {row[prompt_col]!r} is not an integer")
        return
    output = parse_count(row[output_col])
    if output is None:
        raw.bad_row(line, "bad_number",
                    f"GeneratedTokens {row[output_col]!r} is not an integer")
        return
    raw.add_row(line, timestamp, prompt, output, None)
