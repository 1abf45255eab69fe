"""Shared fixtures: where the shared data lies (read in place, never copied)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def traces_dir() -> Path:
    return Path(os.environ.get("RLBATCH_TRACES_DIR", SHARED / "data" / "traces"))


def profiling_dir() -> Path:
    return Path(os.environ.get("RLBATCH_PROFILING_DIR", SHARED / "data" / "profiling" / "vidur"))


@pytest.fixture(scope="session")
def azure_trace() -> Path:
    path = traces_dir() / "azure_conv_2023.csv"
    if not path.exists():
        pytest.fail(f"shared trace missing: {path}")
    return path


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    path = traces_dir() / "mooncake_synthetic.jsonl"
    if not path.exists():
        pytest.fail(f"shared trace missing: {path}")
    return path


@pytest.fixture(scope="session")
def trace_path() -> Callable[[str], Path]:
    """A shipped trace by file name; fails (never skips) when the shared data is missing."""
    def find(name: str) -> Path:
        path = traces_dir() / name
        if not path.is_file():
            pytest.fail(f"shipped trace {path} not present (set RLBATCH_TRACES_DIR)")
        return path
    return find
