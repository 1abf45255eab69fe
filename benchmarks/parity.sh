#!/usr/bin/env bash
# Bit-identical evaluate rows between a git ref and the working tree (refactors must not move
# a number): the same grid (static:16, playbook, ppo:policies/default on both shipped traces at
# rate scales 0.5, 1, 2) run from a worktree of REF and from here; rows compared field by
# field except wall_seconds / speedup_x.
#   bash benchmarks/parity.sh 707952a     # the commit before issue 10's refactor
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: benchmarks/parity.sh GIT_REF}
here=$(pwd)
traces=${RLBATCH_TRACES_DIR:-$here/../shared/data/traces}
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/base" "$ref"
grid() {  # $1 = tree to run, $2 = output JSON
    (cd "$1" && RLBATCH_TRACES_DIR=$traces PYTHONPATH=$1 "$here/.venv/bin/python" -m rlbatch \
        evaluate --trace "$traces/azure_conv_2023.csv" "$traces/mooncake_synthetic.jsonl" \
        --controllers 'static:16,playbook,ppo:policies/default' --rate-scale 0.5,1,2 \
        --quiet --json "$2" >/dev/null)
}
grid "$tmp/base" "$tmp/base.json"
grid "$here" "$tmp/here.json"
"$here/.venv/bin/python" - "$tmp/base.json" "$tmp/here.json" <<'PY'
import json, sys
volatile = {"wall_seconds", "speedup_x"}
a, b = (json.load(open(p)) for p in sys.argv[1:3])
rows = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]
if rows(a) == rows(b):
    print(f"parity: {len(a)} rows identical")
    sys.exit(0)
for x, y in zip(rows(a), rows(b)):
    for k in sorted(set(x) | set(y)):
        if x.get(k) != y.get(k):
            print(f"DIFF {x.get('controller')} {x.get('trace')} {x.get('rate_scale')} {k}: "
                  f"{x.get(k)!r} -> {y.get(k)!r}")
print("parity: rows differ")
sys.exit(1)
PY
