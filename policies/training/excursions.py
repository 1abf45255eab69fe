"""Teacher episodes with excursions: labels for the states a student drifts into.

Behaviour cloning labels the states the teacher visits; a student that errs once (a total
of 256 where the teacher keeps 24) reaches states the teacher never visits, where nothing
told it what to do, and it tends to stay there: on RAG at 1 s / 50 ms the students pick within
a ladder step of ``mpc`` on ``mpc``'s own states and 256 against its 24 on their own. DAgger
labels the student's states, but only on the traffic and SLAs its few rounds happen to draw.
Excursions perturb every teacher episode instead, as DART does (Laskey et al., CoRL 2017):
now and then the total in force is replaced by one drawn from the ladder for a few decisions
while the teacher keeps labelling, so that every family and SLA carries labels for "the
total is wrong; what now?" and for the way back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.rules import GuardedController
from rlbatch.control.action_codec import TotalShareCodec
from rlbatch.control.controllers import Controller
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats


@dataclass(frozen=True)
class Excursions:
    """How often, and for how long, a teacher episode leaves the teacher's total.

    :param share: chance, at each decision outside an excursion, that one starts.
    :param decisions: shortest and longest excursion, in decisions (drawn uniformly).
    :raises ValueError: a share outside ``[0, 1]`` or lengths that are not
        ``1 <= low <= high``.
    """

    share: float
    decisions: tuple[int, int] = (2, 12)

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise ValueError(f"excursion share must be in [0, 1], got {self.share}")
        low, high = self.decisions
        if not 1 <= low <= high:
            raise ValueError(f"excursion lengths must be 1 <= low <= high decisions, got "
                             f"{self.decisions}")

    def expected_share(self) -> float:
        """Long-run share of decisions spent in excursions."""
        mean = (self.decisions[0] + self.decisions[1]) / 2
        return self.share * mean / (1 + self.share * mean) if self.share > 0 else 0.0


class ExcursionController(GuardedController):
    """Drives a teacher episode: the teacher's proposal, with its total replaced during
    excursions by one drawn uniformly from the student's total ladder (shares and pools
    stay the teacher's), through a pipeline configured as the teacher's.

    The teacher must decide before this controller at every tick (the labeller's order), so
    that :attr:`~rlbatch.control.controllers.Controller.last_proposal` is the current one.

    :param teacher: the labelling teacher (a guarded controller that reports proposals).
    :param codec: the student's action space.
    :param excursions: how often and for how long.
    :param decision_ticks: ticks per decision (an excursion's length counts decisions).
    :param seed: seed of the excursions' draws (each reset starts the same sequence).
    :raises ValueError: a teacher without a pipeline, or one that does not report proposals.
    """

    def __init__(self, teacher: Controller, codec: TotalShareCodec, excursions: Excursions,
                 decision_ticks: int, seed: int) -> None:
        pipeline = teacher.pipeline
        if pipeline is None or not teacher.reports_proposals:
            raise ValueError(f"excursions need a guarded teacher that reports its proposals; "
                             f"{teacher.name} does not")
        super().__init__(f"excursions:{teacher.name}", pipeline.config, pipeline.order,
                         pipeline.release)
        self.teacher = teacher
        self.codec = codec
        self.excursions = excursions
        self.decision_ticks = decision_ticks
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._ticks = 0
        self._left = 0
        self._total_index = 0
        self.excursion_decisions = 0
        """Decisions taken inside an excursion in this run."""

    def on_reset(self, info: DeploymentInfo) -> None:
        self.rng = np.random.default_rng(self.seed)
        self._ticks = 0
        self._left = 0
        self.excursion_decisions = 0

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        base = self.teacher.last_proposal
        if base is None:
            raise RuntimeError(f"{self.teacher.name} has no proposal: it must decide first")
        if stats is not None:
            self._ticks += 1
            if (self._ticks - 1) % self.decision_ticks == 0:
                self._step()
        if self._left == 0:
            return base
        action = self.codec.encode(base)
        action[0] = self._total_index
        return self.codec.decode(action)

    def _step(self) -> None:
        """One decision: go on with the excursion in progress, or maybe start one."""
        if self._left > 0:
            self._left -= 1
        elif self.rng.random() < self.excursions.share:
            low, high = self.excursions.decisions
            self._left = int(self.rng.integers(low, high + 1))
            self._total_index = int(self.rng.integers(len(self.codec.totals)))
        if self._left > 0:
            self.excursion_decisions += 1
