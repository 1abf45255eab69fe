"""Parser for Mooncake JSON-lines traces (kvcache-ai/Mooncake FAST'25 release).

Format: one JSON object per line with ``timestamp`` (milliseconds from trace start, int or
float), ``input_length``, ``output_length`` and optional ``hash_ids`` (ids of 512-token
prompt blocks; equal ids at the same position mean a shared prefix). Other keys are ignored.
Blank lines are ignored; every other line is parsed or rejected.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlbatch.workload.numbers import json_count, json_ms_to_ns
from rlbatch.workload.raw import OnBadRow, RawTrace, TraceFormatError

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


def parse_mooncake_jsonl(path: Path, text: str, on_bad_row: OnBadRow) -> RawTrace:
    """Parse the text of a Mooncake JSONL trace into raw rows.

    :param path: the file the text came from (for error messages).
    :param text: the whole file, decoded.
    :param on_bad_row: ``"raise"`` or ``"skip"`` malformed rows.
    :raises TraceFormatError: for an empty file or (when raising) any malformed line.
    """
    raw = RawTrace(path=path, on_bad_row=on_bad_row)
    seen_any = False
    for line_no, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        seen_any = True
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raw.bad_row(line_no, "invalid_json", f"invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            raw.bad_row(line_no, "not_an_object",
                        f"expected a JSON object, got {type(obj).__name__}")
            continue
        _parse_object(raw, line_no, obj)
    if not seen_any:
        raise TraceFormatError(path, None, "empty", "file is empty: expected Mooncake JSON "
                               "lines with timestamp, input_length, output_length")
    return raw


def _parse_object(raw: RawTrace, line: int, obj: dict[str, object]) -> None:
    missing = [key for key in MOONCAKE_FIELDS if key not in obj]
    if missing:
        raw.bad_row(line, "missing_field", f"missing field(s) {', '.join(missing)}")
        return
    timestamp = json_ms_to_ns(obj["timestamp"])
    if timestamp is None:
        raw.bad_row(line, "bad_timestamp", f"timestamp {obj['timestamp']!r} is not a "
                    "non-negative number of milliseconds")
        return
    prompt = json_count(obj["input_length"])
    if prompt is None:
        raw.bad_row(line, "bad_number", f"input_length {obj['input_length']!r} is not an integer")
        return
    output = json_count(obj["output_length"])
    if output is None:
        raw.bad_row(line, "bad_number",
                    f"output_length {obj['output_length']!r} is not an integer")
        return
    hash_ids = obj.get("hash_ids")
    prefix: tuple[int, ...] | None = None
    if hash_ids is not None:
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raw.bad_row(line, "bad_hash_ids", "hash_ids must be a list of integers")
            return
        prefix = tuple(hash_ids)
    raw.add_row(line, timestamp, prompt, output, prefix)
