"""A small Ray Tune search over the student's (recipe) and PPO's hyperparameters:
``train.py --tune N [--ray ADDRESS]``.

A trial is one training run in its own folder; its score is what the run itself selects on,
the training traffic only (the recipe's best selection score on full-length validation
windows, PPO's best periodic evaluation score), never the unseen traffic the protocol judges
on. Trials run with the seed of the command; train the winner over several seeds
(``--seeds``) before believing it.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from policies.training.members import train_students
from policies.training.ppo_trainer import TrainConfig, train
from policies.training.recipe import RecipeConfig


def student_space() -> dict[str, Any]:
    """The recipe's knobs (teacher -> behaviour cloning -> DAgger); defaults in comments."""
    from ray import tune

    return {
        "learning_rate": tune.loguniform(1e-3, 1e-2),  # behaviour-cloning Adam step (3e-3)
        "epochs": tune.choice([30, 60, 120]),  # BC passes per fit (60)
        "net_arch": tune.choice([(64, 64), (128, 128)]),  # (64, 64)
        "decision_ticks": tune.choice([1, 5, 10]),  # ticks between decisions (5)
        "dagger_rounds": tune.choice([1, 2, 3]),  # (2)
        "knee_share": tune.uniform(0.5, 0.9),  # workloads near the knee (0.7)
    }


def ppo_space() -> dict[str, Any]:
    """PPO from scratch (:class:`policies.training.TrainConfig`); defaults in its docs."""
    from ray import tune

    return {
        "learning_rate": tune.loguniform(1e-4, 1e-3),
        "n_steps": tune.choice([256, 512, 1024]),
        "batch_size": tune.choice([64, 128, 256]),
        "gamma": tune.choice([0.98, 0.99, 0.995]),
        "ent_coef": tune.loguniform(1e-4, 1e-2),
    }


def trial(config: dict[str, Any], base: RecipeConfig | TrainConfig) -> dict[str, float]:
    """One Tune trial: train ``base`` with ``config`` in the trial's folder; its score.

    :param config: sampled hyperparameters.
    :param base: the command's configuration.
    """
    from ray import tune

    out = str(Path(tune.get_context().get_trial_dir()) / "run")
    if isinstance(base, RecipeConfig):
        summary = train_students(replace(base, **config, out=out))
        return {"score": float(max(summary["selection_scores"]))}
    result = train(replace(base, **config, out=out), progress_bar=False)
    return {"score": max((float(h["score"]) for h in result.history), default=float("nan"))}


def run_tune(base: RecipeConfig | TrainConfig, num_samples: int, storage: Path,
             ray: str | None = None) -> tuple[dict[str, Any], float, str]:
    """Search the method's space; the best configuration, its score and the trials' table.

    :param base: the configuration every trial starts from.
    :param num_samples: trials.
    :param storage: where Tune keeps the trials (``OUT/tune``).
    :param ray: :data:`rlbatch.scale.LOCAL` or ``None`` (a local cluster), or an address.
    """
    from ray import tune

    from rlbatch.scale import connect

    connect(ray)
    space = student_space() if isinstance(base, RecipeConfig) else ppo_space()
    known = {f.name for f in fields(base)}
    assert set(space) <= known, set(space) - known
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trial, base=base), {"cpu": 1}),
        param_space=space,
        tune_config=tune.TuneConfig(metric="score", mode="max", num_samples=num_samples),
        run_config=tune.RunConfig(name="tune", storage_path=str(storage.resolve()),
                                  verbose=1))
    grid = tuner.fit()
    best = grid.get_best_result()
    frame = grid.get_dataframe()
    cols = ["score", *(c for c in frame.columns if c.startswith("config/"))]
    return dict(best.config or {}), float((best.metrics or {})["score"]), \
        frame[cols].to_string()
