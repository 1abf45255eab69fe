"""The Workload type: an arrival-ordered list of requests plus where it came from.

Every workload, from a trace file or a generator, has the same invariants, checked at
construction: requests sorted by arrival, ids ``0..n-1`` in arrival order, and arrival times
re-based so the first request arrives at ``0.0``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from rlbatch.request import Request

#: One request before numbering: (arrival_s, prompt_tokens, output_tokens, prefix_ids).
RequestRow = tuple[float, int, int, "tuple[int, ...] | None"]


@dataclass(frozen=True)
class Workload:
    """A replayable stream of requests.

    :param name: short label (trace file stem or generator name), used in reports.
    :param requests: sorted by ``arrival_s``; ``request_id`` is ``0..n-1`` in that order; the
        first arrival is ``0.0``.
    :param source: the trace path, or the generator call that produced the requests.
    :param skipped_rows: input rows dropped as malformed (only with ``on_bad_row="skip"``);
        always equals ``sum(skipped_reasons.values())``.
    :param skipped_reasons: reason -> number of rows dropped for it.
    :param adjustments: reason -> number of rows kept but changed, e.g.
        ``zero_output_clamped`` (a trace row with 0 output tokens replayed with 1).
    :param transforms: human-readable record of what was applied on top of the source
        (rate scaling, window, jitter, truncation), in order.
    """

    name: str
    requests: list[Request]
    source: str
    skipped_rows: int = 0
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    adjustments: dict[str, int] = field(default_factory=dict)
    transforms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.skipped_rows < 0 or any(c < 0 for c in self.skipped_reasons.values()):
            raise ValueError(f"workload {self.name!r}: skip counts must be >= 0, got "
                             f"skipped_rows={self.skipped_rows}, {self.skipped_reasons}")
        if self.skipped_rows != sum(self.skipped_reasons.values()):
            raise ValueError(f"workload {self.name!r}: skipped_rows={self.skipped_rows} does "
                             f"not match sum of skipped_reasons {self.skipped_reasons}")
        previous = 0.0
        for index, request in enumerate(self.requests):
            if request.request_id != index:
                raise ValueError(f"workload {self.name!r}: request at position {index} has "
                                 f"request_id={request.request_id}; ids must be 0..n-1 in "
                                 "arrival order")
            if index == 0 and request.arrival_s != 0.0:
                raise ValueError(f"workload {self.name!r}: first arrival must be 0.0 (re-based),"
                                 f" got {request.arrival_s}")
            if request.arrival_s < previous:
                raise ValueError(f"workload {self.name!r}: request {index} arrives at "
                                 f"{request.arrival_s} s, before request {index - 1} at "
                                 f"{previous} s; requests must be sorted by arrival")
            previous = request.arrival_s

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0.0 for fewer than two requests)."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def mean_rate_rps(self) -> float:
        """Requests per second over the arrival span, ``n / duration_s`` (0.0 if the span is 0)."""
        duration = self.duration_s
        return len(self.requests) / duration if duration > 0.0 else 0.0

    def describe(self) -> str:
        """One line: name, size, span, rate, mean lengths, skips and transforms."""
        n = len(self.requests)
        if n:
            prompt_mean = sum(r.prompt_tokens for r in self.requests) / n
            output_mean = sum(r.max_output_tokens for r in self.requests) / n
            lengths = f"prompt mean {prompt_mean:.0f} / output mean {output_mean:.0f} tokens"
        else:
            lengths = "no requests"
        parts = [f"{self.name}: {n} requests over {self.duration_s:.1f} s "
                 f"({self.mean_rate_rps:.2f} req/s)", lengths,
                 f"{self.skipped_rows} rows skipped"]
        if self.skipped_reasons:
            parts[-1] += " (" + _counts(self.skipped_reasons) + ")"
        if self.adjustments:
            parts.append("adjusted: " + _counts(self.adjustments))
        if self.transforms:
            parts.append("; ".join(self.transforms))
        parts.append(f"source {self.source}")
        return ", ".join(parts)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{reason}={count}" for reason, count in sorted(counts.items()))


def build_workload(rows: Iterable[RequestRow], *, name: str, source: str,
                   skipped_reasons: Mapping[str, int] | None = None,
                   adjustments: Mapping[str, int] | None = None,
                   transforms: Iterable[str] = ()) -> Workload:
    """Sort rows by arrival (stable), re-base so the first arrives at 0 and number them.

    :param rows: ``(arrival_s, prompt_tokens, output_tokens, prefix_ids)`` in any order;
        arrival times may have any origin (even negative), only their differences matter.
    :param name: the workload's name.
    :param source: the workload's source description.
    :param skipped_reasons: reason -> rows dropped, if the rows came from a file.
    :param adjustments: reason -> rows kept but changed.
    :param transforms: what was applied on top of the source.
    :raises ValueError: if a row has a non-finite arrival or token counts ``< 1``.
    """
    ordered = sorted(rows, key=lambda row: row[0])
    origin = ordered[0][0] if ordered else 0.0
    if not all(math.isfinite(row[0]) for row in ordered):
        raise ValueError(f"workload {name!r}: arrival times must be finite")
    requests = [Request(request_id=index, arrival_s=arrival - origin, prompt_tokens=prompt,
                        max_output_tokens=output, prefix_ids=prefix)
                for index, (arrival, prompt, output, prefix) in enumerate(ordered)]
    skipped = dict(skipped_reasons or {})
    return Workload(name=name, requests=requests, source=source,
                    skipped_rows=sum(skipped.values()), skipped_reasons=skipped,
                    adjustments=dict(adjustments or {}), transforms=tuple(transforms))


def declare_max_tokens(workload: Workload, max_tokens: int) -> Workload:
    """Every client declares ``max_tokens`` (or its real output, if longer), as chat clients
    that send one service-wide limit do. Only what the KV budget may count changes (the
    ``declared`` count is that limit, the ``observed`` one is capped by it); every request
    still generates its real output.

    :param workload: the workload.
    :param max_tokens: the declared output limit (>= 1).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    requests = [replace(r, max_tokens=max(max_tokens, r.max_output_tokens))
                for r in workload.requests]
    return replace(workload, requests=requests,
                   transforms=(*workload.transforms, f"clients declare max_tokens={max_tokens}"))
