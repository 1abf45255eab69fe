"""How large the configuration surface is: distinct command-line flags (and the files that
define them), settings dataclasses and their fields. Counts the tree at a git revision, so a
change can be compared with the one before; the working tree's count includes the flags the
sidecar derives from its settings' fields.

    .venv/bin/python experiments/config_surface.py [REV]    # default: the working tree
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_CLASS = re.compile(r"(Config|Spec|Settings)$")


def _sources(rev: str | None) -> Iterator[tuple[str, str]]:
    if rev is None:
        paths = [p for p in ROOT.rglob("*.py")
                 if ".venv" not in p.parts and "tests" not in p.parts]
        for p in paths:
            yield p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")
        return
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith(".py") and not name.startswith("tests/"):
            yield name, subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout


def count(rev: str | None) -> dict[str, int]:
    """The counts (hand-written flags: ``add_argument("--...")`` calls with a literal name)."""
    flags: set[str] = set()
    flag_files: set[str] = set()
    classes = fields = 0
    for name, text in _sources(rev):
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                found = [a.value for a in node.args if isinstance(a, ast.Constant)
                         and isinstance(a.value, str) and a.value.startswith("--")]
                if found:
                    flags.update(found)
                    flag_files.add(name)
            if isinstance(node, ast.ClassDef) and SETTINGS_CLASS.search(node.name):
                classes += 1
                fields += sum(isinstance(s, ast.AnnAssign) for s in node.body)
    out = {"hand-written flags": len(flags)}
    if rev is None:  # flags derived from dataclass fields exist only in the parsers
        out["flags with the derived ones"] = len(flags | _derived_flags())
    return {**out, "files with flags": len(flag_files),
            "settings classes": classes, "settings fields": fields}


def _derived_flags() -> set[str]:
    """The flags of the parsers that derive flags from settings fields (the sidecar's)."""
    import argparse

    from rlbatch.commands.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {s for s in parser._option_string_actions if s.startswith("--")} - {"--help"}


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else None
    for key, value in count(rev).items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
