"""How fast this machine runs the same instructions over time, apart from any engine.

    .venv/bin/python experiments/cpu_speed_probe.py runs/probe.txt &   # then the job to watch
    .venv/bin/python experiments/cpu_speed_probe.py --summary 20 runs/probe.txt

Once a second, on one thread, it times a fixed compute-bound block (twenty 256 x 256 float32
matmuls, in the caches) and a memory-bound one (a 64 MiB copy), and appends ``unix time,
matmul ms, copy ms`` to the file. Its duty cycle is about 1 %, so it barely disturbs a job on
the other core. BENCHMARKS.md (issue 12, item 4, stop 21) ran it beside ``rlbatch fidelity``
to tell a live engine whose speed moved from a machine whose speed moved: ``--summary S``
prints, per S-second window, the mean and the best of each block.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _probe(path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy as np  # after the thread settings, which numpy reads when loaded

    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    big = np.ones(8 * 2**20, dtype=np.float64)
    with path.open("a", encoding="utf-8", buffering=1) as out:
        while True:
            start = time.perf_counter()
            for _ in range(20):
                a @ a
            matmul_s = time.perf_counter() - start
            start = time.perf_counter()
            big.copy()
            copy_s = time.perf_counter() - start
            out.write(f"{time.time():.3f} {matmul_s * 1e3:.3f} {copy_s * 1e3:.3f}\n")
            time.sleep(max(0.0, 1.0 - matmul_s - copy_s))


def _summary(path: Path, window_s: float) -> None:
    # a line the probe is still writing has fewer fields
    rows = [tuple(float(v) for v in fields) for fields in
            (line.split() for line in path.read_text().splitlines()) if len(fields) == 3]
    if not rows:
        sys.exit(f"{path}: no samples")
    t0 = rows[0][0]
    windows: dict[int, list[tuple[float, float]]] = {}
    for t, matmul_ms, copy_ms in rows:
        windows.setdefault(int((t - t0) // window_s), []).append((matmul_ms, copy_ms))
    print("from_s  matmul_mean_ms  matmul_best_ms  copy_mean_ms  copy_best_ms")
    for k in sorted(windows):
        ms = [m for m, _ in windows[k]]
        cs = [c for _, c in windows[k]]
        print(f"{k * window_s:6.0f}  {sum(ms) / len(ms):14.2f}  {min(ms):14.2f}  "
              f"{sum(cs) / len(cs):12.1f}  {min(cs):12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="samples file (appended to)")
    parser.add_argument("--summary", type=float, default=None, metavar="S",
                        help="print the samples per S-second window instead of probing")
    args = parser.parse_args()
    if args.summary is not None:
        if args.summary <= 0:
            parser.error("--summary must be > 0")
        _summary(args.path, args.summary)
    else:
        _probe(args.path)


if __name__ == "__main__":
    main()
