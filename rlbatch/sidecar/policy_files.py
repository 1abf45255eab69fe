"""Policy artifacts the sidecar may load: confined to configured folders, size-checked first.

A ``ppo:PATH`` controller reads ``PATH/policy.json`` and ``PATH/policy.safetensors``. Before
anything reads them the sidecar checks, without opening them: the path is a folder, both files
are regular files (a link to ``/dev/zero`` or a FIFO is not) and neither is larger than
``max_policy_bytes``. A policy named through ``POST /admin/controller`` must moreover resolve
(symbolic links followed) to a folder under one of the configured ``policy_dirs``; any other
path gets the same answer whether it exists or not, so the endpoint is no file oracle.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rlbatch.control.specs import spec_preset

POLICY_FILES: tuple[str, ...] = ("policy.json", "policy.safetensors")
"""The files of a policy artifact (:mod:`policies.artifact`)."""

OUTSIDE = "policy paths must lie under the allowed policy folders (--policy-dir)"


class PolicyPathError(ValueError):
    """A policy path the sidecar refuses to read; the message names why."""


def check_policy_path(path: Path, max_bytes: int) -> None:
    """Refuse a policy artifact that is not a folder of two regular, small enough files, or
    the ``policy.json`` of one (the controller factory reads either).

    Only ``stat`` calls: nothing is opened or read.

    :param path: the artifact folder, or its JSON file.
    :param max_bytes: largest size of each file.
    :raises PolicyPathError: what is wrong.
    """
    try:
        info = os.stat(path)
    except OSError:
        raise PolicyPathError(f"policy artifact not found at {path}") from None
    if stat.S_ISDIR(info.st_mode):
        files = tuple(path / name for name in POLICY_FILES)
    elif stat.S_ISREG(info.st_mode):
        files = (path, path.parent / POLICY_FILES[1])
    else:
        raise PolicyPathError(f"policy path {path} is not a folder (an artifact is a folder "
                              f"with {' and '.join(POLICY_FILES)}) nor a regular file")
    for file in files:
        try:
            info = os.stat(file)
        except OSError:
            raise PolicyPathError(f"policy artifact not found at {path}: no "
                                  f"{file.name}") from None
        if not stat.S_ISREG(info.st_mode):
            raise PolicyPathError(f"{file} is not a regular file")
        if info.st_size > max_bytes:
            raise PolicyPathError(f"{file} is larger than {max_bytes} bytes "
                                  f"({info.st_size}); raise --max-policy-bytes to load it")


def confined_policy(text: str, allowed: tuple[Path, ...]) -> Path:
    """The resolved folder of ``ppo:text`` when it lies under an allowed folder.

    :param text: the path as the client sent it.
    :param allowed: the allowed folders (absolute).
    :raises PolicyPathError: outside every allowed folder (or none is configured); the
        message is the same whatever the path names.
    """
    try:
        resolved = Path(text).resolve(strict=False)
    except (OSError, RuntimeError, ValueError):
        raise PolicyPathError(OUTSIDE) from None
    for folder in allowed:
        try:
            root = folder.resolve(strict=True)
        except OSError:
            continue
        if resolved != root and resolved.is_relative_to(root):
            return resolved
    raise PolicyPathError(OUTSIDE)


def policy_path_of(spec: str) -> str | None:
    """The path of a ``ppo:PATH`` controller spec (``None`` for other controllers).

    :param spec: a controller spec (settings in brackets allowed).
    :raises ValueError: brackets out of place.
    """
    kind, sep, rest = spec_preset(spec).partition(":")
    return rest if sep and kind == "ppo" else None
