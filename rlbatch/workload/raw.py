"""What a trace parser produces: raw rows plus the bookkeeping of rows it rejected.

Parsers report a bad row to a :class:`RawTrace`, which either raises
:class:`TraceFormatError` (``on_bad_row="raise"``) or counts it by reason
(``on_bad_row="skip"``); no row is ever dropped without being counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

OnBadRow = Literal["raise", "skip"]
ON_BAD_ROW_CHOICES: tuple[OnBadRow, ...] = ("raise", "skip")


class TraceFormatError(ValueError):
    """A trace file is malformed; the message names the file, the 1-based line and the problem.

    :param path: the trace file.
    :param line: 1-based line number of the offending row, or ``None`` for file-level problems.
    :param reason: a short machine-readable key (e.g. ``bad_number``), used for skip counts.
    :param problem: human-readable description.
    """

    def __init__(self, path: Path | str, line: int | None, reason: str, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        self.problem = problem
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


def check_on_bad_row(on_bad_row: str) -> OnBadRow:
    """Validate an ``on_bad_row`` argument.

    :param on_bad_row: ``"raise"`` or ``"skip"``.
    :raises ValueError: for any other value.
    """
    for choice in ON_BAD_ROW_CHOICES:
        if on_bad_row == choice:
            return choice
    raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW_CHOICES}, got {on_bad_row!r}")


@dataclass
class RawTrace:
    """Parsed rows of one trace file, in file order, with absolute integer timestamps.

    :param path: the trace file.
    :param on_bad_row: what to do with a malformed row.
    :param timestamps_ns: arrival time of each row in integer nanoseconds (any origin).
    :param prompt_tokens: prompt length of each row (>= 1).
    :param output_tokens: output length of each row (>= 1 after clamping).
    :param prefix_ids: block hash ids of each row, or ``None``.
    :param skipped_reasons: reason -> rows skipped.
    :param adjustments: reason -> rows kept but changed.
    """

    path: Path
    on_bad_row: OnBadRow
    timestamps_ns: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    prefix_ids: list[tuple[int, ...] | None] = field(default_factory=list)
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    adjustments: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.timestamps_ns)

    def bad_row(self, line: int, reason: str, problem: str) -> None:
        """Reject one row: raise, or count it under ``reason`` when skipping.

        :param line: 1-based line number.
        :param reason: machine-readable key.
        :param problem: human-readable description.
        :raises TraceFormatError: when ``on_bad_row == "raise"``.
        """
        if self.on_bad_row == "raise":
            raise TraceFormatError(self.path, line, reason, problem)
        self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + 1

    def add_row(self, line: int, timestamp_ns: int, prompt: int, output: int,
                prefix: tuple[int, ...] | None) -> None:
        """Validate token counts and append one row (or reject it via :meth:`bad_row`).

        A row with 0 output tokens is kept with 1 output token and counted in
        ``adjustments["zero_output_clamped"]``: the request still arrived and its prompt
        still had to be prefilled (it most likely stopped at once), so dropping it would
        understate the load.

        :param line: 1-based line number.
        :param timestamp_ns: arrival in integer nanoseconds.
        :param prompt: prompt tokens; must be >= 1.
        :param output: output tokens; must be >= 0.
        :param prefix: block hash ids, or ``None``.
        """
        if prompt < 1:
            self.bad_row(line, "nonpositive_prompt", f"prompt tokens must be >= 1, got {prompt}")
            return
        if output < 0:
            self.bad_row(line, "negative_output", f"output tokens must be >= 0, got {output}")
            return
        if output == 0:
            output = 1
            self.adjustments["zero_output_clamped"] = (
                self.adjustments.get("zero_output_clamped", 0) + 1)
        self.timestamps_ns.append(timestamp_ns)
        self.prompt_tokens.append(prompt)
        self.output_tokens.append(output)
        self.prefix_ids.append(prefix)
