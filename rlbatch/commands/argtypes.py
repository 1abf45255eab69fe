"""argparse value types shared by the command-line tools."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def positive_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (``--kv-offload-gib``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` that shows the parser's own error message."""

    def wrapper(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    wrapper.__name__ = parse.__name__
    return wrapper


def positive_range(text: str) -> tuple[float, float]:
    """``X`` (the range ``X, X``) or ``LOW,HIGH`` with ``0 < LOW <= HIGH``."""
    parts = [float(x) for x in text.split(",")]
    low, high = parts[0], parts[-1]
    if len(parts) > 2 or not 0 < low <= high:
        raise ValueError(f"one value or LOW,HIGH with 0 < LOW <= HIGH, e.g. 1,2.5; got {text!r}")
    return low, high


def parse_window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        lo, hi = float(start or 0), float(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"window must be START:END in seconds, got {text!r}") \
            from None
    if not sep or hi <= lo or lo < 0:
        raise argparse.ArgumentTypeError(f"window must be START:END with 0 <= START < END, "
                                         f"got {text!r}")
    return lo, hi
