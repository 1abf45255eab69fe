"""How much slower than the TPOT fit the engine's iterations run, per traffic family, and what
the guard's ``tpot_fit`` rule holds with and without its calibration.

    .venv/bin/python benchmarks/bench_fit_calibration.py
    .venv/bin/python benchmarks/bench_fit_calibration.py --families code,rag,report \
        --sla-ttft-s 1 --sla-tpot-s 0.05 --load 1 --duration-s 600 --seed 11

Runs each family under ``fixed:256[order=deadline]`` behind three variants of the rule:
today's default (calibrated, with the spread allowance), the calibration alone (no spread,
margin 0.85) and the profile's prediction alone (``tpot_fit_calibrated=false``,
``tpot_fit_spread=0``, margin 0.85: the rule before its calibration). Prints one markdown
table: goodput, SLA attainment, TPOT P99, the median total in force, and the slowdown the
rule scaled the prediction by (the engine's mean iteration time over the fit's prediction at
its running count, smoothed, times the spread allowance where it is on) at the 10th, 50th
and 90th percentile of the ticks.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from rlbatch.control.controllers import make_controller
from rlbatch.control.types import SLA, DeploymentStats
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.families import FAMILIES, family_workload

RULES = {
    "calibrated": "fixed:256[order=deadline,guard.tpot_fit=true]",
    "calibration only": ("fixed:256[order=deadline,guard.tpot_fit=true,"
                         "guard.tpot_fit_spread=0,guard.tpot_fit_margin=0.85]"),
    "profile only": ("fixed:256[order=deadline,guard.tpot_fit=true,"
                     "guard.tpot_fit_calibrated=false,guard.tpot_fit_spread=0,"
                     "guard.tpot_fit_margin=0.85]"),
}


def measure(family: str, rule: str, spec: DeploymentSpec, load: float, duration_s: float,
            seed: int) -> dict[str, float]:
    """One run of ``family`` behind one variant of the rule."""
    controller = make_controller(RULES[rule])
    pipeline = controller.pipeline
    if pipeline is None:
        raise RuntimeError(f"{RULES[rule]} has no guard")
    totals: list[int] = []
    slowdowns: list[float] = []

    def on_tick(stats: DeploymentStats) -> None:
        totals.append(stats.action.max_num_seqs or 0)
        slowdowns.append(pipeline.guard.state.tpot_fit_slowdown)

    result = run(family_workload(family, load, duration_s, seed), controller, spec,
                 on_tick=on_tick)
    p10, p50, p90 = np.percentile(slowdowns, [10, 50, 90]) if slowdowns else (np.nan,) * 3
    return {"goodput": float(result.row["goodput_rps"]),
            "attainment": float(result.row["sla_attainment"]),
            "tpot_p99": float(result.row["tpot_p99_s"]),
            "total": float(np.median(totals)) if totals else float("nan"),
            "p10": float(p10), "p50": float(p50), "p90": float(p90)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", default="code,rag,report", help="traffic families")
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--sla-ttft-s", type=float, default=1.0)
    p.add_argument("--sla-tpot-s", type=float, default=0.05)
    p.add_argument("--load", type=float, default=1.0, help="load in the family's units")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=11, help="the family judge's training seed")
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose among {', '.join(FAMILIES)}")
    spec = DeploymentSpec(gpu=args.gpu, model=args.model,
                          admission=AdmissionConfig(over_length="truncate"),
                          sla=SLA(args.sla_ttft_s, args.sla_tpot_s))
    print(f"{args.gpu} / {args.model}, SLA {args.sla_ttft_s:g} s / "
          f"{args.sla_tpot_s * 1000:g} ms, load {args.load:g}, {args.duration_s:g} s, "
          f"seed {args.seed}\n")
    print("| family | rule | goodput/s | SLA attainment | TPOT P99 (s) | median total | "
          "slowdown p10 / p50 / p90 |")
    print("|---|---|---:|---:|---:|---:|---|")
    for family in families:
        for rule in RULES:
            m = measure(family, rule, spec, args.load, args.duration_s, args.seed)
            print(f"| {family} | {rule} | {m['goodput']:.3f} | {m['attainment']:.3f} | "
                  f"{m['tpot_p99']:.3f} | {m['total']:g} | {m['p10']:.2f} / {m['p50']:.2f} / "
                  f"{m['p90']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
