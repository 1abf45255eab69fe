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


def trace_ref(path: str | Path) -> str:
    """How a trace is named in files that travel to other machines (policy artifacts): relative
    to the traces folder when it lies there (``azure_conv_2023.csv``), else as given.

    :param path: a trace path.
    """
    p = Path(path)
    try:
        return p.resolve().relative_to(traces_dir().resolve()).as_posix()
    except ValueError:
        return str(path)


def resolve_trace_ref(ref: str) -> Path:
    """The path of a trace named by :func:`trace_ref`: an existing path as given, else the
    name under the traces folder.

    :param ref: a trace name or path.
    """
    p = Path(ref)
    if p.is_absolute() or p.exists():
        return p
    return traces_dir() / p
