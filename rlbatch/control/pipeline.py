"""The one decision pipeline: propose -> release -> guard, and the admission discipline.

Every controller that sits behind the guard (the rule controllers, ``ppo:PATH``, ``mpc``), the
Gymnasium env a policy is trained in, the sidecar's fallback and ``mpc``'s check of its
candidates turn a proposal into the action in force through this one class, with the same
parameters in training and in serving:

1. **propose**: a policy or a rule proposes caps, routes and a total;
2. **release**: what the proposal holds back is released once it has waited too long
   (:class:`~rlbatch.control.hold_release.HoldRelease`, relative to the SLA in force; off
   unless set);
3. **guard**: the hard rules (:class:`~rlbatch.control.guard.Guard`) make it safe.

The order of admission's queues and the KV budget are not part of an action: they are
admission's discipline for the whole run (:mod:`rlbatch.control.discipline`), which the
pipeline states (:attr:`DecisionPipeline.discipline`) and the control loop puts in force once.
"""

from __future__ import annotations

from rlbatch.control.discipline import AdmissionDiscipline, QueueOrder, check_queue_order
from rlbatch.control.guard import Guard, GuardConfig, Override
from rlbatch.control.hold_release import HoldRelease, release_late_holds
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo, DeploymentStats


class DecisionPipeline:
    """A proposal's way to the action in force (module docstring).

    :param guard: the guard's configuration (default rules when ``None``).
    :param release: when held-back work is released (``None``: never).
    :param order: the order of admission's queues.
    """

    def __init__(self, guard: GuardConfig | None = None, release: HoldRelease | None = None,
                 order: QueueOrder = "fifo") -> None:
        self.guard = Guard(guard or GuardConfig())
        self.release = release
        self.order = check_queue_order(order)
        self._sla = SLA()

    @property
    def config(self) -> GuardConfig:
        """The guard's configuration."""
        return self.guard.config

    @property
    def discipline(self) -> AdmissionDiscipline:
        """Admission's discipline behind this pipeline: its order, and the guard's KV budget."""
        return AdmissionDiscipline(self.order, self.guard.config.kv_budget)

    def reset(self, info: DeploymentInfo) -> None:
        """Start of a run: the guard forgets its state; the SLA in force is ``info``'s."""
        self.guard.reset(info)
        self._sla = info.sla

    def decide(self, proposal: ControlAction | None,
               stats: DeploymentStats | None) -> tuple[ControlAction, list[Override]]:
        """The action in force for ``proposal`` after the tick ``stats`` (``None`` before the
        first tick), and what the guard overrode.

        :param proposal: the policy's or rule's proposal (``None``: none could be had; the
            guard's safe default applies).
        :param stats: the tick that just ended.
        """
        if proposal is not None and stats is not None:
            proposal = self.released(proposal, stats)
        return self.guard.check(proposal, stats)

    def released(self, proposal: ControlAction, stats: DeploymentStats) -> ControlAction:
        """The release stage alone: ``proposal`` with what has waited too long released
        (unchanged without a release).

        :param proposal: a proposal.
        :param stats: the tick that just ended.
        """
        if self.release is None:
            return proposal
        return release_late_holds(
            proposal, stats, wait_s=self.release.wait_fraction * self._sla.ttft_s,
            tpot_sla_s=self._sla.tpot_s, max_total=self.guard.config.max_cap,
            tpot_tolerance=self.release.tpot_tolerance, release_total=self.release.total)

    def fallback_action(self) -> ControlAction:
        """Safe caps when no observation can be had (e.g. a metrics scrape failed)."""
        return self.guard.fallback_action()
