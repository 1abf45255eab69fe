"""``--labels near``: a decision labelled with every candidate the teacher counted as tied
with its choice, and behaviour cloning weighted by those labels."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from policies.training.distill import (
    Demonstrations,
    LabellingController,
    action_accuracy,
    fit_policy,
)
from policies.training.recipe import Recipe, RecipeConfig, build_student, make_labeller
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.controllers import make_controller
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.scenarios import make_scenario

CODEC = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)


def _demos(near: bool) -> Demonstrations:
    """One state, five decisions: the teacher chose total index 2 twice, alone, and 5 three
    times, each tied with another index. By choice 5 wins (3 of 5); by near-best weight 2
    does (2 against 1.5), which it does not by unweighted rows (2 against 3)."""
    decisions = [[2], [2], [5, 3], [5, 4], [5, 6]]
    actions, weights, chosen = [], [], []
    for totals in decisions:
        labels = totals if near else totals[:1]
        for i, t in enumerate(labels):
            action = np.zeros(len(CODEC.nvec), dtype=np.int64)
            action[0] = t
            action[1::2] = len(SHARE_LADDER) - 1
            actions.append(action)
            weights.append(1.0 / len(labels))
            chosen.append(i == 0)
    return Demonstrations(np.full((len(actions), 24), 0.3, dtype=np.float32), np.array(actions),
                          np.array(weights, dtype=np.float32), np.array(chosen, dtype=bool))


@pytest.mark.parametrize("near, mode", [(False, 5), (True, 2)])
def test_near_labels_fit_the_action_most_often_near_best(tmp_path: Path, near: bool,
                                                         mode: int) -> None:
    import torch

    demos = _demos(near)
    assert demos.decisions == 5 and len(demos) == (8 if near else 5)
    policy = build_student(RecipeConfig(out=str(tmp_path), net_arch=(16,)), CODEC, 24)
    fit_policy(policy, demos, epochs=200, batch_size=8, learning_rate=1e-2)
    with torch.no_grad():
        total = int(policy.get_distribution(torch.as_tensor(demos.obs[:1])).mode()[0, 0])
    assert total == mode
    # accuracy counts the teacher's own choices only: 2 of 5 are index 2, 3 index 5
    assert action_accuracy(policy, demos) == pytest.approx(0.4 if mode == 2 else 0.6)


def test_demonstrations_refuse_mismatched_columns_and_concat_keeps_weights() -> None:
    obs = np.zeros((3, 24), dtype=np.float32)
    actions = np.zeros((3, len(CODEC.nvec)), dtype=np.int64)
    with pytest.raises(ValueError, match="as many actions, weights and choices"):
        Demonstrations(obs, actions, np.ones(2, dtype=np.float32))
    plain = Demonstrations(obs, actions)
    assert plain.decisions == 3 and np.all(plain.weights == 1)
    both = Demonstrations.concat([plain, _demos(True)])
    assert both.decisions == 8 and len(both) == 11
    assert both.weights is not None and float(both.weights.sum()) == pytest.approx(8.0)


def test_near_labels_keep_the_teachers_choices_and_add_its_ties(tmp_path: Path) -> None:
    cfg = RecipeConfig(out=str(tmp_path), teacher="mpc")
    workload = make_scenario("day", seed=0, duration_s=60.0)
    spec = DeploymentSpec()
    taken = {}
    for labels in ("choice", "near"):
        labeller = make_labeller(replace(cfg, labels=labels), CODEC)
        run(workload, labeller, spec, drain_s=10.0)
        taken[labels] = labeller.take()
    choice, near = taken["choice"], taken["near"]
    assert near.chosen is not None and near.weights is not None
    assert near.decisions == choice.decisions == len(choice) > 3
    assert len(near) > near.decisions  # light load: several totals tie
    # the choice rows are exactly what the choice labels record, in order
    assert np.array_equal(near.actions[near.chosen], choice.actions)
    assert np.array_equal(near.obs[near.chosen], choice.obs)
    # each decision's labels weigh 1 in all, and no label repeats within a decision
    starts = [*np.flatnonzero(near.chosen).tolist(), len(near)]
    for lo, hi in pairwise(starts):
        assert float(near.weights[lo:hi].sum()) == pytest.approx(1.0)
        assert len({tuple(a) for a in near.actions[lo:hi]}) == hi - lo


def test_near_labels_need_a_teacher_that_reports_its_ties() -> None:
    with pytest.raises(ValueError, match="last_near"):
        LabellingController(make_controller("static:64"), CODEC, 4, 256,  # type: ignore[arg-type]
                            labels="near")
    with pytest.raises(ValueError, match="labels must be one of"):
        LabellingController(make_controller("mpc"), CODEC, 4, 256,  # type: ignore[arg-type]
                            labels="nearest")
    with pytest.raises(ValueError, match="labels must be one of"):
        RecipeConfig(labels="soft")
    with pytest.raises(ValueError, match="does not expose last_proposal"):
        Recipe(RecipeConfig(teacher="playbook"))  # at set-up, before any work
