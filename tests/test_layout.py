"""The shape of the tree: modules that state their job, one builder of each snapshot.

The import layering itself is checked by import-linter (``lint-imports``, contracts in
pyproject.toml) and the size of functions by ruff's complexity rules (C901, PLR0915 in
pyproject.toml), both run by scripts/test.sh before pytest.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlbatch", "envs", "policies")
SOURCES = [*sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")),
           ROOT / "train.py", ROOT / "serve.py"]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", [p for p in SOURCES if p.stat().st_size > 0], ids=_rel)
def test_module_docstring_states_its_job(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert doc, f"{_rel(path)} has no module docstring"
    first = doc.strip().splitlines()[0]
    assert len(first.split()) >= 3, f"{_rel(path)}: first docstring line {first!r} is no job"


def _constructions(name: str) -> set[str]:
    found = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == name):
                found.add(_rel(path))
    return found


@pytest.mark.parametrize(("name", "where"), [
    ("DeploymentStats", {"rlbatch/serving/loop.py"}),  # the one tick loop
    ("DeploymentInfo", {"rlbatch/serving/deployment.py"}),  # the one assembly
])
def test_one_builder(name: str, where: set[str]) -> None:
    assert _constructions(name) == where


def test_one_pool_parser() -> None:
    defs = [(_rel(p), node.name) for p in SOURCES
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and "pool" in node.name
            and node.name.startswith(("parse", "_parse", "_pool_list"))]
    assert defs == [("rlbatch/engine/config.py", "parse_pools")]
