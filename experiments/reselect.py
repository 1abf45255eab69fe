"""Run the recipe's selection phase again over a finished run's checkpoints.

    .venv/bin/python experiments/reselect.py runs/s13/v4-s0 --selection-knee

Selection is the recipe's last phase and reads only the checkpoints and the configuration in
``RUN/recipe.json``, so a selection rule can be compared on runs already trained: this prints
every checkpoint's selection score and the one kept, exactly as ``train.py`` with the same
options would have. ``--export DIR`` writes the kept checkpoint there as ``train.py`` writes
``best/`` (with its selection scores). Only training traffic is read.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from policies.artifact import copy_artifact
from policies.training.recipe import Recipe, RecipeConfig


def config_of(run_dir: Path, **changes: Any) -> RecipeConfig:
    """The recipe configuration a run recorded, with ``changes``."""
    recorded = json.loads((run_dir / "recipe.json").read_text())["config"]
    return replace(RecipeConfig.from_record(recorded, ignore_unknown=True), **changes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a finished recipe run folder (with recipe.json)")
    p.add_argument("--selection-knee", action="store_true",
                   help="validation windows where the training traffic is contested")
    p.add_argument("--selection-mixes", action="store_true",
                   help="also each training window with equal prompt-length bucket shares")
    p.add_argument("--export", type=Path, default=None, metavar="DIR",
                   help="write the kept checkpoint there")
    args = p.parse_args()
    summary = json.loads((args.run / "recipe.json").read_text())
    checkpoints = [Path(c) for c in summary["checkpoints"]]
    cfg = config_of(args.run, selection_knee=args.selection_knee,
                    selection_mixes=args.selection_mixes)
    start = time.perf_counter()
    recipe = Recipe(cfg)
    best, scores = recipe.select(checkpoints)
    if recipe.knee is not None:
        print("validation rate scales at the knee: " + "; ".join(
            f"{Path(t).name}: {', '.join(f'{r:g}' for r in rates)}"
            for t, rates in recipe.knee.items()))
    for path, score in zip(checkpoints, scores, strict=True):
        print(f"{path}: {score:.3f}" + ("  <- kept" if path == best else ""))
    print(f"recorded selection kept {summary['best']} "
          f"({', '.join(f'{s:.3f}' for s in summary['selection_scores'])}); "
          f"{time.perf_counter() - start:.0f} s")
    if args.export is not None:
        copy_artifact(best, args.export, {"selection_scores": scores,
                                          "selection_knee": args.selection_knee,
                                          "selection_mixes": args.selection_mixes})
        print(f"wrote {args.export}")


if __name__ == "__main__":
    main()
