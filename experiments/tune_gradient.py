"""Tune ``gradient``'s constants on training traffic only: a grid of settings, each scored by
the geo-mean of its goodput over the best static's on every contested training run (with the
worst run and the runs with a bucket more than 5 points under the best static's attainment).

    .venv/bin/python experiments/tune_gradient.py --jobs 2
    .venv/bin/python experiments/tune_gradient.py --controller ppo:runs/x/best \
        --grid 'release.tpot_tolerance=1,1.25,inf'      # any controller's settings
    .venv/bin/python experiments/tune_gradient.py --controller 'fixed:256[order=deadline]' \
        --grid 'guard.tpot_fit=true;guard.tpot_fit_margin=0.8,0.9,1' --sla-tpot-s 0.05

Training runs: the Azure training window at the protocol's training rate scales and every
traffic family (``rlbatch.workload.families``) at loads 0.8-1.2 on the family judge's
training seed (never its judged seeds), on the first deployment. Prints the grid, best
first; the winner's settings are what ``gradient`` ships with.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies.evaluation.compare import CONTESTED, gmean, starved_buckets
from policies.evaluation.families import DRIFT, STATICS, TRAINING_SEEDS, FamilyRun
from policies.evaluation.protocol import training_runs
from rlbatch.control.specs import with_overrides
from rlbatch.control.types import SLA
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.evaluate import EvalJob, run_jobs
from rlbatch.workload.families import FAMILIES

GRID: dict[str, tuple[Any, ...]] = {
    "signal": ("p99", "misses"),
    "tpot_target": (0.8, 1.0),
    "increase": (2, 8),
    "cooldown_s": (5.0, 15.0),
}


def parse_grid(text: str) -> dict[str, tuple[str, ...]]:
    """``key=a,b;key=c`` -> ``{key: (a, b), key: (c,)}``."""
    grid = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, values = part.partition("=")
        grid[key.strip()] = tuple(v.strip() for v in values.split(",") if v.strip())
    return grid


def grid_specs(grid: dict[str, tuple[Any, ...]], controller: str = "gradient") -> list[str]:
    keys = list(grid)
    return [with_overrides(controller, [f"{k}={v}" for k, v in zip(keys, values, strict=True)])
            for values in itertools.product(*(grid[k] for k in keys))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--grid", type=parse_grid, default=GRID,
                   help="settings to cross, e.g. 'increase=4,8;cooldown_s=15,30'")
    p.add_argument("--loads", default="0.8,1.0,1.2", help="family loads")
    p.add_argument("--controller", default="gradient",
                   help="the controller whose settings the grid crosses (settings in brackets "
                        "are kept: the grid's join them)")
    p.add_argument("--sla-ttft-s", type=float, default=SLA().ttft_s)
    p.add_argument("--sla-tpot-s", type=float, default=SLA().tpot_s)
    args = p.parse_args(argv)
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"),
                          sla=SLA(args.sla_ttft_s, args.sla_tpot_s))
    candidates = grid_specs(args.grid, args.controller)
    controllers = [*STATICS, *candidates]
    workloads: list[tuple[str, EvalJob]] = []
    for rs in training_runs():
        for rate in rs.rates:
            workloads.append((f"azure@{rate:g}", EvalJob("", rs.trace, rate, replace(spec),
                                                         rs.window, None, 0, 600.0)))
    for family in (*FAMILIES, DRIFT):
        for seed in TRAINING_SEEDS:
            for load in (float(x) for x in args.loads.split(",")):
                run = FamilyRun(family, load, seed)
                workloads.append((f"{run.label}@{load:g}", EvalJob(
                    "", run.spec(args.duration_s), load, replace(spec), None, None, seed,
                    600.0)))
    jobs = [replace(job, controller=c) for _, job in workloads for c in controllers]
    rows = run_jobs(jobs, n_jobs=args.jobs, desc="tune gradient")
    by_workload: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (name, _), i in zip(workloads, range(0, len(rows), len(controllers)), strict=True):
        for row in rows[i:i + len(controllers)]:
            by_workload[name][row["controller"]] = row
    ratios: dict[str, list[float]] = defaultdict(list)
    worst: dict[str, float] = defaultdict(lambda: math.inf)
    starved: dict[str, int] = defaultdict(int)
    contested = 0
    for runs in by_workload.values():
        best = max((runs[s] for s in STATICS), key=lambda r: float(r["goodput_rps"]))
        if not CONTESTED[0] <= float(best["sla_attainment"] or 0) <= CONTESTED[1]:
            continue
        contested += 1
        for c in candidates:
            ratio = float(runs[c]["goodput_rps"]) / float(best["goodput_rps"])
            ratios[c].append(ratio)
            worst[c] = min(worst[c], ratio)
            starved[c] += bool(starved_buckets(runs[c], best))
    print(f"{contested} contested training runs of {len(by_workload)}")
    for c in sorted(candidates, key=lambda c: -gmean(ratios[c])):
        print(f"{gmean(ratios[c]):.3f}  worst {worst[c]:.2f}  starved {starved[c]}  {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
