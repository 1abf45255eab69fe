#!/usr/bin/env bash
# The test command: set up .venv, lint, type-check, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy rlbatch envs policies train.py serve.py
exec .venv/bin/python -m pytest -q "$@"
