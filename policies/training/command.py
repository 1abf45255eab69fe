"""The ``train`` command: train a batch-size policy on the embedded simulator and compare it
with the baselines (``train.py`` at the repository root is its entry point).

    python train.py                       # the recipe: mpc teacher -> student -> DAgger
    python train.py --seed 1 --out runs/seed1
    python train.py --members 3 --out runs/ensemble   # 3 students, shipped as one
    python train.py --method ppo --timesteps 20000 --out runs/quick   # PPO from scratch
    python train.py --seeds 0,1,2 --ray --out runs/seeds   # 3 seeds as Ray tasks
    python train.py --smoke               # every phase in about a minute (runs/smoke)
    tensorboard --logdir runs

The logic lives in :mod:`policies.training.recipe` (teacher -> behaviour cloning -> DAgger
-> selection), :mod:`policies.training.ppo_trainer` (PPO from scratch),
:mod:`policies.evaluation.protocol` (the comparison on traffic the policy never trained on)
and :mod:`policies.evaluation.comparison` (the comparison on both shipped traces); several
seeds at once, on Ray or not, are :mod:`policies.training.multiseed`; this module only parses
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from policies.evaluation.comparison import final_comparison
from policies.evaluation.protocol import render
from policies.training.board import record_hparams
from policies.training.distill import LABELS
from policies.training.members import train_students
from policies.training.multiseed import protocol_comparison, run_seeds, seed_runs, tb_logger
from policies.training.ppo_trainer import TrainConfig, train
from policies.training.recipe import RecipeConfig, parse_deployment
from rlbatch.commands.argtypes import checked, positive_floats, positive_range
from rlbatch.commands.options import add_gpu_model_options, add_pools_option
from rlbatch.control.observation import OBS_VERSIONS
from rlbatch.engine.config import format_pools
from rlbatch.paths import resolve_trace_ref
from rlbatch.scale.cluster import add_ray_option
from rlbatch.serving.deployment import DeploymentSpec

SMOKE_OPTIONS: dict[str, dict[str, Any]] = {
    "distill": {"episodes": 6, "recipe_episode_s": 60.0, "dagger_rounds": 1,
                "dagger_episodes": 3, "epochs": 5, "finetune_steps": 3072,
                "train_deployments": "none", "no_compare": True, "out": "runs/smoke"},
    "ppo": {"timesteps": 2048, "episode_s": 60.0, "eval_freq": 0, "no_compare": True,
            "out": "runs/smoke-ppo"},
}
"""``--smoke``: the defaults it gives each method's options (explicit options still win):
short workloads, few of them, one DAgger round, three fine-tuning rollouts (two fit the
value head only), one deployment, no comparison; every phase still runs and writes its
artifact and TensorBoard logs."""
SMOKE_SELECTION_RATES: tuple[float, ...] = (0.7,)
"""``--smoke``'s validation rate scales (selection has no option for them)."""


def _seed_list(text: str) -> list[int]:
    seeds = [int(x) for x in text.split(",") if x.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"distinct comma-separated seeds, e.g. 0,1,2; got {text!r}")
    return seeds


