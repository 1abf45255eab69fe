"""Shared fixtures: where the shared data lies (read in place, never copied)."""

from __future__ import annotations

import os
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
