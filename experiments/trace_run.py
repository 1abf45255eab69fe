"""Side-by-side per-tick trace of controllers on one run of the evaluation protocol.

    .venv/bin/python experiments/trace_run.py --run azure --rate-scale 2.125 --pools fp16:1,fp8:1 \
        --from-s 40 --to-s 160 --every 5 mpc ppo:policies/two-pool

Each controller serves the same protocol run (the held-back Azure window or Mooncake, at one
of the protocol's rate scales, on the deployment of ``--pools``, ``--gpu`` and ``--model``).
Every ``--every`` ticks from ``--from-s`` to ``--to-s`` it prints, per controller, the action
in force (engine-wide ``max_num_seqs`` and the per-bucket caps), the admission queues per
bucket and the requests held by each engine. It is how BENCHMARKS.md (issue 14, stop 12)
found when the two-pool student lowers its total against its teacher.
"""

from __future__ import annotations

import argparse

import policies.evaluation.protocol as protocol
from rlbatch.control.controllers import make_controller
from rlbatch.control.types import DeploymentStats
from rlbatch.serving.run import run


def _row(stats: DeploymentStats) -> str:
    action = stats.action
    held = [e.running_total + e.waiting_total for e in stats.engines]
    return (f"seqs={action.max_num_seqs} caps={action.caps} queued={stats.queued} "
            f"held={held}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("controllers", nargs="+", help="controller specs, as for evaluate")
    p.add_argument("--from-s", type=float, default=0.0, help="first tick time printed")
    p.add_argument("--to-s", type=float, default=600.0, help="last tick time printed")
    p.add_argument("--every", type=int, default=5, help="print every N ticks")
    protocol.add_run_options(p)
    args = p.parse_args()
    if args.every < 1:
        p.error(f"--every must be >= 1, got {args.every}")
    spec, _, workload = protocol.run_from_args(p, args)
    traces: dict[str, list[DeploymentStats]] = {}
    for spec_text in args.controllers:
        ticks: list[DeploymentStats] = []
        run(workload, make_controller(spec_text), spec, rate_scale=args.rate_scale,
            on_tick=ticks.append)
        traces[spec_text] = ticks
    print("time_s | " + " | ".join(args.controllers))
    for i in range(0, min(len(t) for t in traces.values()), args.every):
        now = traces[args.controllers[0]][i].time_s
        if args.from_s <= now <= args.to_s:
            print(f"{now:6.0f} | " + " | ".join(_row(traces[c][i]) for c in args.controllers))


if __name__ == "__main__":
    main()
