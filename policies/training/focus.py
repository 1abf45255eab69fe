"""Where the student errs: DAgger rounds weighted to the traffic families it imitates worst.

Behaviour cloning fits the bulk of the data; traffic that needs another batch (code
completion: long prompts, a dozen output tokens) is a few episodes of it, so the student can
fit the bulk and keep the bulk's total there. After every fit the recipe measures, per kind of
episode, how far the student's total is from the teacher's on the teacher's own choices, and
draws the next DAgger round's families at odds that grow with that distance.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from policies.training.distill import Demonstrations
from policies.training.episodes import TRAINING_FAMILIES

FOCUS_FLOOR = 0.1
"""Odds every family keeps (in steps of the total ladder), so none drops out of DAgger."""


def total_errors(policy: Any, demos: Sequence[Demonstrations], kinds: Sequence[str]
                 ) -> dict[str, float]:
    """Per kind of episode, the mean distance in steps of the total ladder between the total
    the student picks (its deterministic action) and the teacher's, over the teacher's own
    choices.

    :param policy: an SB3 policy whose first action dimension is the total's index.
    :param demos: demonstrations per episode.
    :param kinds: the kind of each episode (same length as ``demos``).
    :raises ValueError: ``demos`` and ``kinds`` of different lengths.
    """
    import torch

    if len(demos) != len(kinds):
        raise ValueError(f"{len(demos)} episodes but {len(kinds)} kinds")
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for part, kind in zip(demos, kinds, strict=True):
        assert part.chosen is not None
        obs, actions = part.obs[part.chosen], part.actions[part.chosen]
        if len(obs) == 0:
            continue
        with torch.no_grad():
            mode = policy.get_distribution(torch.as_tensor(obs, dtype=torch.float32)).mode()
        picked = mode.cpu().numpy().reshape(actions.shape)[:, 0]
        sums[kind] += float(np.abs(picked - actions[:, 0]).sum())
        counts[kind] += len(obs)
    return {kind: sums[kind] / counts[kind] for kind in sorted(counts)}


def focus_weights(errors: Mapping[str, float], floor: float = FOCUS_FLOOR) -> dict[str, float]:
    """Odds of each of :data:`~policies.training.episodes.TRAINING_FAMILIES` in the next
    DAgger round: ``floor`` plus the student's mean total error on it; a family with no
    episode yet counts as the worst one seen (1 ladder step when none is).

    :raises ValueError: a floor that is not > 0.
    """
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}")
    seen = [errors[f] for f in TRAINING_FAMILIES if f in errors]
    unseen = max(seen) if seen else 1.0
    return {f: floor + float(errors.get(f, unseen)) for f in TRAINING_FAMILIES}
