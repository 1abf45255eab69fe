"""An ensemble of policy artifacts as one artifact: the mean of the members' action logits.

Students cloned from one teacher differ in which states they get right: measured over several
single-student recipes, each seed's checkpoints starved a different held-back run
(docs/notebook/BENCHMARKS-archive.md). The mean of their logits (a product of the members'
per-dimension action distributions) keeps an action only where the members agree on it. The
merged network is exact, not an approximation: the members' first layers are stacked (they read
the same observation), deeper layers are block-diagonal, and the action head is the members'
heads side by side divided by their number. So serving needs nothing new
(:class:`policies.artifact.PolicyArtifact`, numpy only) and the artifact format is unchanged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.linalg import block_diag

from policies.artifact import ArtifactError, PolicyArtifact, load_artifact, save_artifact
from policies.ppo import resolve_policy

# metadata that must agree for the members to read the same observation and act in the
# same action space behind the same guard
MUST_AGREE = ("nvec", "obs_size", "obs_version", "action_kind", "totals", "shares",
              "decision_ticks", "ladder", "pools", "bucket_edges", "activation", "obs_norm",
              "obs_range", "guard", "num_hidden")
_PROVENANCE = ("format", "format_version", "weights_sha256")


def merge(members: Sequence[PolicyArtifact]) -> PolicyArtifact:
    """One artifact whose logits are the mean of ``members``' logits.

    :param members: artifacts with the same observation, action space, guard and depth.
    :raises ArtifactError: fewer than one member, or members that disagree on any of
        :data:`MUST_AGREE`.
    """
    if not members:
        raise ArtifactError("an ensemble needs at least one member")
    first = members[0].metadata
    for i, member in enumerate(members[1:], start=1):
        for key in MUST_AGREE:
            if member.metadata.get(key) != first.get(key):
                raise ArtifactError(f"ensemble member {i} differs from member 0 in {key!r}: "
                                    f"{member.metadata.get(key)!r} vs {first.get(key)!r}")
    hidden: list[tuple[np.ndarray, np.ndarray]] = []
    for layer in range(len(members[0].hidden)):
        weights = [m.hidden[layer][0] for m in members]
        biases = [m.hidden[layer][1] for m in members]
        # the first layer reads the shared observation; deeper ones only their own member
        w = np.vstack(weights) if layer == 0 else block_diag(*weights)
        hidden.append((w, np.concatenate(biases)))
    k = float(len(members))
    heads = [m.head[0] for m in members]
    # linear members' heads all read the observation: their mean is the head
    head_w = (np.hstack(heads) if hidden else np.sum(heads, axis=0)) / k
    head_b = np.sum([m.head[1] for m in members], axis=0) / k
    meta = {key: value for key, value in first.items() if key not in _PROVENANCE}
    return PolicyArtifact(hidden, (head_w.astype(np.float32), head_b.astype(np.float32)),
                          meta)


def save_ensemble(paths: Sequence[str | Path], out: Path,
                  extra: dict[str, Any] | None = None) -> Path:
    """Merge the artifacts at ``paths`` and write the result to ``out``; returns its JSON path.

    The metadata is the first member's plus ``ensemble_members`` (each member's path and
    weights SHA-256) and ``extra``.
    """
    members = [load_artifact(p) for p in paths]
    merged = merge(members)
    record = [{"path": str(p), "weights_sha256": m.metadata.get("weights_sha256")}
              for p, m in zip(paths, members, strict=True)]
    return save_artifact(out, merged.hidden, merged.head,
                         {**merged.metadata, "ensemble_members": record, **(extra or {})})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m policies.training.ensemble",
        description="Merge trained policy artifacts (e.g. the seeds of one recipe) into one "
        "artifact whose action logits are the mean of theirs; serve it as ppo:OUT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("members", nargs="+",
                   help="artifact folders or policy.json files, or shipped policies by name "
                        "(default, seeds/seed1), at least two")
    p.add_argument("--out", type=Path, required=True,
                   help="folder to write policy.json and policy.safetensors to")
    p.add_argument("--force", action="store_true", help="overwrite an artifact in OUT")
    args = p.parse_args(argv)
    if len(args.members) < 2:
        p.error("an ensemble needs at least two members")
    if (args.out / "policy.json").exists() and not args.force:
        p.error(f"{args.out} already holds an artifact (--force to overwrite)")
    try:
        path = save_ensemble([resolve_policy(m) for m in args.members], args.out,
                             {"phase": "ensemble"})
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
