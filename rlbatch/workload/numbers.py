"""Strict parsing of the scalar fields found in trace rows (token counts, timestamps)."""

from __future__ import annotations

import math
import re
from datetime import date

_TIMESTAMP = re.compile(
    r"\s*(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?\s*")
_NS_PER_S = 1_000_000_000
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()


def parse_count(text: str) -> int | None:
    """Parse a token count written as an integer (``"374"``, or integral ``"374.0"``).

    :param text: the field as read from the file.
    :returns: the integer (may be negative; the caller checks the range), or ``None`` if the
        text is not an integral number.
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def json_count(value: object) -> int | None:
    """Accept a JSON token count: an int, or an integral float; never a bool or a string.

    :param value: the decoded JSON value.
    :returns: the integer, or ``None`` if the value is not an integral number.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def json_ms_to_ns(value: object) -> int | None:
    """Convert a JSON timestamp in milliseconds (int or float, finite, >= 0) to nanoseconds.

    :param value: the decoded JSON value.
    :returns: integer nanoseconds, or ``None`` if the value is not a valid timestamp.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value * 1_000_000 if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value >= 0.0:
        return round(value * 1_000_000)
    return None


def parse_wallclock_ns(text: str) -> int | None:
    """Parse an ISO-like wall-clock timestamp to integer nanoseconds since 1970-01-01.

    Accepts ``YYYY-MM-DD HH:MM:SS[.fraction][Z|+HH:MM]`` (``T`` also allowed as separator)
    with any number of fraction digits (Azure writes 7, i.e. 100 ns; digits beyond 9 are
    truncated). A timezone offset is converted to UTC; no offset means the trace's own clock.

    :param text: the field as read from the file.
    :returns: nanoseconds, or ``None`` if the text is not such a timestamp.
    """
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        days = date(int(year), int(month), int(day)).toordinal() - _EPOCH_ORDINAL
    except ValueError:
        return None
    h, m, s = int(hour), int(minute), int(second)
    if h > 23 or m > 59 or s > 59:
        return None
    offset_s = 0
    if zone is not None and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        offset_s = sign * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
    fraction_ns = int((fraction + "00000000")[:9]) if fraction else 0
    return (days * 86400 + h * 3600 + m * 60 + s - offset_s) * _NS_PER_S + fraction_ns
