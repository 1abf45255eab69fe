"""Train a PPO batch-size policy on the embedded simulator and compare it with the baselines.

    python train.py                       # defaults: ~10 min on 2 CPU cores
    python train.py --timesteps 20000 --out runs/quick
    tensorboard --logdir runs

The logic lives in ``policies/training.py`` (training) and ``policies/evaluation.py`` (the
comparison table); this file only parses arguments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from policies.evaluation import final_comparison
from policies.training import TrainConfig, train
from rlbatch.commands.options import add_gpu_model_options, add_pools_option
from rlbatch.engine.config import format_pools
from rlbatch.paths import resolve_trace_ref


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="train.py", description="Train PPO (stable-baselines3) on rlbatch/BatchSize-v0, "
        "export a safe policy artifact (safetensors + JSON), and print the comparison with "
        "the static caps, vllm-default, playbook and aimd on both shipped traces.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--timesteps", type=int, default=d.timesteps, help="environment steps")
    p.add_argument("--n-envs", type=int, default=d.n_envs, help="parallel environments")
    p.add_argument("--vec-env", choices=("dummy", "subproc"), default=d.vec_env,
                   help="in-process or one process per env (see BENCHMARKS.md)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--scenario", default=d.scenario,
                   help="mixed (trace slices + generators), day, night, bursty, diurnal, or "
                        "a trace path")
    p.add_argument("--trace", dest="traces", nargs="+", default=list(d.traces),
                   help="training traces for the mixed scenario (paths, or names in the "
                        "traces folder: azure_conv_2023.csv)")
    add_gpu_model_options(p, gpu=d.gpu, model=d.model)
    add_pools_option(p, default=d.pools)
    p.add_argument("--episode-s", type=float, default=d.episode_s)
    p.add_argument("--eval-freq", type=int, default=d.eval_freq,
                   help="evaluate against the baselines every N steps (0: at the end)")
    p.add_argument("--out", default=d.out, help="run folder: TensorBoard logs, artifacts")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the final comparison table")
    p.add_argument("--compare-rates", default="0.25,0.5,0.75,1.0",
                   help="Azure rate scales of the final comparison")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["traces"] = tuple(str(resolve_trace_ref(t)) for t in values["traces"])
    values["pools"] = format_pools(values["pools"])
    try:
        cfg = TrainConfig(**values)
    except ValueError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    result = train(cfg, progress_bar=not args.no_progress)
    print(f"trained {cfg.timesteps} steps in {result.wall_s:.0f} s; final policy "
          f"{result.final}, best {result.best}; TensorBoard: tensorboard --logdir {cfg.out}")
    if not args.no_compare:
        rates = [float(x) for x in args.compare_rates.split(",")]
        print(final_comparison(Path(result.best).parent, cfg, rates, Path(cfg.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
