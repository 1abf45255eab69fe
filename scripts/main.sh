#!/usr/bin/env bash
# The main job: set up .venv, train a policy on the embedded simulator (train.py defaults:
# the mpc teacher, a behaviour-cloned student, DAgger, PPO fine-tuning), then print the
# comparison on traffic it never saw. The teacher episodes and the comparison grid run as
# tasks of a local Ray cluster (one per core; the same rows as without --ray), so that the
# job uses every core: under 30 minutes on 2 cores (BENCHMARKS.md, issue 14, stop 22).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python train.py --ray --out "runs/main-$(date +%Y%m%d-%H%M%S)" "$@"
