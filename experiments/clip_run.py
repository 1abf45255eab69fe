"""Give a finished recipe run's checkpoints the range of the observations each was fitted on.

    .venv/bin/python experiments/clip_run.py runs/s13/v4-s1 --out runs/s15/clip-v4-s1

A cloned student extrapolates arbitrarily on observations past anything it was fitted on
(issue 14, stop 15: on Mooncake the 4k+ bucket's running and arrival features sit above
their training maximum in 97-98% of a student's decisions). ``train.py --obs-clip`` records
each checkpoint's fitted range in its artifact (``obs_range``), which clips every observation
into it. This script does the same for a run trained without it: it replays the run's
teacher data and DAgger rounds (the recorded configuration and seed draw the same episodes;
each round's recorded checkpoint drives) and writes each checkpoint, with the range of the
decisions it was fitted on, under ``--out``. Only training traffic is read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reselect import config_of

from policies.artifact import copy_artifact
from policies.training.distill import Demonstrations
from policies.training.recipe import Recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a finished recipe run folder (with recipe.json)")
    p.add_argument("--out", type=Path, required=True, help="folder for the clipped copies")
    args = p.parse_args()
    summary = json.loads((args.run / "recipe.json").read_text())
    checkpoints = [Path(c) for c in summary["checkpoints"]]
    cfg = config_of(args.run)
    students = [c for c in checkpoints if c.name != "student-finetuned"]
    if len(students) != cfg.dagger_rounds + 1:
        raise SystemExit(f"{args.run}: {len(students)} students for {cfg.dagger_rounds} "
                         "DAgger rounds")
    start = time.perf_counter()
    recipe = Recipe(cfg)
    recipe.teacher_data()
    # checkpoints are in training order: each student was fitted on everything collected
    # before it, then drove the next DAgger round; the fine-tuned one started from the last
    for round_, path in enumerate(checkpoints):
        data = Demonstrations.concat(recipe.demos)
        copy_artifact(path, args.out / path.name, {"obs_range": data.observation_range()})
        print(f"{path} -> {args.out / path.name} ({data.decisions} decisions)", flush=True)
        if round_ < cfg.dagger_rounds:
            recipe.dagger_round(path / "policy.json", round_)
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