def _deployment_list(text: str) -> tuple[str, ...]:
    if text.strip() == "none":
        return ()
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    for item in items:
        parse_deployment(item)
    if len(set(items)) != len(items):
        raise ValueError(f"deployments repeat in {text!r}")
    return items


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    d = TrainConfig()
    r = RecipeConfig()
    p = argparse.ArgumentParser(
        prog=prog, description="Train a batch-size policy on the simulator (default: "
        "the mpc planner as teacher, a behaviour-cloned SB3 student refined by DAgger, the "
        "best checkpoint on full-length validation windows of the training traffic), export "
        "a safe policy artifact (safetensors + JSON), and judge it on traffic it never saw "
        "(held-back Azure window, Mooncake) against static caps 4-256 and the playbook.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", choices=("distill", "ppo"), default="distill",
                   help="distill: teacher -> student -> DAgger (the recipe of the shipped "
                        "policies); ppo: PPO from scratch on rlbatch/BatchSize-v0")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--seeds", type=checked(_seed_list), default=None, metavar="S,S,...",
                   help="train every seed, each in OUT/seed<S> (artifact, TensorBoard run, "
                        "EVAL.md), judge them in one grid and write the summary over seeds "
                        "(OUT/seeds.md)")
    add_ray_option(p, "seeds (one task each), teacher episodes and comparison grid")
    p.add_argument("--tune", type=int, default=None, metavar="N",
                   help="a Ray Tune search of N trials over the method's hyperparameters "
                        "(policies/training/tune.py), scored on the training traffic; trials in "
                        "OUT/tune, the best in OUT/tune.json")
    p.add_argument("--trace", dest="traces", nargs="+", default=list(d.traces),
                   help="training traces (paths, or names in the traces folder: "
                        "azure_conv_2023.csv); the recipe uses their first 75%% only")
    add_gpu_model_options(p, gpu=d.gpu, model=d.model)
    add_pools_option(p, default=d.pools)
    p.add_argument("--rate-scale", type=float, default=None, metavar="X",
                   help="multiply every training, selection and comparison rate scale by X "
                        "(a deployment with more capacity than one A100 serving llama-2-7b "
                        "needs more load to reach its knee); default: the measured one for the "
                        "deployment (policies.evaluation.protocol.DEPLOYMENT_RATE_SCALES: 2.5 "
                        "for --pools fp16:1,fp8:1), else 1")
    p.add_argument("--out", default=None, help="run folder: TensorBoard logs, artifacts "
                   "(default runs/recipe or runs/ppo)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the final comparison")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--smoke", action="store_true",
                   help="a preset that runs every phase end to end in about a minute on 2 "
                        "cores (tiny workloads, few decisions, a short fine-tune, one "
                        "validation rate, no comparison; OUT runs/smoke): a check of the "
                        "pipeline and its TensorBoard logs, not a policy to ship; options "
                        "given explicitly still win")
    _add_recipe_options(p.add_argument_group("recipe (--method distill)"), r)
    _add_recipe_traffic_options(
        p.add_argument_group("recipe: what it trains on (--method distill)"), r)
    _add_ppo_options(p.add_argument_group("PPO from scratch (--method ppo)"), d)
    return p


