"""Where shared data lives: read in place from ../shared, never copied into the repo."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def traces_dir() -> Path:
    """``$RLBATCH_TRACES_DIR`` or ``<repo>/../shared/data/traces``."""
    return Path(os.environ.get("RLBATCH_TRACES_DIR", REPO_ROOT.parent / "shared/data/traces"))


def default_training_traces() -> tuple[Path, ...]:
    """The shipped Azure conversation trace (training default; Mooncake is held out)."""
    return (traces_dir() / "azure_conv_2023.csv",)
