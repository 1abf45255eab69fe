#!/usr/bin/env bash
# The main job: set up .venv, then compare the baseline controllers on the shipped Azure trace
# from light load to overload (PPO training replaces this once train.py exists).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
TRACES=${RLBATCH_TRACES_DIR:-../shared/data/traces}
exec .venv/bin/python -m rlbatch evaluate \
    --trace "$TRACES/azure_conv_2023.csv" \
    --controllers 'static:{4,8,16,32},vllm-default' \
    --rate-scale 1,2,3,4 --jobs 2 --json runs/evaluate_azure.json "$@"