def _add_recipe_options(g: argparse._ArgumentGroup, r: RecipeConfig) -> None:
    """How the recipe learns: teacher, student, DAgger, fine-tuning, selection."""
    g.add_argument("--teacher", default=r.teacher, help="teacher controller spec")
    g.add_argument("--episodes", type=int, default=r.episodes,
                   help="teacher workloads (behaviour cloning)")
    g.add_argument("--dagger-rounds", type=int, default=r.dagger_rounds)
    g.add_argument("--dagger-episodes", type=int, default=r.dagger_episodes)
    g.add_argument("--tpot-fit", action=argparse.BooleanOptionalAction, default=r.tpot_fit,
                   help="teacher and student act behind the guard's tpot_fit rule (the total "
                        "held where the TPOT predicted from the deployment's profile, "
                        "calibrated on the engines' iterations, meets the SLA's less an "
                        "allowance for short outputs), and the student is served behind it")
    g.add_argument("--hold-release", action=argparse.BooleanOptionalAction,
                   default=r.hold_release,
                   help="train and serve the student behind the hold release "
                        "(--no-hold-release: without it, learning not to hold requests past "
                        "their TTFT from the teacher's labels)")
    g.add_argument("--dagger-focus", action=argparse.BooleanOptionalAction,
                   default=r.dagger_focus,
                   help="draw each DAgger round's traffic families at odds that grow with the "
                        "student's distance from the teacher's total on each (--no-dagger-focus: "
                        "uniformly)")
    g.add_argument("--excursions", type=float, default=r.excursions, metavar="P",
                   help="chance, at each teacher decision, that the total in force leaves the "
                        "teacher's for one drawn from the ladder for a few decisions while the "
                        "teacher labels, so that the student learns the way back from totals it "
                        "drifts to (0: the teacher drives throughout)")
    g.add_argument("--excursion-decisions", type=checked(_int_range),
                   default=_csv(r.excursion_decisions), metavar="LOW,HIGH",
                   help="shortest and longest excursion, in decisions")
    g.add_argument("--recipe-episode-s", type=float, default=r.episode_s,
                   help="seconds of arrivals per teacher / DAgger workload")
    g.add_argument("--decision-ticks", type=int, default=r.decision_ticks,
                   help="ticks between two student decisions")
    g.add_argument("--epochs", type=int, default=r.epochs, help="behaviour-cloning epochs")
    g.add_argument("--obs-version", type=int, choices=OBS_VERSIONS, default=r.obs_version,
                   help="the student's observation version (4: version 3 without the "
                        "action in force, so that the student cannot copy its last action; 5: "
                        "version 4 plus the kind of traffic and the SLA; 6: version 5 plus "
                        "the prefix-cache hit rate; 7: version 6 plus the share of the total "
                        "ladder whose TPOT, predicted from the deployment's profiles, meets "
                        "the SLA)")
    g.add_argument("--selection-knee", action="store_true",
                   help="select the checkpoint on validation windows at the rate scales where "
                        "the training traffic is contested on --gpu/--model/--pools (scanned "
                        "first) instead of the fixed selection rates")
    g.add_argument("--selection-mixes", action="store_true",
                   help="also select the checkpoint on each training window with every "
                        "prompt-length bucket equally likely (the centre of --mix-share's mixes)")
    g.add_argument("--obs-clip", action="store_true",
                   help="record in each checkpoint the range of the observations it was "
                        "fitted on; serving (and fine-tuning) clips every observation into "
                        "it instead of letting the student extrapolate past its training")
    g.add_argument("--labels", choices=LABELS, default=r.labels,
                   help="choice: fit each decision to the teacher's choice (default); near: "
                        "to every candidate the teacher counted as tied with it, equally "
                        "weighted, so the student learns the action most often near-best")
    g.add_argument("--shares", type=checked(positive_floats),
                   default=_csv(r.shares), metavar="S,...",
                   help="the student's share ladder: each bucket's cap is a share of the total "
                        "cap, increasing and ending at 1 (default %(default)s); '1': the "
                        "student chooses the total cap only and cannot trim a bucket (pair it "
                        "with a teacher that does not trim, e.g. mpc[routing=false,trims=false])")
    g.add_argument("--finetune-steps", type=int, default=r.finetune_steps,
                   help="PPO fine-tuning decisions after DAgger (0: none); the fine-tuned "
                        "student is one more checkpoint for selection")
    g.add_argument("--members", type=int, default=r.members, metavar="K",
                   help="train K students, each by the whole recipe with seed K*SEED+k in "
                        "OUT/member-k, and ship the mean of their logits as one policy "
                        "(default %(default)s); a member already finished in its folder with "
                        "the same options is reused")


def _add_recipe_traffic_options(g: argparse._ArgumentGroup, r: RecipeConfig) -> None:
    """What the recipe trains on: deployments, length mixes, traffic families, SLAs."""
    g.add_argument("--train-deployments", type=checked(_deployment_list),
                   default=",".join(r.deployments) or "none", metavar="GPU/MODEL,...",
                   help="further GPU/model profiles to train over besides --gpu/--model "
                        "(same pools), each workload served on one drawn uniformly at its "
                        "measured rate multiplier; 'none': only --gpu/--model")
    g.add_argument("--mix-share", type=float, default=r.mix_share, metavar="P",
                   help="share of trace workloads (teacher, DAgger, fine-tuning) whose "
                        "prompt-length mix is redrawn from the training window's own requests "
                        "at random bucket weights, keeping the slice's arrival process, so "
                        "the student sees long-prompt-heavy traffic (0: none, the default)")
    g.add_argument("--mix-load", type=checked(positive_range),
                   default=_csv(r.mix_load), metavar="LOW,HIGH",
                   help="token rate of a remixed slice, times the slice's own, drawn "
                        "log-uniformly (default 1: the slice's own; long-prompt-heavy traffic "
                        "such as Mooncake carries about twice that at its knee)")
    g.add_argument("--family-share", type=float, default=r.family_share, metavar="P",
                   help="share of workloads (teacher, DAgger, fine-tuning) drawn from the "
                        "traffic families (chat, code completion, RAG, reports, and drifts "
                        "between two of them: rlbatch/workload/families.py) instead of the "
                        "training traces and scenarios")
    g.add_argument("--family-loads", type=checked(positive_range),
                   default=_csv(r.family_loads), metavar="LOW,HIGH",
                   help="load of a family workload, in units of the family's knee, drawn "
                        "log-uniformly")
    g.add_argument("--train-sla-ttft-s", type=checked(positive_range),
                   default=_csv(r.sla_ttft_s), metavar="LOW,HIGH",
                   help="the SLA's TTFT limit of each teacher / DAgger workload, drawn "
                        "log-uniformly (one value: every workload under it); with "
                        "--obs-version 5 the student reads the SLA, and ppo:PATH refuses an SLA "
                        "outside the trained ranges")
    g.add_argument("--train-sla-tpot-s", type=checked(positive_range),
                   default=_csv(r.sla_tpot_s), metavar="LOW,HIGH",
                   help="the SLA's TPOT limit of each workload, as --train-sla-ttft-s")


