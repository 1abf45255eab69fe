"""``RecipeConfig.members > 1``: several students, each by the whole recipe, shipped as one.

Measured (docs/notebook/BENCHMARKS-archive.md): every single-student recipe met the two-pool
must-checks on at most 1-2 seeds of 3, each seed's student starving a different held-back run. The
mean of independently trained students' logits (:mod:`policies.training.ensemble`) acts only where
they agree. Member ``k`` of seed ``s`` is the recipe with seed ``members * s + k`` (its own teacher
workloads, DAgger rollouts, initialisation and selection) in ``OUT/member-k``; ``OUT/best`` is the
merged artifact. A member whose folder already holds a finished run of the same configuration is
reused, so an interrupted run loses only the member it was training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from policies.training.board import Board
from policies.training.ensemble import save_ensemble
from policies.training.ppo_trainer import training_record
from policies.training.recipe import RecipeConfig, run_recipe


def train_students(cfg: RecipeConfig, log: Callable[[str, float, int], None] | None = None,
                   progress: Callable[[str], None] | None = None,
                   ray: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """The recipe's policy: one student (:func:`policies.training.recipe.run_recipe`) or, with
    ``members > 1``, the merged students of :func:`run_members`. Same arguments and summary."""
    if cfg.members > 1:
        return run_members(cfg, log, progress, ray, quiet)
    return run_recipe(cfg, log, progress, ray, quiet)


def member_config(cfg: RecipeConfig, k: int) -> RecipeConfig:
    """Member ``k``'s recipe: one student, seed ``members * seed + k``, in ``out/member-k``."""
    if not 0 <= k < cfg.members:
        raise ValueError(f"member {k} of {cfg.members}")
    return replace(cfg, seed=cfg.members * cfg.seed + k, members=1,
                   out=str(Path(cfg.out) / f"member-{k}"))


def finished(cfg: RecipeConfig) -> dict[str, Any] | None:
    """The summary of a finished run of exactly ``cfg`` in ``cfg.out``, else ``None`` (no
    summary, a different configuration, or its best artifact missing)."""
    path = Path(cfg.out) / "recipe.json"
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
        done = RecipeConfig.from_record(summary["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if replace(done, out=cfg.out) != cfg or not (Path(cfg.out) / "best" / "policy.json").exists():
        return None
    return dict(summary)


def _prefixed(log: Callable[[str, float, int], None] | None, prefix: str
              ) -> Callable[[str, float, int], None] | None:
    if log is None:
        return None
    if isinstance(log, Board):  # keeps its histograms
        return log.prefixed(prefix)
    return lambda tag, value, step: log(prefix + tag, value, step)


def _prefixed_say(progress: Callable[[str], None] | None, prefix: str
                  ) -> Callable[[str], None] | None:
    if progress is None:
        return None
    return lambda text: progress(prefix + text)


def run_members(cfg: RecipeConfig, log: Callable[[str, float, int], None] | None = None,
                progress: Callable[[str], None] | None = None,
                ray: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train (or reuse) every member, merge their selected students into ``out/best``.

    :param cfg: the configuration (``members > 1``).
    :param log: TensorBoard scalars; member ``k``'s under ``member-k/``.
    :param progress: phase messages.
    :param ray: run each member's teacher and DAgger episodes as Ray tasks.
    :param quiet: no progress bar for those Ray tasks.
    :returns: the summary written to ``out/recipe.json`` (``best``: the merged artifact;
        ``selection_scores``: each member's selected score; ``members``: each member's run).
    """
    say = progress or (lambda text: None)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    members = []
    for k in range(cfg.members):
        member = member_config(cfg, k)
        summary = finished(member)
        reused = summary is not None
        if summary is not None:
            say(f"member {k + 1} of {cfg.members} (seed {member.seed}): reusing the finished "
                f"run in {member.out}")
        else:
            say(f"member {k + 1} of {cfg.members} (seed {member.seed}) in {member.out}")
            summary = run_recipe(member, _prefixed(log, f"member-{k}/"),
                                 _prefixed_say(progress, f"member {k}: "), ray, quiet)
        # the member's own folder, also for a run moved there after it finished
        members.append({"seed": member.seed, "out": member.out,
                        "best": str(Path(member.out) / "best" / "policy.json"),
                        "selection_score": max(summary["selection_scores"]),
                        "decisions": summary["decisions"], "wall_s": summary["wall_s"],
                        "reused": reused})
    say(f"merging {cfg.members} members' students into {out / 'best'}")
    best = save_ensemble([m["best"] for m in members], out / "best", {
        "phase": "ensemble", "training": training_record(asdict(cfg)),
        "recipe": f"mean of {cfg.members} students' logits, each: mpc teacher -> behaviour "
                  f"cloning -> DAgger -> PPO fine-tuning -> selection"})
    # wall_s: the members' own training time (a reused member's from its run), so that a
    # resumed run reports what the policy cost; merge_wall_s: this call
    result = {"best": str(best), "checkpoints": [m["best"] for m in members],
              "selection_scores": [m["selection_score"] for m in members],
              "wall_s": sum(float(m["wall_s"]) for m in members),
              "merge_wall_s": time.perf_counter() - start,
              "decisions": sum(m["decisions"] for m in members), "members": members,
              "config": asdict(cfg)}
    (out / "recipe.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result
