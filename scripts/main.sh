#!/usr/bin/env bash
# The main job: set up .venv, train PPO on the embedded simulator (defaults finish in 10-17
# minutes on 2 cores), then print the comparison with every baseline on both traces.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python train.py --out "runs/main-$(date +%Y%m%d-%H%M%S)" "$@"
