"""Benchmark the main job's comparison grid serial vs on a local Ray cluster (issue 11).

    .venv/bin/python benchmarks/bench_ray.py              # 63 runs: serial, then --ray
    .venv/bin/python benchmarks/bench_ray.py --pool       # also the 2-process pool
    .venv/bin/python benchmarks/bench_ray.py --grid main  # train.py's whole comparison

The grid is the comparison on traffic no policy trained on (:mod:`policies.evaluation.protocol`):
the static caps 4-256, the playbook and the shipped policy on the held-back Azure window at 4 rates
and Mooncake at 3 (9 controllers x 7 runs = 63). ``--grid main`` is what ``train.py`` now runs after
training: the training runs for the user's pick too, and ``mpc`` as a second candidate (102 runs).
Prints wall times, the speed-up, Ray's start-up cost (cluster start; worker start-up is inside the
Ray grid time) and whether the rows are identical (wall-clock fields aside); exits 1 if they are
not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policies.evaluation.protocol import protocol_jobs, training_runs, unseen_runs  # noqa: E402
from policies.training.recipe import RecipeConfig  # noqa: E402
from rlbatch.scale import LOCAL, connect  # noqa: E402
from rlbatch.scale.cluster import shutdown  # noqa: E402
from rlbatch.tools.evaluate import EvalJob, comparable_rows, run_jobs  # noqa: E402
from rlbatch.tools.report import write_json  # noqa: E402


def grid(which: str, policy: str) -> list[EvalJob]:
    """The jobs of the benchmark grid.

    :param which: ``unseen`` (63 runs) or ``main`` (train.py's comparison, 102 runs).
    :param policy: the candidate's artifact folder.
    """
    spec = RecipeConfig().spec()
    if which == "unseen":
        return protocol_jobs([f"ppo:{policy}"], spec, unseen_runs())
    return [*protocol_jobs([], spec, training_runs()),
            *protocol_jobs([f"ppo:{policy}", "mpc"], spec, unseen_runs())]


def timed(label: str, jobs: list[EvalJob], **kwargs: Any) -> tuple[list[dict[str, Any]], float]:
    start = time.perf_counter()
    rows = run_jobs(jobs, quiet=True, desc=label, **kwargs)
    wall = time.perf_counter() - start
    print(f"{label:>8}: {wall:7.1f} s", flush=True)
    return rows, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=("unseen", "main"), default="unseen")
    p.add_argument("--policy", default="policies/default", help="the candidate artifact")
    p.add_argument("--limit", type=int, default=None, help="first N runs only (smoke test)")
    p.add_argument("--pool", action="store_true", help="also time the 2-process pool")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--rows", type=Path, default=None,
                   help="write both row sets here (serial.json, ray.json)")
    args = p.parse_args(argv)
    jobs = grid(args.grid, args.policy)[:args.limit]
    cores = os.cpu_count()
    print(f"grid: {len(jobs)} runs ({args.grid}); {cores} cores; load average before "
          f"{os.getloadavg()}", flush=True)
    serial, serial_s = timed("serial", jobs)
    figures: dict[str, Any] = {"runs": len(jobs), "cores": cores, "serial_s": serial_s}
    # The grid's critical path: no number of cores finishes it faster than its longest run.
    walls = sorted((float(r["wall_seconds"]) for r in serial), reverse=True)
    figures.update(run_sum_s=sum(walls), run_max_s=walls[0],
                   cores_wanted=math.ceil(sum(walls) / walls[0]))
    print(f"runs: {figures['run_sum_s']:.1f} s in all, longest {walls[0]:.1f} s: more than "
          f"{figures['cores_wanted']} cores cannot help", flush=True)
    if args.pool:
        pooled, figures["pool_s"] = timed("pool", jobs, n_jobs=2)
        figures["pool_identical"] = comparable_rows(pooled) == comparable_rows(serial)
    start = time.perf_counter()
    figures["ray_start_s"] = connect(LOCAL)
    print(f"ray start: {figures['ray_start_s']:5.1f} s (local cluster, "
          f"{cores} CPU slots)", flush=True)
    on_ray, figures["ray_grid_s"] = timed("ray", jobs, ray=LOCAL)
    figures["ray_total_s"] = time.perf_counter() - start
    shutdown()
    figures["speedup_x"] = serial_s / figures["ray_total_s"]
    figures["speedup_grid_only_x"] = serial_s / figures["ray_grid_s"]
    figures["identical"] = comparable_rows(on_ray) == comparable_rows(serial)
    if args.rows:
        args.rows.mkdir(parents=True, exist_ok=True)
        write_json(args.rows / "serial.json", serial)
        write_json(args.rows / "ray.json", on_ray)
    figures["errors"] = sum(1 for r in on_ray if "error" in r)
    figures["load_after"] = os.getloadavg()
    print(f"speed-up {figures['speedup_x']:.2f}x including Ray's start "
          f"({figures['speedup_grid_only_x']:.2f}x grid only); rows identical: "
          f"{figures['identical']}; error rows: {figures['errors']}; load average after "
          f"{figures['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["identical"] and not figures["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
