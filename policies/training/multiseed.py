"""Several training seeds side by side (``train.py --seeds 0,1,2 [--ray]``) and the summary of
their verdicts.

Each seed trains in its own folder (``OUT/seed0``, ``OUT/seed1``, ...: artifact, TensorBoard
run, ``EVAL.md``), as one Ray task per seed with ``--ray`` or one after the other without;
a seed's result depends on its seed only. Then one comparison grid judges every seed's
policy at once on the evaluation protocol's unseen traffic (the static caps and the playbook
run once for all seeds), and ``OUT/seeds.md`` tabulates the verdict ratios per seed with
their mean, min and max.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from policies.evaluation.protocol import (
    judge,
    label_rows,
    protocol_jobs,
    render,
    training_runs,
    unseen_runs,
    user_pick,
)
from policies.training.board import Board, recipe_layout, record_hparams
from policies.training.members import train_students
from policies.training.ppo_trainer import TrainConfig, train
from policies.training.recipe import RecipeConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.evaluate import error_rows, run_jobs

# The verdict ratios summarised over seeds: (summary key, column header).
RATIOS: tuple[tuple[str, str], ...] = (
    ("vs_best_static_gmean", "vs best static (geo-mean)"),
    ("vs_best_static_min", "worst run vs best static"),
    ("vs_user_pick_gmean", "vs user's pick"),
    ("vs_playbook_gmean", "vs playbook"),
)


@dataclass(frozen=True)
class SeedRun:
    """One seed's training.

    :param seed: the seed.
    :param method: ``distill`` (the recipe) or ``ppo``.
    :param config: its :class:`RecipeConfig` or :class:`TrainConfig` (``out`` its folder).
    :param torch_threads: torch's intra-op threads while it trains: an input like the seed,
        because float sums split over threads differ in the last bits (``None``: leave as is).
    """

    seed: int
    method: str
    config: RecipeConfig | TrainConfig
    torch_threads: int | None = None


def seed_runs(method: str, base: RecipeConfig | TrainConfig, seeds: Sequence[int],
              out: Path, torch_threads: int | None = None) -> list[SeedRun]:
    """One run per seed, each in ``out/seed<N>``.

    :param method: ``distill`` or ``ppo``.
    :param base: the configuration shared by every seed.
    :param seeds: distinct seeds.
    :param out: the parent folder.
    :param torch_threads: torch threads of every seed (default: what this process uses, so
        a seed trained on a Ray worker, where Ray sets one thread, equals one trained here).
    """
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"--seeds needs distinct seeds, got {list(seeds)}")
    if torch_threads is None:
        import torch

        torch_threads = torch.get_num_threads()
    return [SeedRun(s, method, replace(base, seed=s, out=str(out / f"seed{s}")),
                    torch_threads) for s in seeds]


def tb_logger(folder: Path) -> tuple[Any, Board]:
    """A TensorBoard writer in ``folder`` and the recipe's :class:`~policies.training.board.
    Board` over it (its ``log(tag, value, step)``), the custom-scalars layout written."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    board = Board(writer)
    board.layout(recipe_layout())
    return writer, board


def train_seed(run: SeedRun, _shared: Any = None) -> dict[str, Any]:
    """Train one seed (in this process or a Ray worker); its artifact's path and wall time.

    :param run: the seed's training.
    """
    out = Path(run.config.out)
    out.mkdir(parents=True, exist_ok=True)
    if run.torch_threads is not None:
        import torch

        torch.set_num_threads(run.torch_threads)
    if isinstance(run.config, RecipeConfig):
        writer, log = tb_logger(out / "tb" / "recipe")
        try:
            summary = train_students(run.config, log=log)
            record_hparams(log, asdict(run.config), summary)
        finally:
            writer.close()
        return {"seed": run.seed, "best": str(Path(summary["best"]).parent),
                "wall_s": summary["wall_s"]}
    result = train(run.config, progress_bar=False)
    return {"seed": run.seed, "best": str(Path(result.best).parent), "wall_s": result.wall_s}


def train_seeds(runs: Sequence[SeedRun], *, ray: str | None = None) -> list[dict[str, Any]]:
    """Train every seed: one Ray task each (``ray``), else one after the other.

    :raises RuntimeError: a seed failed twice on Ray (its error and inputs in the message).
    """
    if ray is None:
        return [train_seed(r) for r in runs]
    from rlbatch.scale import connect, failed, run_tasks

    connect(ray)
    results = run_tasks(train_seed, runs, desc="seeds",
                        describe=lambda r: f"seed {r.seed} ({r.method}, {r.config.out})")
    if failed(results):
        raise RuntimeError("; ".join(f"{e.inputs}: {e.error}" for e in failed(results)))
    return [r for r in results if isinstance(r, dict)]


def protocol_comparison(candidates: Sequence[str], spec: DeploymentSpec, *,
                        ray: str | None = None, quiet: bool = False,
                        rate_scale: float = 1.0
                        ) -> tuple[list[dict[str, Any]], str]:
    """:func:`policies.evaluation.protocol.evaluate_protocol`'s grid, on Ray when asked: the unseen
    rows and the user's pick.

    :param rate_scale: multiplies every run's rate scale.

    :raises RuntimeError: a run failed twice on Ray.
    """
    train_sets = training_runs(rate_scale)
    unseen_sets = unseen_runs(rate_scale)
    train_jobs = protocol_jobs([], spec, train_sets)
    unseen_jobs = protocol_jobs(candidates, spec, unseen_sets)
    rows = run_jobs([*train_jobs, *unseen_jobs], n_jobs=2, quiet=quiet, desc="protocol",
                    ray=ray)
    if error_rows(rows):
        raise RuntimeError("; ".join(f"{r['controller']} on {r['trace']} at "
                                     f"{r['rate_scale']:g}: {r['error']}"
                                     for r in error_rows(rows)))
    pick = user_pick(label_rows(rows[:len(train_jobs)], train_jobs, train_sets))
    return label_rows(rows[len(train_jobs):], unseen_jobs, unseen_sets), pick


def _cell(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3f}x"


def summary_table(per_seed: dict[int, dict[str, Any]]) -> str:
    """Markdown: one line per seed (its protocol summary), then mean / min / max of each
    verdict ratio over the seeds.

    :param per_seed: seed -> :func:`policies.evaluation.protocol.judge`'s ``summary``.
    """
    head = ["seed", *(h for _, h in RATIOS), "KV overflows", "must-checks"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for seed, s in per_seed.items():
        lines.append(f"| {seed} | " + " | ".join(_cell(float(s[k])) for k, _ in RATIOS)
                     + f" | {s['kv_overflows']} | {'met' if s['must_met'] else 'NOT met'} |")
    for name, agg in (("mean", lambda v: sum(v) / len(v)), ("min", min), ("max", max)):
        cells = []
        for key, _ in RATIOS:
            vals = [float(s[key]) for s in per_seed.values() if math.isfinite(float(s[key]))]
            cells.append(_cell(agg(vals)) if vals else "-")
        lines.append(f"| **{name}** | " + " | ".join(cells) + " | | |")
    return "\n".join(lines)


def run_seeds(runs: Sequence[SeedRun], spec: DeploymentSpec, out: Path, *,
              ray: str | None = None, compare: bool = True, quiet: bool = False,
              rate_scale: float = 1.0) -> str:
    """Train every seed, judge them in one grid, write ``out/seeds.md`` and
    ``out/seeds.json`` (and each seed's ``EVAL.md``); return the summary text.

    :param runs: from :func:`seed_runs`.
    :param spec: the deployment the policies are judged on.
    :param out: the parent folder.
    :param ray: ``None``, :data:`rlbatch.scale.LOCAL` or a cluster address.
    :param compare: run the comparison (else only train).
    :param quiet: no progress bars.
    """
    out.mkdir(parents=True, exist_ok=True)
    trained = train_seeds(runs, ray=ray)
    for t in trained:
        print(f"seed {t['seed']}: {t['best']} ({t['wall_s']:.0f} s)", file=sys.stderr)
    record: dict[str, Any] = {"seeds": trained}
    text = (f"# {len(runs)} seeds\n\nArtifacts: " + ", ".join(t["best"] for t in trained)
            + f"\n\nTensorBoard, the seeds side by side: `tensorboard --logdir {out}`\n")
    if compare:
        candidates = {t["seed"]: f"ppo:{t['best']}" for t in trained}
        rows, pick = protocol_comparison(list(candidates.values()), spec, ray=ray,
                                         quiet=quiet, rate_scale=rate_scale)
        per_seed = {seed: judge(rows, cand, pick)["summary"]
                    for seed, cand in candidates.items()}
        for t in trained:
            Path(t["best"]).parent.joinpath("EVAL.md").write_text(
                f"# Evaluation of {t['best']}\n\n"
                f"{render(rows, [candidates[t['seed']]], pick)}\n")
        record.update(pick=pick, summaries={str(k): v for k, v in per_seed.items()})
        text += ("\n## Verdicts on unseen traffic (policies/evaluation/protocol.py), over seeds\n\n"
                 f"User's pick: {pick}.\n\n{summary_table(per_seed)}\n")
    (out / "seeds.md").write_text(text)
    (out / "seeds.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return text
