"""Workloads: real request traces (Azure CSV, Mooncake JSONL) and synthetic generators.

Every source yields a :class:`Workload`: requests sorted by arrival, numbered ``0..n-1``,
re-based to start at 0, with a record of skipped rows and applied transforms.
"""

from rlbatch.workload.base import RequestRow, Workload, build_workload, declare_max_tokens
from rlbatch.workload.conversations import conversations
from rlbatch.workload.generators import bursty, diurnal, poisson
from rlbatch.workload.lengths import (
    DEFAULT_CONTEXT_TOKENS,
    LengthDist,
    LengthMixture,
    LogNormalLengths,
    azure_like_mix,
    day_mix,
    long_reports,
    night_mix,
    short_chats,
)
from rlbatch.workload.raw import OnBadRow, TraceFormatError
from rlbatch.workload.spec import MIXES, VALID_FORMS, resolve_workload
from rlbatch.workload.traces import (
    TraceFormat,
    detect_format,
    detect_tick_s,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
)

__all__ = [
    "DEFAULT_CONTEXT_TOKENS",
    "MIXES",
    "VALID_FORMS",
    "LengthDist",
    "LengthMixture",
    "LogNormalLengths",
    "OnBadRow",
    "RequestRow",
    "TraceFormat",
    "TraceFormatError",
    "Workload",
    "azure_like_mix",
    "build_workload",
    "bursty",
    "conversations",
    "day_mix",
    "declare_max_tokens",
    "detect_format",
    "detect_tick_s",
    "diurnal",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "load_trace",
    "long_reports",
    "night_mix",
    "poisson",
    "resolve_workload",
    "short_chats",
]