def _add_ppo_options(h: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """PPO from scratch on the env."""
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


def _int_range(text: str) -> tuple[int, int]:
    """``N`` or ``LOW,HIGH`` of whole numbers."""
    low, high = positive_range(text)
    if low != int(low) or high != int(high):
        raise ValueError(f"whole numbers, e.g. 2,12; got {text!r}")
    return int(low), int(high)


def _csv(values: Sequence[float]) -> str:
    """``values`` as an option's comma-separated default."""
    return ",".join(f"{x:g}" for x in values)


def _rate_scale(args: argparse.Namespace) -> float:
    """``--rate-scale``, or the measured one for the pools (1 for one FP16 engine)."""
    from policies.evaluation.protocol import deployment_rate_scale

    if args.rate_scale is not None:
        return float(args.rate_scale)
    return deployment_rate_scale(args.gpu, args.model, args.pools)


def _recipe_config(args: argparse.Namespace, traces: tuple[str, ...],
                   **extra: Any) -> RecipeConfig:
    """The recipe's configuration from the command line (``extra``: further fields).

    :raises ValueError: an invalid option value.
    """
    if args.smoke:
        extra = {"selection_rates": SMOKE_SELECTION_RATES, **extra}
    return RecipeConfig(seed=args.seed, traces=traces, gpu=args.gpu, model=args.model,
                        pools=format_pools(args.pools), teacher=args.teacher,
                        episodes=args.episodes, episode_s=args.recipe_episode_s,
                        dagger_rounds=args.dagger_rounds, dagger_episodes=args.dagger_episodes,
                        dagger_focus=args.dagger_focus, hold_release=args.hold_release,
                        tpot_fit=args.tpot_fit,
                        decision_ticks=args.decision_ticks, epochs=args.epochs,
                        obs_version=args.obs_version, selection_knee=args.selection_knee,
                        mix_share=args.mix_share, selection_mixes=args.selection_mixes,
                        mix_load=args.mix_load, family_share=args.family_share,
                        family_loads=args.family_loads, sla_ttft_s=args.train_sla_ttft_s,
                        sla_tpot_s=args.train_sla_tpot_s, obs_clip=args.obs_clip,
                        labels=args.labels, excursions=args.excursions,
                        excursion_decisions=args.excursion_decisions,
                        shares=args.shares, members=args.members,
                        finetune_steps=args.finetune_steps,
                        deployments=args.train_deployments,
                        rate_scale=_rate_scale(args), **extra)


def main_distill(args: argparse.Namespace) -> int:
    traces = tuple(str(resolve_trace_ref(t)) for t in args.traces)
    out = Path(args.out or "runs/recipe")
    try:
        cfg = _recipe_config(args, traces, out=str(out))
    except ValueError as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    writer, log = tb_logger(out / "tb" / "recipe")
    start = time.perf_counter()

    def say(text: str) -> None:
        if not args.no_progress:
            print(f"[{time.perf_counter() - start:7.1f} s] {text}", file=sys.stderr,
                  flush=True)

    try:
        summary = train_students(cfg, log=log, progress=say, ray=args.ray,
                                 quiet=args.no_progress)
        record_hparams(log, asdict(cfg), summary)
    finally:
        writer.close()
    print(f"trained in {summary['wall_s']:.0f} s on {summary['decisions']} teacher decisions; "
          f"best policy {summary['best']} (selection scores "
          f"{', '.join(f'{s:.3f}' for s in summary['selection_scores'])}); TensorBoard: "
          f"tensorboard --logdir {out}")
    if not args.no_compare:
        from policies.evaluation.protocol import evaluate_protocol

        say("comparison on traffic the policy never saw (policies/evaluation/protocol.py)")
        best = Path(summary["best"]).parent
        if args.ray is None:
            _rows, _pick, text = evaluate_protocol([f"ppo:{best}", "mpc"], cfg.spec(),
                                                   quiet=args.no_progress,
                                                   rate_scale=cfg.rate_scale)
        else:  # the same grid and report, its runs as Ray tasks
            rows, pick = protocol_comparison([f"ppo:{best}", "mpc"], cfg.spec(),
                                             ray=args.ray, quiet=args.no_progress,
                                             rate_scale=cfg.rate_scale)
            text = render(rows, [f"ppo:{best}", "mpc"], pick)
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
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    result = train(cfg, progress_bar=not args.no_progress)
    print(f"trained {cfg.timesteps} steps in {result.wall_s:.0f} s; final policy "
          f"{result.final}, best {result.best}; TensorBoard: tensorboard --logdir {cfg.out}")
    if not args.no_compare:
        rates = [float(x) for x in args.compare_rates.split(",")]
        print(final_comparison(Path(result.best).parent, cfg, rates, Path(cfg.out)))
    return 0


def _base_config(args: argparse.Namespace) -> tuple[RecipeConfig | TrainConfig,
                                                   DeploymentSpec]:
    """The configuration every seed / trial starts from, and the deployment it is judged on.

    :raises ValueError: an invalid option value.
    """
    traces = tuple(str(resolve_trace_ref(t)) for t in args.traces)
    base: RecipeConfig | TrainConfig
    if args.method == "distill":
        base = _recipe_config(args, traces)
        return base, base.spec()
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(traces=traces, pools=format_pools(values["pools"]))
    spec = RecipeConfig(gpu=args.gpu, model=args.model, pools=format_pools(args.pools)).spec()
    return TrainConfig(**values), spec


def main_seeds(args: argparse.Namespace) -> int:
    """``--seeds``: every seed in its own folder, then the summary over seeds."""
    out = Path(args.out or ("runs/recipe" if args.method == "distill" else "runs/ppo"))
    try:
        base, spec = _base_config(args)
        runs = seed_runs(args.method, base, args.seeds or [args.seed], out)
    except ValueError as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        print(run_seeds(runs, spec, out, ray=args.ray, compare=not args.no_compare,
                        quiet=args.no_progress, rate_scale=_rate_scale(args)))
    except RuntimeError as exc:  # a seed or a comparison run failed twice on Ray
        print(f"train.py: failed: {exc}", file=sys.stderr)
        return 1
    return 0


def main_tune(args: argparse.Namespace) -> int:
    """``--tune N``: the search; the best configuration in ``OUT/tune.json``."""
    from policies.training.tune import run_tune

    out = Path(args.out or ("runs/recipe" if args.method == "distill" else "runs/ppo"))
    try:
        base, _spec = _base_config(args)
    except ValueError as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    best, score, table = run_tune(base, args.tune, out / "tune", ray=args.ray)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps({"best": best, "score": score}, indent=2,
                                              default=str) + "\n")
    print(f"{table}\n\nbest score {score:.4f} with {best}; train it over seeds: --seeds 0,1,2")
    return 0


def parse_args(argv: list[str] | None = None, prog: str = "train.py") -> argparse.Namespace:
    """The command line; ``--smoke`` gives its preset (:data:`SMOKE_OPTIONS`) as defaults, so
    that options given explicitly win."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE_OPTIONS[args.method])
        args = parser.parse_args(argv)
    args.prog = prog
    return args


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    """The training command (``train.py``; ``prog``: the name its usage and errors give)."""
    args = parse_args(argv, prog)
    # PPO trains in one process (SB3): Ray parallelises its seeds, so --ray implies seeds.
    if args.tune is not None:
        return main_tune(args)
    if args.seeds is not None or (args.ray is not None and args.method == "ppo"):
        return main_seeds(args)
    return main_distill(args) if args.method == "distill" else main_ppo(args)




def rlbatch_train(argv: list[str]) -> int:
    """``rlbatch train``: :func:`main` under that name."""
    return main(argv, prog="rlbatch train")
