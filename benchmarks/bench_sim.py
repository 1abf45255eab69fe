"""Simulator speed: simulated seconds per wall second on a whole trace, event skipping on/off.

    .venv/bin/python benchmarks/bench_sim.py [--trace FILE] [--controller static:16]

Both runs happen in this process one after the other (same machine state), and the result
rows are checked to be identical, so the ratio is a like-for-like figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from rlbatch.control.controllers import make_controller
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/azure_conv_2023.csv"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--controller", default="static:16")
    parser.add_argument("--gpu", default="a100-80g")
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for the skipping run")
    args = parser.parse_args()
    t0 = time.perf_counter()
    workload = load_trace(args.trace, rate_scale=args.rate_scale)
    load_s = time.perf_counter() - t0
    spec = DeploymentSpec(gpu=args.gpu, model=args.model)
    print(f"{workload.describe()}\nload {load_s * 1e3:.0f} ms; python {platform.python_version()}"
          f"; cpus visible {os.cpu_count()}")
    results = {}
    for skipping, repeat in ((True, args.repeat), (False, 1)):
        best = None
        for _ in range(repeat):
            res = run(workload, make_controller(args.controller),
                      DeploymentSpec(**{**spec.__dict__, "event_skipping": skipping}))
            if best is None or res.row["wall_seconds"] < best.row["wall_seconds"]:
                best = res
        assert best is not None
        results[skipping] = best
        row = best.row
        print(f"event_skipping={skipping!s:5}  sim {row['sim_seconds']:.0f} s  wall "
              f"{row['wall_seconds']:.2f} s  -> {row['speedup_x']:.0f}x real time  "
              f"(completed {row['completed']}, preemptions {row['preemptions']})")
    same = {r.request_id: r.comparable() for r in results[True].records} == {
        r.request_id: r.comparable() for r in results[False].records}
    ratio = results[False].row["wall_seconds"] / results[True].row["wall_seconds"]
    print(f"identical request timings: {same}; event skipping is {ratio:.1f}x faster")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
