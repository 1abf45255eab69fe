"""Train a batch-size policy on the embedded simulator and compare it with the baselines.

    python train.py                       # the recipe: mpc teacher -> student -> DAgger
    python train.py --seed 1 --out runs/seed1
    python train.py --method ppo --timesteps 20000 --out runs/quick   # PPO from scratch
    tensorboard --logdir runs

The logic lives in ``policies/recipe.py`` (teacher -> behaviour cloning -> DAgger ->
selection), ``policies/training.py`` (PPO from scratch), ``policies/protocol.py`` (the
comparison on traffic the policy never trained on) and ``policies/evaluation.py`` (the
comparison on both shipped traces); this file only parses arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from policies.evaluation import final_comparison
from policies.recipe import RecipeConfig, run_recipe
from policies.training import TrainConfig, train
from rlbatch.commands.options import add_gpu_model_options, add_pools_option
from rlbatch.engine.config import format_pools
from rlbatch.paths import resolve_trace_ref


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    r = RecipeConfig()
    p = argparse.ArgumentParser(
        prog="train.py", description="Train a batch-size policy on the simulator (default: "
        "the mpc planner as teacher, a behaviour-cloned SB3 student refined by DAgger, the "
        "best checkpoint on full-length validation windows of the training traffic), export "
        "a safe policy artifact (safetensors + JSON), and judge it on traffic it never saw "
        "(held-back Azure window, Mooncake) against static caps 4-256 and the playbook.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", choices=("distill", "ppo"), default="distill",
                   help="distill: teacher -> student -> DAgger (the recipe of the shipped "
                        "policies); ppo: PPO from scratch on rlbatch/BatchSize-v0")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--trace", dest="traces", nargs="+", default=list(d.traces),
                   help="training traces (paths, or names in the traces folder: "
                        "azure_conv_2023.csv); the recipe uses their first 75%% only")
    add_gpu_model_options(p, gpu=d.gpu, model=d.model)
    add_pools_option(p, default=d.pools)
    p.add_argument("--out", default=None, help="run folder: TensorBoard logs, artifacts "
                   "(default runs/recipe or runs/ppo)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the final comparison")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    g = p.add_argument_group("recipe (--method distill)")
    g.add_argument("--teacher", default=r.teacher, help="teacher controller spec")
    g.add_argument("--episodes", type=int, default=r.episodes,
                   help="teacher workloads (behaviour cloning)")
    g.add_argument("--dagger-rounds", type=int, default=r.dagger_rounds)
    g.add_argument("--dagger-episodes", type=int, default=r.dagger_episodes)
    g.add_argument("--recipe-episode-s", type=float, default=r.episode_s,
                   help="seconds of arrivals per teacher / DAgger workload")
    g.add_argument("--decision-ticks", type=int, default=r.decision_ticks,
                   help="ticks between two student decisions")
    g.add_argument("--epochs", type=int, default=r.epochs, help="behaviour-cloning epochs")
    h = p.add_argument_group("PPO from scratch (--method ppo)")
    h.add_argument("--timesteps", type=int, default=d.timesteps, help="environment steps")
    h.add_argument("--n-envs", type=int, default=d.n_envs, help="parallel environments")
    h.add_argument("--vec-env", choices=("dummy", "subproc"), default=d.vec_env,
                   help="in-process or one process per env (see BENCHMARKS.md)")
    h.add_argument("--scenario", default=d.scenario,
                   help="mixed (trace slices + generators), day, night, bursty, diurnal, or "
                        "a trace path")
    h.add_argument("--episode-s", type=float, default=d.episode_s)
    h.add_argument("--eval-freq", type=int, default=d.eval_freq,
                   help="evaluate against the baselines every N steps (0: at the end)")
    h.add_argument("--compare-rates", default="0.25,0.5,0.75,1.0",
                   help="Azure rate scales of the PPO run's final comparison")
    return p


def _tb_logger(out: Path) -> tuple[Any, Any]:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tb" / "recipe"))

    def log(tag: str, value: float, step: int) -> None:
        writer.add_scalar(tag, value, step)

    return writer, log


def main_distill(args: argparse.Namespace) -> int:
    traces = tuple(str(resolve_trace_ref(t)) for t in args.traces)
    out = Path(args.out or "runs/recipe")
    try:
        cfg = RecipeConfig(seed=args.seed, traces=traces, gpu=args.gpu, model=args.model,
                           pools=format_pools(args.pools), teacher=args.teacher,
                           episodes=args.episodes, episode_s=args.recipe_episode_s,
                           dagger_rounds=args.dagger_rounds,
                           dagger_episodes=args.dagger_episodes,
                           decision_ticks=args.decision_ticks, epochs=args.epochs,
                           out=str(out))
    except ValueError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    writer, log = _tb_logger(out)
    start = time.perf_counter()

    def say(text: str) -> None:
        if not args.no_progress:
            print(f"[{time.perf_counter() - start:7.1f} s] {text}", file=sys.stderr,
                  flush=True)

    try:
        summary = run_recipe(cfg, log=log, progress=say)
    finally:
        writer.close()
    print(f"trained in {summary['wall_s']:.0f} s on {summary['decisions']} teacher decisions; "
          f"best policy {summary['best']} (selection scores "
          f"{', '.join(f'{s:.3f}' for s in summary['selection_scores'])}); TensorBoard: "
          f"tensorboard --logdir {out}")
    if not args.no_compare:
        from policies.protocol import evaluate_protocol

        say("comparison on traffic the policy never saw (policies/protocol.py)")
        best = Path(summary["best"]).parent
        _rows, _pick, text = evaluate_protocol([f"ppo:{best}", "mpc"], cfg.spec(),
                                               quiet=args.no_progress)
        (out / "EVAL.md").write_text(f"# Evaluation of {best}\n\n{text}\n")
        print(text)
    return 0


def main_ppo(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["traces"] = tuple(str(resolve_trace_ref(t)) for t in values["traces"])
    values["pools"] = format_pools(values["pools"])
    values["out"] = args.out or "runs/ppo"
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return main_distill(args) if args.method == "distill" else main_ppo(args)


if __name__ == "__main__":
    raise SystemExit(main(argv=None))
