#!/usr/bin/env bash
# The test command: set up .venv, lint, type-check, check the layering contracts
# ([tool.importlinter] in pyproject.toml: layers, no import cycles), run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy rlbatch envs policies train.py serve.py
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q "$@"
