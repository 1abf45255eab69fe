"""How far the recipe's training episodes reach into a feature's range, and where a student's
own decisions on an unseen run sit.

    .venv/bin/python experiments/coverage.py --episodes 6 --mix-share 1 --mix-load 1,2.5 \
        --pools fp16:1,fp8:1 --student runs/s13/v4-s1/best --run mooncake --rate-scale 1.875

The teacher (``--teacher``) drives ``--episodes`` workloads drawn as the recipe draws them for
the deployment given (training windows only, at its measured rate multiplier, with the given
length-mix options; seed ``--seed``) and each listed
feature's median / P90 / maximum over its decisions is printed. With ``--student`` that
student then drives the unseen run and the same figures of its decisions follow, with the
share of them above the training episodes' maximum. Issue 14, stop 15: the 4k+ bucket's
features on Mooncake lie above anything token-rate-matched mixes reach.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import policies.evaluation.protocol as protocol
from policies.ppo import ppo_factory
from policies.training.distill import Demonstrations, student_labeller
from policies.training.recipe import Recipe, RecipeConfig
from rlbatch.commands.argtypes import checked, positive_range
from rlbatch.commands.options import add_deployment_options, deployment_spec_from_args
from rlbatch.control.observation import feature_names
from rlbatch.engine.config import format_pools
from rlbatch.serving.run import run

FEATURES = ("4k+/arrival_rate_ema", "4k+/departure_rate_ema", "4k+/running", "4k+/queue_len",
            "kv_cache_usage")


def _row(label: str, x: np.ndarray) -> str:
    return (f"{label}: median {np.median(x):.3g}, P90 {np.percentile(x, 90):.3g}, "
            f"max {x.max():.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=6, help="training workloads to draw")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--teacher", default="mpc[routing=false]")
    p.add_argument("--mix-share", type=float, default=0.0)
    p.add_argument("--mix-load", type=checked(positive_range), default="1")
    p.add_argument("--generated-share", type=float, default=0.25)
    p.add_argument("--features", default=",".join(FEATURES),
                   help="comma-separated observation feature names")
    p.add_argument("--student", type=Path, default=None,
                   help="a student artifact to drive the unseen run (with --run, --rate)")
    p.add_argument("--run", default=None, help="start of the protocol run's label")
    p.add_argument("--rate-scale", type=float, default=None, help="one of the run's rate scales")
    add_deployment_options(p)
    p.set_defaults(over_length="truncate")
    args = p.parse_args()
    spec = deployment_spec_from_args(args)
    student, labeller = None, None
    if args.student is not None:
        if args.run is None or args.rate_scale is None:
            p.error("--student needs --run and --rate")
        try:
            student = ppo_factory(str(args.student), {})
            labeller = student_labeller(student, args.teacher)
        except ValueError as e:
            p.error(str(e))
    try:  # the episodes are drawn for the deployment given, at its measured knee
        cfg = RecipeConfig(seed=args.seed, gpu=spec.gpu, model=spec.model,
                           pools=format_pools(spec.pools), teacher=args.teacher,
                           episodes=args.episodes,
                           obs_version=4 if student is None else student.obs_version,
                           mix_share=args.mix_share, mix_load=args.mix_load,
                           generated_share=args.generated_share, deployments=(),
                           rate_scale=protocol.deployment_rate_scale(spec.gpu, spec.model,
                                                                        spec.pools))
    except ValueError as e:
        p.error(str(e))
    recipe = Recipe(cfg)
    names = feature_names(recipe.spec.buckets.names, cfg.obs_version)
    wanted = [f.strip() for f in args.features.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in names]
    if unknown:
        p.error(f"unknown features {unknown}; known: {', '.join(names)}")
    recipe.teacher_data()
    train = Demonstrations.concat(recipe.demos).obs
    print(f"{cfg.teacher} on {cfg.episodes} training episodes (mix share {cfg.mix_share:g}, "
          f"mix load {cfg.mix_load[0]:g}-{cfg.mix_load[1]:g}): {len(train)} decisions")
    for f in wanted:
        print("  " + _row(f, train[:, names.index(f)]))
    if labeller is None:
        return
    spec, run_set, workload = protocol.run_from_args(p, args)
    run(workload, labeller, spec, rate_scale=args.rate_scale)
    seen = labeller.take().obs
    print(f"{args.student} driving {protocol.run_label(run_set)} at {args.rate_scale:g}: "
          f"{len(seen)} decisions")
    for f in wanted:
        x = seen[:, names.index(f)]
        above = np.mean(x > train[:, names.index(f)].max())
        print(f"  {_row(f, x)}; above the episodes' max in {above:.0%}")


if __name__ == "__main__":
    main()
