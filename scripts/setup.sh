#!/usr/bin/env bash
# Creates .venv/ in the repo root and installs everything rlbatch needs (idempotent).
# On these CPU machines torch==2.13.0 is the CPU wheel pip finds on local disk; an unpinned
# torch would pull a multi-GB CUDA build. A GPU host installs `vllm` (with its CUDA torch) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.rlbatch-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[rl,dev]"
    rm -f .venv/.rlbatch-setup-*
    touch "$stamp"
fi
