#!/usr/bin/env bash
# Bit-identical evaluate rows between a git ref and the working tree (refactors must not move
# a number). The grid covers every controller kind and discipline, light load to collapsed:
#   one pool (a100-80g / llama-2-7b), both shipped traces (10-minute windows) at rate scales
#   0.5, 1, 2, 4: static:16, vllm-default, playbook, playbook:literal, aimd, random:1,
#   fixed per-bucket caps with the halve fallback, fixed:256 in deadline order, fixed
#   without a KV budget, fixed counting the final KV, ppo:policies/default (deadline order
#   and hold release, as served), the same in FIFO without release, mpc, mpc unguarded;
#   two pools (fp16:1,fp8:1) on the Azure trace at 1 and 2: ppo:policies/two-pool,
#   fixed:256 in deadline order, mpc.
# The REF's grid and this tree's run side by side (one core each); rows are compared field
# by field except the wall-clock ones (wall_seconds, speedup_x, mpc's decision times).
#   bash benchmarks/parity.sh HEAD       # before committing a refactor
# A REF that spells controllers otherwise gets its own lists (the rows' names then differ
# and are not compared), e.g. against the string options of before typed settings:
#   BASE_ONE_POOL='static:16,...,fixed:256:order=deadline,...' BASE_TWO_POOL='...' \
#       bash benchmarks/parity.sh cd416e3
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: benchmarks/parity.sh GIT_REF}
here=$(pwd)
traces=${RLBATCH_TRACES_DIR:-$here/../shared/data/traces}
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/base" "$ref"
one_pool='static:16,vllm-default,playbook,playbook:literal,aimd,random:1'
one_pool+=',fixed:64/64/16/8[guard.p99_fallback=halve],fixed:256[order=deadline]'
one_pool+=',fixed:128[guard.kv_budget=none],fixed:96[guard.kv_budget.commit=final]'
one_pool+=',ppo:policies/default,ppo:policies/default[order=fifo,release=none],mpc'
one_pool+=',mpc[guarded=false]'
two_pool='ppo:policies/two-pool,fixed:256[order=deadline],mpc'
base_one=${BASE_ONE_POOL:-$one_pool}
base_two=${BASE_TWO_POOL:-$two_pool}
names=$([ "$base_one$base_two" = "$one_pool$two_pool" ] && echo same || echo differ)
grid() {  # $1 = tree to run, $2 = output prefix, $3 / $4 = the one- / two-pool lists
    (cd "$1" && export RLBATCH_TRACES_DIR=$traces PYTHONPATH=$1 \
        && "$here/.venv/bin/python" -m rlbatch evaluate \
            --trace "$traces/azure_conv_2023.csv" "$traces/mooncake_synthetic.jsonl" \
            --window 0:600 --controllers "$3" --rate-scale 0.5,1,2,4 \
            --quiet --json "$2-one.json" >/dev/null \
        && "$here/.venv/bin/python" -m rlbatch evaluate \
            --trace "$traces/azure_conv_2023.csv" --window 0:600 --pools fp16:1,fp8:1 \
            --controllers "$4" --rate-scale 1,2 --quiet --json "$2-two.json" \
            >/dev/null)
}
grid "$tmp/base" "$tmp/base" "$base_one" "$base_two" &
base_pid=$!
grid "$here" "$tmp/here" "$one_pool" "$two_pool"
wait "$base_pid"
"$here/.venv/bin/python" - "$tmp" "$names" <<'PY'
import json, sys
volatile = {"wall_seconds", "speedup_x", "mpc_decision_ms_mean", "mpc_decision_ms_p95"}
if sys.argv[2] == "differ":
    volatile.add("controller")
tmp = sys.argv[1]
rows = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]
load = lambda side: [r for part in ("one", "two")
                     for r in json.load(open(f"{tmp}/{side}-{part}.json"))]
a, b = rows(load("base")), rows(load("here"))
if a == b:
    print(f"parity: {len(a)} rows identical")
    sys.exit(0)
if len(a) != len(b):
    print(f"parity: {len(a)} rows -> {len(b)}")
for x, y in zip(a, b):
    for k in sorted(set(x) | set(y)):
        if x.get(k) != y.get(k):
            print(f"DIFF {x.get('controller')} {x.get('trace')} {x.get('rate_scale')} "
                  f"{x.get('pools')} {k}: {x.get(k)!r} -> {y.get(k)!r}")
print("parity: rows differ")
sys.exit(1)
PY
