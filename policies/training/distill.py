"""Teacher -> student: behaviour cloning and DAgger from a planning teacher (``mpc``).

The teacher is any controller that says which action it proposed before its pipeline
(:attr:`~rlbatch.control.controllers.Controller.last_proposal`); the planner
(:mod:`policies.mpc`) is the intended one. A run is driven
by :func:`rlbatch.serving.run.run`, so the teacher gets its digital twin exactly as in
``rlbatch evaluate``. At every decision point the student's observation (the same
:class:`~rlbatch.control.observation.ObservationBuilder` the env and serving use) is stored
with the teacher's proposal, encoded in the student's action space.

* Behaviour cloning: the teacher acts; its decisions are the labels.
* DAgger: the student acts (so the data covers the states the student itself reaches) and
  the teacher, bound to the same deployment, labels every decision.

The student is an SB3 ``MlpPolicy``; :func:`fit_policy` maximises the log-likelihood of the
labels, so PPO can fine-tune the same network afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbatch.control.action_codec import Codec, TotalShareCodec
from rlbatch.control.controllers import Controller, make_controller
from rlbatch.control.discipline import AdmissionDiscipline
from rlbatch.control.observation import ObservationBuilder
from rlbatch.control.pipeline import DecisionPipeline
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import Workload


@dataclass
class Demonstrations:
    """Observations and the teacher's encoded actions, one row per label.

    With ``--labels near`` a decision has one row per candidate the teacher counted as tied
    with its choice, each weighted ``1 / ties``; ``chosen`` marks the row of the action it
    took. Otherwise every decision is one row of weight 1.

    :param obs: ``(N, obs_size)`` float32.
    :param actions: ``(N, len(nvec))`` int64.
    :param weights: ``(N,)`` float32 label weights (``None``: all 1).
    :param chosen: ``(N,)`` bool, the teacher's own choice (``None``: every row).
    """

    obs: np.ndarray
    actions: np.ndarray
    weights: np.ndarray | None = None
    chosen: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.obs.shape[0]
        if self.weights is None:
            self.weights = np.ones(n, dtype=np.float32)
        if self.chosen is None:
            self.chosen = np.ones(n, dtype=bool)
        if not (self.actions.shape[0] == self.weights.shape[0] == self.chosen.shape[0] == n):
            raise ValueError(f"demonstrations of {n} observations need as many actions, "
                             f"weights and choices, got {self.actions.shape[0]}, "
                             f"{self.weights.shape[0]}, {self.chosen.shape[0]}")

    def __len__(self) -> int:
        return int(self.obs.shape[0])

    @property
    def decisions(self) -> int:
        """Decisions recorded (rows of the teacher's own choice)."""
        assert self.chosen is not None
        return int(self.chosen.sum())

    def observation_range(self) -> dict[str, list[float]]:
        """Per-feature low / high of the observations (a student artifact's ``obs_range``
        when it is fitted on these)."""
        return {"low": self.obs.min(axis=0).tolist(), "high": self.obs.max(axis=0).tolist()}

    @staticmethod
    def concat(parts: Sequence[Demonstrations]) -> Demonstrations:
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("no demonstrations")
        return Demonstrations(np.concatenate([p.obs for p in parts]),
                              np.concatenate([p.actions for p in parts]),
                              np.concatenate([p.weights for p in parts]),
                              np.concatenate([p.chosen for p in parts]))


LABELS = ("choice", "near")
"""How a decision is labelled: the teacher's choice, or every candidate it counted as tied
with it (a planner exposing ``last_near``, e.g. :class:`policies.mpc.MpcController`)."""


def check_labels(labels: str) -> None:
    """:raises ValueError: ``labels`` is not one of :data:`LABELS`."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {labels!r}")


class LabellingController(Controller):
    """Runs the teacher (behaviour cloning) or a student (DAgger) and records, every
    ``decision_ticks`` ticks, the student's observation and the teacher's proposal.

    :param teacher: the labelling controller (always consulted, so its state follows the run).
    :param codec: the student's action space.
    :param obs_version: the student's observation version.
    :param max_cap: the student's per-bucket cap normaliser.
    :param decision_ticks: ticks between two recorded decisions.
    :param actor: ``None``: the teacher's actions are applied; else the student's.
    :param labels: one of :data:`LABELS`; ``near`` needs a teacher with ``last_near`` and
        ``action(key)``.
    """

    def __init__(self, teacher: Controller, codec: Codec, obs_version: int, max_cap: int,
                 decision_ticks: int = 1, actor: Controller | None = None,
                 labels: str = "choice") -> None:
        if decision_ticks < 1:
            raise ValueError(f"decision_ticks must be >= 1, got {decision_ticks}")
        check_labels(labels)
        if labels == "near" and not (hasattr(teacher, "last_near")
                                     and hasattr(teacher, "action")):
            raise ValueError(f"teacher {teacher.name} does not say which candidates tied "
                             "(last_near); use labels='choice'")
        self.labels = labels
        self.teacher = teacher
        self.actor = actor
        self.codec = codec
        self.obs_version = obs_version
        self.max_cap = max_cap
        self.decision_ticks = decision_ticks
        self.name = f"label:{teacher.name}" + (f"/{actor.name}" if actor else "")
        self._builder: ObservationBuilder | None = None
        self._obs: list[np.ndarray] = []
        self._actions: list[np.ndarray] = []
        self._weights: list[float] = []
        self._chosen: list[bool] = []
        self._ticks = 0

    def bind(self, twin: Any) -> bool:
        """Hand the run's twin to whichever party plans with one."""
        bound = [party.bind(twin) for party in (self.teacher, self.actor) if party is not None]
        return any(bound)

    @property
    def in_charge(self) -> Controller:
        """The party whose actions are applied: the student in DAgger, else the teacher."""
        return self.actor if self.actor is not None else self.teacher

    @property
    def pipeline(self) -> DecisionPipeline | None:
        return self.in_charge.pipeline

    @property
    def discipline(self) -> AdmissionDiscipline:
        return self.in_charge.discipline

    @property
    def guard_overrides_total(self) -> int:
        return self.in_charge.guard_overrides_total

    def reset(self, info: DeploymentInfo) -> ControlAction:
        self._builder = ObservationBuilder(info, self.max_cap, version=self.obs_version)
        self._ticks = 0
        first = self.teacher.reset(info)
        if self.actor is not None:
            return self.actor.reset(info)
        return first

    def decide(self, stats: DeploymentStats) -> ControlAction:
        if self._builder is None:
            raise RuntimeError("decide() before reset()")
        self._ticks += 1
        obs = self._builder.build(stats, self.in_charge.guard_flags())
        teacher_action = self.teacher.decide(stats)
        if (self._ticks - 1) % self.decision_ticks == 0:
            proposal = self.teacher.last_proposal or teacher_action
            labels = self._labels(self.codec.encode(proposal))
            for i, label in enumerate(labels):
                self._obs.append(obs)
                self._actions.append(label)
                self._weights.append(1.0 / len(labels))
                self._chosen.append(i == 0)
        if self.actor is not None:
            return self.actor.decide(stats)
        return teacher_action

    def _labels(self, chosen: np.ndarray) -> list[np.ndarray]:
        """The teacher's choice first, then (``near``) every other tied candidate once."""
        out = {tuple(int(x) for x in chosen): np.asarray(chosen)}
        if self.labels == "near":
            for key in self.teacher.last_near:  # type: ignore[attr-defined]
                label = np.asarray(self.codec.encode(self.teacher.action(key)))  # type: ignore[attr-defined]
                out.setdefault(tuple(int(x) for x in label), label)
        return list(out.values())

    def take(self) -> Demonstrations:
        """The decisions recorded so far (and forget them)."""
        n_act = len(self.codec.nvec)
        size = self._builder.size if self._builder is not None else 0
        demos = Demonstrations(
            np.array(self._obs, dtype=np.float32).reshape(-1, size),
            np.array(self._actions, dtype=np.int64).reshape(-1, n_act),
            np.array(self._weights, dtype=np.float32), np.array(self._chosen, dtype=bool))
        self._obs, self._actions, self._weights, self._chosen = [], [], [], []
        return demos


def student_labeller(student: Any, teacher: str) -> LabellingController:
    """``student`` (a total/share :class:`policies.ppo.PpoController`) driving while the
    controller ``teacher`` labels each of its decisions, as in a DAgger round.

    :raises ValueError: the student acts on another action kind (its totals and shares are
        what a teacher's proposals are encoded as).
    """
    if student.action_kind != "total_share":
        raise ValueError(f"{student.name} acts on {student.action_kind} caps; only total/share "
                         "students can be compared with a teacher's proposals")
    meta = student.artifact.metadata
    codec = TotalShareCodec(tuple(int(t) for t in meta["totals"]),
                            tuple(float(s) for s in meta["shares"]), tuple(meta["pools"]),
                            len(meta["bucket_edges"]) + 1)
    return LabellingController(make_controller(teacher), codec,
                               student.obs_version, max(codec.totals), student.decision_ticks,
                               student)


def collect(labeller: LabellingController, workloads: Sequence[Workload],
            spec: DeploymentSpec, *, drain_s: float = 120.0) -> tuple[Demonstrations,
                                                                      list[dict[str, Any]]]:
    """Run the labeller over every workload; return the demonstrations and the run rows."""
    parts: list[Demonstrations] = []
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        rows.append(run(workload, labeller, spec, drain_s=drain_s).row)
        parts.append(labeller.take())
    return Demonstrations.concat(parts), rows


def fit_policy(policy: Any, demos: Demonstrations, *, epochs: int = 60,
               batch_size: int = 64, learning_rate: float = 3e-3, seed: int = 0,
               log: Any = None) -> list[float]:
    """Behaviour cloning: maximise the log-likelihood of the teacher's actions under an SB3
    ``ActorCriticPolicy`` (in place), each row weighted by its label weight (all 1 unless
    ``near`` labels). Returns the mean loss per epoch.

    :param policy: ``model.policy`` of an SB3 PPO model whose spaces match the demos.
    :param demos: observations and encoded teacher actions.
    :param epochs: passes over the data.
    :param batch_size: minibatch size.
    :param learning_rate: Adam step size (a fresh optimiser; PPO's is left alone).
    :param seed: shuffling seed.
    :param log: optional ``callable(epoch, loss, accuracy)``.
    """
    import torch

    if len(demos) == 0:
        raise ValueError("no demonstrations to fit")
    rng = np.random.default_rng(seed)
    obs = torch.as_tensor(demos.obs, dtype=torch.float32)
    actions = torch.as_tensor(demos.actions, dtype=torch.int64)
    weights = torch.as_tensor(demos.weights, dtype=torch.float32)
    # all-1 weights take the plain mean, as fits did before near labels existed
    weighted = bool((weights != 1).any())
    params = [p for name, p in policy.named_parameters() if not name.startswith("value")]
    optimiser = torch.optim.Adam(params, lr=learning_rate)
    losses: list[float] = []
    policy.set_training_mode(True)
    for epoch in range(epochs):
        order = rng.permutation(len(demos))
        total = 0.0
        for start in range(0, len(order), batch_size):
            idx = torch.as_tensor(order[start:start + batch_size])
            dist = policy.get_distribution(obs[idx])
            log_prob, mass = dist.log_prob(actions[idx]), weights[idx].sum()
            loss = (-(weights[idx] * log_prob).sum() / mass if weighted
                    else -log_prob.mean())
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += float(loss.detach()) * float(mass)
        losses.append(total / float(weights.sum()))
        if log is not None:
            log(epoch, losses[-1], action_accuracy(policy, demos))
    policy.set_training_mode(False)
    return losses


def action_accuracy(policy: Any, demos: Demonstrations) -> float:
    """Share of decisions where the student's deterministic action equals the teacher's
    choice on every dimension."""
    import torch

    assert demos.chosen is not None
    obs, actions = demos.obs[demos.chosen], demos.actions[demos.chosen]
    with torch.no_grad():
        dist = policy.get_distribution(torch.as_tensor(obs, dtype=torch.float32))
        mode = dist.mode().cpu().numpy()
    return float(np.mean(np.all(mode.reshape(actions.shape) == actions, axis=1)))
