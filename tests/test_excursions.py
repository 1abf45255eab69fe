"""Teacher episodes with excursions: the teacher labels while the total in force leaves its."""

from __future__ import annotations

from typing import Any

import pytest

from policies.training.command import _recipe_config, parse_args
from policies.training.distill import LabellingController
from policies.training.excursions import ExcursionController, Excursions
from policies.training.recipe import RecipeConfig
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.controllers import Controller, make_controller
from rlbatch.control.types import ControlAction, DeploymentStats
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import Workload
from rlbatch.workload.scenarios import make_scenario

CODEC = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)
SPEC = DeploymentSpec()


def _workload() -> Workload:
    return make_scenario("bursty", seed=3, duration_s=120.0, rate_scale=1.5)


class RecordingExcursions(ExcursionController):
    """Keeps every proposal with whether it was made inside an excursion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proposed: list[tuple[bool, ControlAction, ControlAction]] = []

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        action = super().propose(stats)
        assert self.teacher.last_proposal is not None
        self.proposed.append((self._left > 0, action, self.teacher.last_proposal))
        return action


def _labelled_run(share: float, seed: int, decisions: tuple[int, int] = (1, 3)
                  ) -> tuple[LabellingController, RecordingExcursions, list[Any]]:
    """The labeller's run, the excursions' record and, per tick, the action in force and
    the requests finished."""
    teacher = make_controller("mpc")
    actor = RecordingExcursions(teacher, CODEC, Excursions(share, decisions), 5, seed)
    labeller = LabellingController(teacher, CODEC, 5, max(CODEC.totals), 5, actor)
    applied: list[Any] = []
    run(_workload(), labeller, SPEC, drain_s=20.0,
        on_tick=lambda s: applied.append((s.action, [r.ttft_s for r in s.finished])))
    return labeller, actor, applied


@pytest.mark.parametrize("share, decisions, message", [
    (-0.1, (2, 12), "share"), (1.5, (2, 12), "share"),
    (0.1, (0, 3), "1 <= low <= high"), (0.1, (5, 2), "1 <= low <= high")])
def test_excursions_refuse_bad_settings(share: float, decisions: tuple[int, int],
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Excursions(share, decisions)
    with pytest.raises(ValueError, match=message):
        RecipeConfig(traces=(), deployments=(), excursions=share, excursion_decisions=decisions)


def test_the_expected_share_of_decisions_in_excursions() -> None:
    # one start per 1 / share decisions outside, then 7 decisions inside on average
    assert Excursions(0.1, (2, 12)).expected_share() == pytest.approx(0.7 / 1.7)
    assert Excursions(0.0).expected_share() == 0.0
    assert RecipeConfig(traces=(), deployments=()).excursion_plan() is None
    assert RecipeConfig(traces=(), deployments=(),
                        excursions=0.2).excursion_plan() == Excursions(0.2, (2, 12))


def test_excursions_need_a_teacher_that_reports_its_proposals() -> None:
    with pytest.raises(ValueError, match="reports its proposals"):
        ExcursionController(make_controller("fixed:64"), CODEC, Excursions(0.5), 5, 0)


def test_without_excursions_the_run_is_the_teachers_own() -> None:
    """Share 0: every tick's action in force is the one the teacher alone puts in force
    (the controller's pipeline is configured as the teacher's)."""
    alone: list[Any] = []
    teacher: Controller = make_controller("mpc")
    run(_workload(), teacher, SPEC, drain_s=20.0,
        on_tick=lambda s: alone.append((s.action, [r.ttft_s for r in s.finished])))
    _, actor, applied = _labelled_run(0.0, seed=1)
    assert applied == alone
    assert actor.excursion_decisions == 0
    assert all(not inside and action == proposal for inside, action, proposal in actor.proposed)


def test_excursions_put_ladder_totals_in_force_while_the_teacher_labels() -> None:
    """Share 1 with excursions of 1-3 decisions: each excursion lasts 1, 2 or 3 decisions
    (all three seen) and the next starts one decision after it ends; inside, a total from
    the ladder with the teacher's shares; the labels stay the teacher's proposals; the same
    seed draws the same excursions, another seed others."""
    labeller, actor, applied = _labelled_run(1.0, seed=1)
    demos = labeller.take()
    flags = [inside for inside, _, _ in actor.proposed[1::5]]  # the decision ticks
    assert len(flags) == len(demos) and actor.excursion_decisions == sum(flags)
    runs = "".join("x" if f else "." for f in flags).strip(".").split(".")
    assert {len(r) for r in runs[:-1]} == {1, 2, 3}  # the last may be cut by the run's end
    assert "" not in runs and len(runs[-1]) <= 3
    inside = [(a, p) for flag, a, p in actor.proposed if flag]
    assert inside and all(a.max_num_seqs in TOTAL_LADDER for a, _ in inside)
    assert all(a.caps == CODEC.decode([CODEC.encode(a)[0], *CODEC.encode(p)[1:]]).caps
               for a, p in inside)
    assert any(a.max_num_seqs != p.max_num_seqs for a, p in inside)
    # the labels are the teacher's totals, not the ones in force
    teacher_totals = [CODEC.totals[int(i)] for i in demos.actions[:, 0]]
    outside = [p.max_num_seqs for flag, _, p in actor.proposed[1::5] if not flag]
    assert set(outside) <= set(teacher_totals)
    _, _, applied_again = _labelled_run(1.0, seed=1)
    assert applied_again == applied
    _, other, _ = _labelled_run(1.0, seed=2)
    assert [a.max_num_seqs for f, a, _ in other.proposed if f] != \
        [a.max_num_seqs for f, a, _ in actor.proposed if f]


def test_the_flags_reach_the_recipe() -> None:
    args = parse_args(["--excursions", "0.15",
                       "--excursion-decisions", "4,8", "--train-deployments", "none"])
    cfg = _recipe_config(args, ())
    assert (cfg.excursions, cfg.excursion_decisions) == (0.15, (4, 8))
    with pytest.raises(SystemExit):
        parse_args(["--excursion-decisions", "2.5,8"])
