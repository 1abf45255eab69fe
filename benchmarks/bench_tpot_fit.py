"""How well observation version 7's TPOT fit predicts the TPOT a fixed total gives.

    .venv/bin/python benchmarks/bench_tpot_fit.py
    .venv/bin/python benchmarks/bench_tpot_fit.py --totals 16,48 --families rag,report \
        --gpu a100-80g --model llama-2-7b --sla-tpot-s 0.05 --duration-s 300 --seed 7001

Runs each traffic family at load 1 under ``fixed:N[order=deadline]`` for each total and
prints one markdown table: the median over ticks (after the first minute) of the TPOT the
fit predicts at the running batch from the smoothed readings the observation sees, the
median TPOT of the finished requests, their ratio, the median running batch, and the largest
total of the ladder the fit says meets the SLA's TPOT (what the student reads).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from rlbatch.control.controllers import make_controller
from rlbatch.control.observation import ObservationBuilder
from rlbatch.control.tpot_fit import TPOT_FIT_LADDER
from rlbatch.control.types import SLA, DeploymentStats
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.families import FAMILIES, family_workload

WARMUP_S = 60.0


def measure(family: str, total: int, spec: DeploymentSpec, duration_s: float,
            seed: int) -> dict[str, Any]:
    """One run of ``family`` under a fixed total; the fit's prediction against the run."""
    controller = make_controller(f"fixed:{total}[order=deadline]")
    builders: list[ObservationBuilder] = []
    predicted: list[float] = []
    measured: list[float] = []
    running: list[int] = []
    largest: list[int] = []

    def on_tick(stats: DeploymentStats) -> None:
        if not builders:  # the controller knows the deployment once the run has started
            builders.append(ObservationBuilder(controller.info, 256, version=7))  # type: ignore[attr-defined]
        builder = builders[0]
        builder.build(stats, (0.0,) * 5)
        fit = builder.tpot_fit
        assert fit is not None
        if stats.time_s > WARMUP_S:
            inputs = builder.tpot_fit_inputs(len(stats.engines))
            predicted.append(fit.tpot_s_at(max(stats.running_total, 1), *inputs))
            running.append(stats.running_total)
            fits = round(fit.share(*inputs) * len(TPOT_FIT_LADDER))
            largest.append(TPOT_FIT_LADDER[fits - 1] if fits else 0)
        measured.extend(r.tpot_s for r in stats.finished
                        if not r.rejected and r.output_tokens > 1)

    run(family_workload(family, 1.0, duration_s, seed), controller, spec, on_tick=on_tick)
    p, m = float(np.median(predicted)), float(np.median(measured))
    return {"family": family, "total": total, "predicted_tpot_p50_s": p,
            "measured_tpot_p50_s": m, "ratio": p / m, "running_p50": float(np.median(running)),
            "largest_fitting_total_p50": float(np.median(largest))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="chat,code,rag,report",
                   help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--totals", default="16,48,128", help="comma-separated fixed totals")
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--sla-ttft-s", type=float, default=1.0)
    p.add_argument("--sla-tpot-s", type=float, default=0.05)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=7001)
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    try:
        totals = [int(x) for x in args.totals.split(",") if x]
    except ValueError:
        p.error(f"--totals takes comma-separated integers, got {args.totals!r}")
    spec = DeploymentSpec(gpu=args.gpu, model=args.model,
                          admission=AdmissionConfig(over_length="truncate"),
                          sla=SLA(args.sla_ttft_s, args.sla_tpot_s))
    print("| family | total | predicted TPOT p50 (s) | measured TPOT p50 (s) | predicted / "
          "measured | running p50 | largest fitting total p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for family in families:
        for total in totals:
            r = measure(family, total, spec, args.duration_s, args.seed)
            print(f"| {family} | {total} | {r['predicted_tpot_p50_s']:.4f} | "
                  f"{r['measured_tpot_p50_s']:.4f} | {r['ratio']:.2f} | "
                  f"{r['running_p50']:.0f} | {r['largest_fitting_total_p50']:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
