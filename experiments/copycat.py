"""How much a cloned student's decisions follow the action in force (the copycat problem).

    .venv/bin/python experiments/copycat.py policies/two-pool --run azure --rate-scale 2.125 \
        --pools fp16:1,fp8:1

The student serves one run of the evaluation protocol (as ``trace_run.py`` picks it) and
every observation it decided on is kept. Each observation is then re-decided with its
cap features (per-bucket ``cap`` and ``total_cap``) set to the smallest and to
the largest total on the student's ladder, all else unchanged. The action in force says
nothing about the traffic that the other features do not, so a student that reads the world
decides the same either way; one that copies its last action follows the edited features.
Printed: the mean total chosen and the share of decisions whose total changed, per edit.
A student of observation version 4 has no such features; its line says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import policies.evaluation.protocol as protocol
from policies.artifact import load_artifact
from policies.ppo import PpoController
from rlbatch.control.observation import TOTAL_NORM
from rlbatch.control.types import DeploymentInfo
from rlbatch.serving.run import run


class _Recording(PpoController):
    """The student, keeping every observation its builder makes."""

    def on_reset(self, info: DeploymentInfo) -> None:
        super().on_reset(info)
        self.observations: list[np.ndarray] = []
        builder = self._builder
        assert builder is not None  # set by PpoController.on_reset
        build = builder.build

        def recording_build(*args: object, **kwargs: object) -> np.ndarray:
            obs = build(*args, **kwargs)  # type: ignore[arg-type]
            self.observations.append(obs.copy())
            return obs

        builder.build = recording_build  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help="a student artifact folder (total_share actions)")
    protocol.add_run_options(p)
    args = p.parse_args()
    spec, _, workload = protocol.run_from_args(p, args)
    artifact = load_artifact(Path(args.artifact))
    meta = artifact.metadata
    if meta.get("action_kind") != "total_share":
        p.error("the artifact does not choose a total (action_kind total_share)")
    names = [str(n) for n in meta["feature_names"]]
    # the pool in force is left alone: the edits are about the total
    edited = [i for i, n in enumerate(names) if n.rpartition("/")[2] in ("cap", "total_cap")]
    student = _Recording(artifact, name="student")
    run(workload, student, spec, rate_scale=args.rate_scale)
    obs = np.array(student.observations, dtype=np.float32)
    totals = [int(t) for t in meta["totals"]]
    chosen = np.array([totals[int(artifact.act(o)[0])] for o in obs])
    print(f"{args.artifact}: observation version {meta.get('obs_version')}, "
          f"{len(obs)} observations; as served: mean total {chosen.mean():.1f}")
    if not edited:
        print("no cap features in force: nothing to edit")
        return
    for total in (totals[0], totals[-1]):
        edit = obs.copy()
        # caps and the total are stated over the ladder's top, which is TOTAL_NORM here
        edit[:, edited] = total / TOTAL_NORM
        again = np.array([totals[int(artifact.act(o)[0])] for o in edit])
        print(f"action in force set to {total:3d}: mean total {again.mean():.1f}, "
              f"{np.mean(again != chosen):.0%} of decisions change their total")


if __name__ == "__main__":
    main()
