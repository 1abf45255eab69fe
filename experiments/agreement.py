"""How often a student decides as its teacher would, on the states the student itself reaches.

    .venv/bin/python experiments/agreement.py runs/s13/v4-s1/best --run mooncake \
        --rate-scale 1.875 --pools fp16:1,fp8:1

The student drives one run of the evaluation protocol behind its guard; at every decision the
teacher (``--teacher``, bound to the same deployment, as in a DAgger round) says what it would
do there. Prints the share of decisions where the two agree on the total, on every bucket's
share, and on everything, then (``--every``) the decisions side by side. Stop 14 of issue 14
found with it that a student cloned on Azure traffic agrees with its teacher on 2% of the
totals on Mooncake, whose prompts are 60% of 4k tokens or more: it was extrapolating. A
student with the range it was fitted on (``obs_range``: ``train.py --obs-clip``,
``experiments/clip_run.py``) also gets the features its decisions saw outside that range.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import policies.evaluation.protocol as protocol
from policies.ppo import ppo_factory
from policies.training.distill import student_labeller
from rlbatch.serving.run import run

OUTSIDE_SHOWN = 0.05
"""Features outside the fitted range in at least this share of decisions are listed."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("student", type=Path, help="a total/share student artifact folder")
    p.add_argument("--teacher", default="mpc", help="the labelling controller spec")
    p.add_argument("--every", type=int, default=0,
                   help="print every N-th decision side by side (0: only the shares)")
    protocol.add_run_options(p)
    args = p.parse_args()
    spec, run_set, workload = protocol.run_from_args(p, args)
    try:
        student = ppo_factory(str(args.student), {})
        labeller = student_labeller(student, args.teacher)
    except ValueError as e:
        p.error(str(e))
    meta, codec = student.artifact.metadata, labeller.codec
    times: list[float] = []
    run(workload, labeller, spec, rate_scale=args.rate_scale,
        on_tick=lambda s: times.append(s.time_s))
    demos = labeller.take()
    mine = np.array([student.artifact.act(o) for o in demos.obs]).reshape(demos.actions.shape)
    theirs = demos.actions
    shares = np.all(mine[:, 1::2] == theirs[:, 1::2], axis=1)
    print(f"{args.student} vs {args.teacher} on {protocol.run_label(run_set)} at "
          f"{args.rate_scale:g}: {len(mine)} decisions; agree on the total "
          f"{np.mean(mine[:, 0] == theirs[:, 0]):.1%}, on every share {np.mean(shares):.1%}, "
          f"on everything {np.mean(np.all(mine == theirs, axis=1)):.1%}")
    bounds = meta.get("obs_range")
    if bounds is not None:
        low, high = np.array(bounds["low"]), np.array(bounds["high"])
        beyond = (demos.obs < low) | (demos.obs > high)
        outside = np.mean(beyond, axis=0)
        print(f"decisions with a feature outside the range the student was fitted on "
              f"(clipped into it): {np.mean(np.any(beyond, axis=1)):.1%}")
        for i in np.argsort(-outside):
            if outside[i] < OUTSIDE_SHOWN:
                break
            print(f"  {meta['feature_names'][i]}: {outside[i]:.0%} outside "
                  f"[{low[i]:.3g}, {high[i]:.3g}], up to {demos.obs[:, i].max():.3g}")
    if args.every > 0:
        decision_s = times[::student.decision_ticks]
        print("time_s | student total (shares) | teacher total (shares)")
        for i in range(0, len(mine), args.every):
            a, b = codec.decode(mine[i]), codec.decode(theirs[i])
            print(f"{decision_s[i]:6.0f} | {a.max_num_seqs} {a.caps} | "
                  f"{b.max_num_seqs} {b.caps}")


if __name__ == "__main__":
    main()
