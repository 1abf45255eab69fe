"""The learning recipe: planner teacher -> behaviour-cloned student -> DAgger -> PPO
fine-tuning -> selection.

1. **Teacher data**: the ``mpc`` planner runs on workloads drawn from the training traffic
   only (the first 75% of each training trace, :mod:`policies.evaluation.protocol`), most of them
   near the knee (rate scales where the best static cap meets the SLA for 20-95%), plus
   generated traffic; every decision is stored with the student's observation.
2. **Student**: an SB3 ``MlpPolicy`` (so PPO can fine-tune it) fitted by maximum
   likelihood on the teacher's decisions (:func:`policies.training.distill.fit_policy`).
3. **DAgger**: the student drives, the teacher (bound to the same simulated deployment)
   labels the states the student reaches; refit on everything.
4. **Fine-tuning**: PPO on the env's reward, starting from the last DAgger student
   (:mod:`policies.training.finetune`: value head fitted first, small steps), on workloads drawn as
   in 1.
5. **Selection**: every student checkpoint (the fine-tuned one included) is scored on
   full-length validation windows of the training traffic (never the held-back window)
   under the evaluation's over-length policy; the best is exported as the policy artifact.

Every phase logs to TensorBoard under its own prefix (``teacher/``, ``student/``,
``dagger/``, ``finetune/``, ``select/``), each run at one global step, the simulated control
ticks so far (:mod:`policies.training.board`); behaviour cloning's loss is per epoch.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from policies.artifact import copy_artifact, load_artifact
from policies.evaluation.protocol import deployment_rate_scale
from policies.ppo import PpoController
from policies.training.board import log_run, log_runs
from policies.training.distill import (
    Demonstrations,
    LabellingController,
    check_labels,
    collect,
    fit_policy,
)
from policies.training.episodes import (
    Episode,
    drawer,
    draws_slas,
    sample_slas,
    sample_tagged_episodes,
)
from policies.training.excursions import ExcursionController, Excursions
from policies.training.finetune import FinetuneConfig, finetune_many, recipe_env_kwargs
from policies.training.focus import focus_weights, total_errors
from policies.training.ppo_trainer import eval_score, export_actor
from policies.training.selection import validation_statics
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import PPO_QUEUE_ORDER
from rlbatch.control.guard import GuardConfig
from rlbatch.control.guard_record import guard_record
from rlbatch.control.observation import OBS_VERSIONS, feature_names, observation_size
from rlbatch.control.specs import with_overrides
from rlbatch.control.types import SLA
from rlbatch.engine.config import parse_pools
from rlbatch.paths import default_training_traces
from rlbatch.profiles.specs import load_gpu, load_model
from rlbatch.scale.tasks import TaskError
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import Workload, load_trace


@dataclass
class RecipeConfig:
    """Everything the recipe depends on (recorded in the artifact).

    :param seed: seed of workload sampling, network init and shuffling.
    :param traces: training traces (their first 75% only).
    :param gpu: GPU profile.
    :param model: model profile.
    :param pools: pools.
    :param teacher: the teacher controller spec.
    :param episodes: teacher workloads (behaviour cloning).
    :param episode_s: seconds of arrivals per workload.
    :param knee_rates: trace rate scales near the knee (curriculum: most workloads).
    :param broad_rates: range of the other trace rate scales.
    :param knee_share: share of workloads drawn at a knee rate.
    :param generated_share: share of generated workloads (bursty / diurnal / Poisson).
    :param mix_share: share of trace slices whose prompt-length mix is redrawn
        (:func:`rlbatch.workload.remix.remix`: the slice's arrivals, lengths from the
        training window's own requests at bucket weights drawn uniformly from the simplex),
        so the student sees long-prompt-heavy states that its training traffic lacks.
    :param mix_load: range of a remixed slice's token rate, times its own (log-uniform):
        Mooncake at its knee carries about twice the 4k+ load of token-rate-matched mixes.
    :param family_share: share of workloads drawn from the traffic families instead
        (:func:`policies.training.episodes.family_episode`: chat, code completion, RAG,
        reports and drifts between them), so the student meets traffic where another total
        is right than on its training traces.
    :param family_loads: range of a family workload's load, in units of the family's knee
        (log-uniform).
    :param sla_ttft_s: range of the SLA's TTFT limit a workload is served under (log-uniform
        per workload; one value: every workload under it). With observation version 5 the
        SLA is an input of the student, so one policy serves any SLA within these ranges.
    :param sla_tpot_s: range of the SLA's TPOT limit, as ``sla_ttft_s``.
    :param excursions: chance, at each teacher decision outside an excursion, that the total
        in force leaves the teacher's for one drawn from the ladder while the teacher keeps
        labelling (:mod:`policies.training.excursions`), so that the student learns what to
        do where it drifts off the teacher's states; 0: the teacher drives throughout.
    :param excursion_decisions: shortest and longest excursion, in decisions.
    :param dagger_rounds: DAgger rounds after behaviour cloning.
    :param dagger_episodes: workloads per DAgger round.
    :param dagger_focus: draw each DAgger round's families at odds that grow with the
        student's distance from the teacher's total on each family so far
        (:mod:`policies.training.focus`); off: uniformly, as the teacher's episodes.
    :param hold_release: the student drives (DAgger, fine-tuning, selection) and is served
        behind the hold release (:mod:`rlbatch.control.hold_release`); off: without it, so
        that it learns from the teacher's labels not to hold requests past their TTFT
        instead of leaning on the rule (its artifact records ``hold_release: false``; the
        default, as the shipped policies were trained).
    :param tpot_fit: the teacher and the student act behind the guard's ``tpot_fit`` rule
        (the total held where the predicted TPOT, calibrated on the engines' iterations,
        meets the SLA's less an allowance for short outputs, :mod:`rlbatch.control.tpot_fit`),
        and the artifact records it, so the student is served behind it: it learns what to
        propose where the rule holds the TPOT edge (the default: the rule reads the traffic,
        the TPOT edge, that a student on its own did not learn; off, the students kept the
        total high on code completion, where 8-16 is right).
    :param decision_ticks: ticks between two student decisions (held in between).
    :param obs_version: student observation version.
    :param net_arch: hidden layers of the student.
    :param epochs: behaviour-cloning passes per fit.
    :param learning_rate: behaviour-cloning step size.
    :param finetune_steps: PPO fine-tuning decisions after DAgger (0: no fine-tuning).
    :param selection_rates: rate scales of the full-length validation windows (times
        ``rate_scale``); unused with ``selection_knee``.
    :param selection_knee: choose the first deployment's validation rate scales where its
        training windows are contested instead (the best selection static meets the SLA for
        20-95% of requests, the regime the must-checks judge:
        :func:`policies.training.selection.knee_selection_rates`); further deployments keep the
        middle of ``selection_rates``.
    :param selection_mixes: also select on each training window with equal prompt-length
        bucket shares (:func:`policies.training.selection.mixed_window`).
    :param obs_clip: record in each checkpoint the range of the observations it was fitted on
        (artifact ``obs_range``; serving clips into it) and clip fine-tuning's observations
        to the same range, so that a state past anything seen in training is treated as the
        nearest seen one instead of extrapolated.
    :param labels: ``choice``: each decision labelled with the teacher's choice; ``near``:
        with every candidate the teacher counted as tied with it, weighted equally (the
        student learns the action most often near-best, not the teacher's tie-break
        between rollouts its features cannot tell apart).
    :param shares: the student's share ladder (per-bucket shares of the total cap);
        ``(1.0,)``: the student chooses the total cap (and routes) only, so it cannot hold
        a bucket to a share of the batch. A teacher's trims are then projected away in its
        labels, so pair it with a teacher that does not trim (``mpc[trims=false]``).
    :param rate_scale: multiplies every trace rate scale and generated load (a
        deployment with more capacity than one A100 serving llama-2-7b needs more load to
        reach its knee; :data:`policies.evaluation.protocol.DEPLOYMENT_RATE_SCALES`).
    :param deployments: further ``gpu/model`` profiles to train over besides ``gpu`` and
        ``model`` (same pools): each workload is served on one of them, drawn uniformly, at
        its own measured rate multiplier relative to the first deployment's; selection adds
        their validation windows at the middle selection rate.
    :param members: train this many students, each by the whole recipe with its own seed
        (``members * seed + k``: its own workloads, DAgger rollouts and initialisation), and
        ship the mean of their logits (:func:`policies.training.members.train_students`); 1: one
        student.
    :param out: run folder.
    """

    seed: int = 0
    traces: tuple[str, ...] = field(
        default_factory=lambda: tuple(str(p) for p in default_training_traces()))
    gpu: str = "a100-80g"
    model: str = "llama-2-7b"
    pools: str = "fp16"
    teacher: str = "mpc"
    episodes: int = 24
    episode_s: float = 600.0
    knee_rates: tuple[float, float] = (0.7, 1.0)
    broad_rates: tuple[float, float] = (0.3, 1.2)
    knee_share: float = 0.7
    generated_share: float = 0.25
    mix_share: float = 0.0
    mix_load: tuple[float, float] = (1.0, 1.0)
    family_share: float = 0.5
    family_loads: tuple[float, float] = (0.7, 1.3)
    sla_ttft_s: tuple[float, float] = (0.5, 5.0)
    sla_tpot_s: tuple[float, float] = (0.025, 0.15)
    excursions: float = 0.0
    excursion_decisions: tuple[int, int] = (2, 12)
    dagger_rounds: int = 2
    dagger_episodes: int = 12
    dagger_focus: bool = True
    hold_release: bool = False
    tpot_fit: bool = True
    decision_ticks: int = 5
    obs_version: int = 7
    net_arch: tuple[int, ...] = (64, 64)
    epochs: int = 60
    learning_rate: float = 3e-3
    finetune_steps: int = 8192
    selection_rates: tuple[float, ...] = (0.6, 0.7, 0.8)
    selection_knee: bool = False
    selection_mixes: bool = False
    obs_clip: bool = False
    labels: str = "choice"
    shares: tuple[float, ...] = SHARE_LADDER
    rate_scale: float = 1.0
    deployments: tuple[str, ...] = ("h100-80g/llama-2-7b", "a100-80g/llama-3.1-8b")
    members: int = 1
    out: str = "runs/recipe"

    def __post_init__(self) -> None:
        parse_pools(self.pools)
        if (self.episodes < 1 or self.dagger_rounds < 0 or self.decision_ticks < 1
                or self.members < 1):
            raise ValueError(f"need episodes >= 1, dagger_rounds >= 0, decision_ticks >= 1, "
                             f"members >= 1; got {self.episodes}, {self.dagger_rounds}, "
                             f"{self.decision_ticks}, {self.members}")
        if self.obs_version not in OBS_VERSIONS:
            raise ValueError(f"obs_version must be one of {OBS_VERSIONS}, got "
                             f"{self.obs_version}")
        if self.finetune_steps < 0:
            raise ValueError(f"finetune_steps must be >= 0, got {self.finetune_steps}")
        if not self.rate_scale > 0:
            raise ValueError(f"rate_scale must be > 0, got {self.rate_scale}")
        check_labels(self.labels)
        self.excursion_decisions = (int(self.excursion_decisions[0]),
                                    int(self.excursion_decisions[1]))
        self.excursion_plan()  # bad excursion settings fail here
        self.shares = tuple(float(s) for s in self.shares)
        if not 0 < self.mix_load[0] <= self.mix_load[1]:
            raise ValueError(f"mix_load must be 0 < low <= high, got {self.mix_load}")
        for name in ("sla_ttft_s", "sla_tpot_s"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name} must be 0 < low <= high, got {(low, high)}")
        if not 0 < self.family_loads[0] <= self.family_loads[1]:
            raise ValueError(f"family_loads must be 0 < low <= high, got {self.family_loads}")
        for name in ("knee_share", "generated_share", "mix_share", "family_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        self.deployments = tuple(self.deployments)
        trained = self.train_deployments()
        if len(set(trained)) != len(trained):
            raise ValueError(f"deployments repeat: {', '.join(self.deployments)}")
        for gpu, model in trained:  # unknown profiles fail here, before any work
            load_gpu(gpu)
            load_model(model)
        self.student_codec()  # and a bad share ladder

    @classmethod
    def from_record(cls, recorded: dict[str, Any], *, ignore_unknown: bool = False
                    ) -> RecipeConfig:
        """The configuration a run recorded (``recipe.json``'s ``config``; JSON lists back to
        tuples).

        :param ignore_unknown: drop options this version does not know instead of refusing.
        :raises ValueError: an unknown option (unless ignored) or an invalid value.
        """
        known = {f.name for f in fields(cls)}
        if (unknown := set(recorded) - known) and not ignore_unknown:
            raise ValueError(f"recorded options this recipe does not know: "
                             f"{', '.join(sorted(unknown))}")
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in recorded.items() if k in known}
        return cls(**values)

    def teacher_spec(self) -> str:
        """The teacher's controller spec, behind the ``tpot_fit`` rule when the recipe is.

        :raises ValueError: ``tpot_fit`` with a teacher from a settings file.
        """
        if not self.tpot_fit:
            return self.teacher
        if self.teacher.endswith(".toml"):
            raise ValueError("tpot_fit: set guard.tpot_fit = true in the teacher's settings "
                             f"file {self.teacher!r}")
        return with_overrides(self.teacher, ["guard.tpot_fit=true"])

    def student_guard(self, codec: TotalShareCodec) -> GuardConfig:
        """The guard the student acts behind (and its artifact records): the default rules
        on its total ladder, with the ``tpot_fit`` rule when the recipe has it."""
        return GuardConfig(ladder=tuple(codec.totals), tpot_fit=self.tpot_fit)

    def excursion_plan(self) -> Excursions | None:
        """The teacher episodes' excursions (``None`` without them)."""
        plan = Excursions(self.excursions, self.excursion_decisions)
        return plan if plan.share > 0 else None

    def train_deployments(self) -> list[tuple[str, str]]:
        """``(gpu, model)`` of every deployment trained on; the first is ``gpu``/``model``
        (left out of ``deployments`` if listed there too)."""
        first = (self.gpu, self.model)
        return [first, *(d for d in map(parse_deployment, self.deployments) if d != first)]

    def spec(self, deployment: int = 0) -> DeploymentSpec:
        """The simulated deployment ``deployment`` (an index into
        :meth:`train_deployments`)."""
        gpu, model = self.train_deployments()[deployment]
        return DeploymentSpec(gpu=gpu, model=model, pools=parse_pools(self.pools),
                              admission=AdmissionConfig(over_length="truncate"))

    def student_codec(self) -> TotalShareCodec:
        """The student's action space: the total ladder, :attr:`shares` and the pools."""
        spec = self.spec()
        return TotalShareCodec(TOTAL_LADDER, self.shares, tuple(spec.pools), len(spec.buckets))

    def multiplier(self, deployment: int = 0) -> float:
        """Rate multiplier of a deployment: ``rate_scale`` times its capacity relative to
        the first deployment's (the measured multipliers of one FP16 engine of each, so that
        pools measured on one GPU/model carry over)."""
        if deployment == 0:
            return self.rate_scale
        one = {"fp16": 1}
        deployments = self.train_deployments()
        return (self.rate_scale * deployment_rate_scale(*deployments[deployment], one)
                / deployment_rate_scale(*deployments[0], one))


def parse_deployment(text: str) -> tuple[str, str]:
    """``"gpu/model"`` -> ``(gpu, model)``.

    :raises ValueError: not of that form.
    """
    gpu, sep, model = text.partition("/")
    if not sep or not gpu or not model or "/" in model:
        raise ValueError(f"a deployment is 'gpu/model' (e.g. h100-80g/llama-2-7b), got {text!r}")
    return gpu, model


def make_labeller(cfg: RecipeConfig, codec: TotalShareCodec,
                  actor: Any = None, excursion_seed: int | None = None) -> LabellingController:
    """The teacher of ``cfg`` wrapped to record the student's observations and its labels.

    :param cfg: the recipe.
    :param codec: the student's action space.
    :param actor: the student driving (DAgger), ``None``: the teacher drives.
    :param excursion_seed: with ``cfg.excursions`` and no actor, the teacher drives with
        excursions drawn from this seed (:class:`~policies.training.excursions.
        ExcursionController`).
    """
    teacher = make_controller(cfg.teacher_spec())
    if not teacher.reports_proposals:
        raise ValueError(f"teacher {cfg.teacher!r} does not expose last_proposal")
    plan = cfg.excursion_plan()
    if actor is None and plan is not None and excursion_seed is not None:
        actor = ExcursionController(teacher, codec, plan, cfg.decision_ticks, excursion_seed)
    return LabellingController(teacher, codec, cfg.obs_version,
                               max(codec.totals), cfg.decision_ticks, actor, cfg.labels)


def _episode_task(item: tuple[int, RecipeConfig, str | None, int, SLA | None, int | None],
                  workload: Workload) -> tuple[Demonstrations, list[dict[str, Any]]]:
    # One teacher / DAgger episode on a Ray worker: a fresh labeller (the teacher resets
    # fully every run, so this equals the one labeller the serial loop reuses).
    _, cfg, student, deployment, sla, excursion_seed = item
    # the student acts as it is served (its queue order); the teacher labels the caps
    actor = None if student is None else PpoController(load_artifact(Path(student)),
                                                       name="student", order=PPO_QUEUE_ORDER)
    spec = cfg.spec(deployment)
    return collect(make_labeller(cfg, cfg.student_codec(), actor, excursion_seed), [workload],
                   spec if sla is None else replace(spec, sla=sla))


def build_student(cfg: RecipeConfig, codec: TotalShareCodec, obs_size: int) -> Any:
    """A fresh SB3 actor-critic network for the student's spaces."""
    import torch
    from gymnasium import spaces
    from stable_baselines3.common.policies import ActorCriticPolicy

    torch.manual_seed(cfg.seed)
    return ActorCriticPolicy(
        spaces.Box(0.0, 10.0, shape=(obs_size,), dtype=np.float32),
        spaces.MultiDiscrete(np.array(codec.nvec, dtype=np.int64)),
        lambda _: 3e-4, net_arch=list(cfg.net_arch))


def export_student(policy: Any, cfg: RecipeConfig, codec: TotalShareCodec, path: Path,
                   extra: dict[str, Any] | None = None) -> Path:
    """Write the student's actor as a policy artifact (``total_share`` actions)."""
    spec = cfg.spec()
    return export_actor(policy, spec, asdict(cfg), path, {
        "nvec": codec.nvec,
        "obs_size": observation_size(len(spec.buckets), cfg.obs_version),
        "obs_version": cfg.obs_version,
        "feature_names": feature_names(spec.buckets.names, cfg.obs_version),
        "action_kind": codec.kind,
        "totals": list(codec.totals),
        "shares": list(codec.shares),
        "decision_ticks": cfg.decision_ticks,
        "ladder": list(codec.totals),
        "pools": list(codec.pools),
        "recipe": "mpc teacher -> behaviour cloning -> DAgger -> PPO fine-tuning -> selection",
        # the student acts behind the guard ppo:PATH builds from its ladder (artifact_guard)
        "guard": guard_record(cfg.student_guard(codec)),
        # served behind the hold release it drove behind in training (artifact_release)
        "hold_release": cfg.hold_release,
        # a student that reads the SLA serves the SLAs it was trained under (check_trained_sla)
        **({"sla_ttft_s": list(cfg.sla_ttft_s), "sla_tpot_s": list(cfg.sla_tpot_s)}
           if cfg.obs_version >= 5 else {}),
        **(extra or {}),
    })


class Recipe:
    """Runs the recipe's phases; state kept between them for logging and tests.

    :param cfg: the configuration.
    :param log: ``callable(tag, value, step)`` (TensorBoard scalars), optional.
    :param ray: run the teacher / DAgger episodes as Ray tasks (``None``: in this process;
        :data:`rlbatch.scale.LOCAL` or a cluster address); the data are the same.
    :param quiet: no progress bars.
    """

    def __init__(self, cfg: RecipeConfig,
                 log: Callable[[str, float, int], None] | None = None,
                 ray: str | None = None, quiet: bool = False) -> None:
        self.cfg = cfg
        self.ray = ray
        self.quiet = quiet
        self.log = log or (lambda tag, value, step: None)
        spec = cfg.spec()
        self.spec = spec
        self.specs = [cfg.spec(d) for d in range(len(cfg.train_deployments()))]
        self.codec = cfg.student_codec()
        self.labeller()  # a teacher that cannot label as asked fails here, before any work
        self.obs_size = observation_size(len(spec.buckets), cfg.obs_version)
        self.rng = np.random.default_rng(cfg.seed)
        self.traces = [load_trace(t) for t in cfg.traces]
        self.demos: list[Demonstrations] = []
        """Every episode's demonstrations so far, in order."""
        self.kinds: list[str] = []
        """The kind of each of :attr:`demos` (a family's name, ``generated`` or ``trace``)."""
        self.family_weights: dict[str, float] | None = None
        """Odds of each family in the next DAgger round (``dagger_focus``; set by
        :meth:`fit`)."""
        self.history: list[dict[str, Any]] = []
        self.knee: dict[str, Sequence[float]] | None = None
        """The validation rate scales the knee scan chose per trace (``selection_knee``)."""
        self.step = 0
        """The global step of TensorBoard: simulated control ticks of every phase so far."""

    def labeller(self, actor: Any = None) -> LabellingController:
        return make_labeller(self.cfg, self.codec, actor)

    def collect(self, episodes: Sequence[Episode], student: Path | None = None,
                slas: Sequence[SLA] | None = None,
                excursion_seeds: Sequence[int] | None = None
                ) -> tuple[Demonstrations, list[dict[str, Any]]]:
        """Run the teacher (or the student at ``student``, the teacher labelling) over the
        episodes, each on its deployment: here, or one Ray task per episode (workloads
        through the object store).

        :param excursion_seeds: one per episode: the teacher drives with excursions
            (``cfg.excursions``; ignored when the student drives).
        :raises RuntimeError: an episode failed twice on Ray (training needs every one).
        """
        parts, rows = self.collect_parts(episodes, student, slas, excursion_seeds)
        return Demonstrations.concat(parts), rows

    def collect_parts(self, episodes: Sequence[Episode], student: Path | None = None,
                      slas: Sequence[SLA] | None = None,
                      excursion_seeds: Sequence[int] | None = None
                      ) -> tuple[list[Demonstrations], list[dict[str, Any]]]:
        """:meth:`collect`, the demonstrations kept per episode (in order)."""
        seeds = [None if excursion_seeds is None else excursion_seeds[i]
                 for i in range(len(episodes))]
        if self.ray is None:
            actor = (None if student is None  # as served, as in _episode_task
                     else PpoController(load_artifact(student), name="student",
                                        order=PPO_QUEUE_ORDER))
            bar = tqdm(episodes, desc="teacher" if student is None else "dagger",
                       unit="episode", disable=self.quiet, leave=False)
            # a labeller per episode: each has its own excursion seed (controllers reset
            # fully every run, so the one actor serves them all)
            done = [collect(make_labeller(self.cfg, self.codec, actor, seeds[i]), [w],
                            self._spec(d, slas, i))
                    for i, (d, w) in enumerate(bar)]
            return [demos for demos, _ in done], [row for _, rows in done for row in rows]
        from rlbatch.scale import connect, failed, run_tasks

        connect(self.ray)
        items = [(i, self.cfg, None if student is None else str(student), d,
                  None if slas is None else slas[i], seeds[i])
                 for i, (d, _) in enumerate(episodes)]
        workloads = {i: w for i, (_, w) in enumerate(episodes)}
        results = run_tasks(_episode_task, items, shared=workloads,
                            shared_key=lambda item: item[0],
                            describe=lambda item: f"episode {item[0]} of seed {self.cfg.seed}",
                            desc="teacher" if student is None else "dagger", quiet=self.quiet)
        if failed(results):
            raise RuntimeError("; ".join(f"{e.inputs}: {e.error}" for e in failed(results)))
        ok = [r for r in results if not isinstance(r, TaskError)]
        return [d for d, _ in ok], [row for _, rows in ok for row in rows]

    def _spec(self, deployment: int, slas: Sequence[SLA] | None, i: int) -> DeploymentSpec:
        spec = self.specs[deployment]
        return spec if slas is None else replace(spec, sla=slas[i])

    def episodes(self, n: int, family_weights: dict[str, float] | None = None
                 ) -> tuple[list[tuple[str, Episode]], list[SLA] | None]:
        """``n`` workloads with their kinds and, when the recipe draws SLAs, the SLA of
        each."""
        episodes = sample_tagged_episodes(self.cfg, self.rng, n, self.traces, family_weights)
        slas = sample_slas(self.cfg, self.rng, n) if draws_slas(self.cfg) else None
        return episodes, slas

    def _gather(self, tagged: Sequence[tuple[str, Episode]], slas: Sequence[SLA] | None,
                student: Path | None = None,
                excursion_seeds: Sequence[int] | None = None) -> list[dict[str, Any]]:
        parts, rows = self.collect_parts([e for _, e in tagged], student, slas,
                                         excursion_seeds)
        self.demos.extend(parts)
        self.kinds.extend(kind for kind, _ in tagged)
        return rows

    def teacher_data(self) -> list[dict[str, Any]]:
        """Phase 1: the teacher drives; returns its run rows."""
        tagged, slas = self.episodes(self.cfg.episodes)
        # drawn only when asked, so that recipes without excursions keep their draws
        seeds = ([int(s) for s in self.rng.integers(2**31, size=len(tagged))]
                 if self.cfg.excursion_plan() is not None else None)
        rows = self._gather(tagged, slas, excursion_seeds=seeds)
        for row in rows:
            self.step = log_runs(self.log, "teacher", [row], self.step)
            # the total the teacher kept, per kind of traffic (workload name without its seed)
            self.log(f"teacher/total_median/{str(row['trace']).split('[')[0]}",
                     float(row["max_num_seqs_median"]), self.step)
        self.log("teacher/decisions", float(sum(d.decisions for d in self.demos)), self.step)
        return rows

    def fit(self, policy: Any, phase: str, step: int) -> float:
        data = Demonstrations.concat(self.demos)
        accuracy = [math.nan]

        def on_epoch(epoch: int, loss: float, acc: float) -> None:
            self.log(f"{phase}/bc_loss", loss, step * self.cfg.epochs + epoch)
            accuracy[0] = acc

        fit_policy(policy, data, epochs=self.cfg.epochs, learning_rate=self.cfg.learning_rate,
                   seed=self.cfg.seed + step, log=on_epoch)
        self.log(f"{phase}/action_accuracy", accuracy[0], self.step)
        errors = total_errors(policy, self.demos, self.kinds)
        for kind, error in errors.items():
            self.log(f"{phase}/total_error/{kind}", error, self.step)
        if self.cfg.dagger_focus:
            self.family_weights = focus_weights(errors)
        return accuracy[0]

    def fitted_range(self) -> dict[str, Any]:
        """``obs_range`` of everything fitted on so far (``obs_clip``), as artifact metadata."""
        if not self.cfg.obs_clip:
            return {}
        return {"obs_range": Demonstrations.concat(self.demos).observation_range()}

    def dagger_round(self, artifact: Path, round_: int) -> list[dict[str, Any]]:
        """Phase 3: the student (behind its guard) drives, the teacher labels; families
        drawn at :attr:`family_weights` (``dagger_focus``)."""
        tagged, slas = self.episodes(self.cfg.dagger_episodes, self.family_weights)
        rows = self._gather(tagged, slas, artifact)
        self.step = log_runs(self.log, "dagger", rows, self.step)
        self.log("dagger/round", float(round_ + 1), self.step)
        return rows

    def finetune(self, policy: Any) -> Any:
        """Phase 4: PPO fine-tuning of ``policy`` (in place) on the recipe's workloads."""
        cfg = self.cfg
        # one env per deployment, each fed that deployment's workloads (with one deployment
        # the draws are sample_workloads(cfg, ...)'s: nothing draws a deployment)
        sources = []
        for d, (gpu, model) in enumerate(cfg.train_deployments()):
            one = replace(cfg, gpu=gpu, model=model, deployments=(),
                          rate_scale=cfg.multiplier(d))
            sources.append((recipe_env_kwargs(gpu, model, cfg.pools, cfg.episode_s,
                                              cfg.obs_version, cfg.decision_ticks,
                                              cfg.shares, cfg.hold_release,
                                              cfg.student_guard(self.codec)),
                            drawer(one, self.rng, self.traces)))
        bounds = self.fitted_range().get("obs_range")
        start = self.step

        def at(decisions: int) -> int:  # fine-tuning counts decisions, the board ticks
            self.step = max(self.step, start + decisions * cfg.decision_ticks)
            return start + decisions * cfg.decision_ticks

        return finetune_many(policy, sources, FinetuneConfig(steps=cfg.finetune_steps),
                             cfg.seed, lambda tag, value, n: self.log(tag, value, at(n)),
                             None if bounds is None else (bounds["low"], bounds["high"]),
                             on_episode=lambda row, n: log_run(self.log, "finetune", row,
                                                               at(n)),
                             progress=not self.quiet)

    def select(self, candidates: Sequence[Path]) -> tuple[Path, list[float]]:
        """Phase 4: score every checkpoint on full-length validation windows against the
        best static of each window; the best wins (ties: the later one)."""
        validation, statics, self.knee = validation_statics(self.cfg, self.specs, self.log)
        scores = []
        bar = tqdm(total=len(candidates) * len(validation), desc="selection", unit="run",
                   disable=self.quiet, leave=False)
        for path in candidates:
            per = []
            for name, d, w in validation:
                row = run(w, make_controller(f"ppo:{path}"), self.specs[d]).row
                per.append(eval_score(row, statics[name]))
                self.step = log_runs(self.log, "select", [row], self.step)
                if name.startswith("family "):  # does the checkpoint read the traffic?
                    self.log(f"select/total_median/{name.removeprefix('family ')}",
                             float(row["max_num_seqs_median"]), self.step)
                bar.update()
            scores.append(float(np.mean(per)))
            self.log("select/score", scores[-1], self.step)
        bar.close()
        best = max(range(len(candidates)), key=lambda i: (scores[i], i))
        self.log("select/best_score", scores[best], self.step)
        return candidates[best], scores


def run_recipe(cfg: RecipeConfig, log: Callable[[str, float, int], None] | None = None,
               progress: Callable[[str], None] | None = None,
               ray: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """All phases; writes ``out/student-*``, ``out/best`` and ``out/recipe.json``.

    :param cfg: the configuration.
    :param log: TensorBoard scalars ``callable(tag, value, step)``.
    :param progress: phase messages.
    :param ray: run the teacher and DAgger episodes as Ray tasks (same data).
    :param quiet: no progress bars.
    """
    if cfg.members > 1:
        raise ValueError(f"run_recipe trains one student; members={cfg.members} is "
                         f"policies.training.members.train_students")
    say = progress or (lambda text: None)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = Recipe(cfg, log, ray, quiet)
    start = time.perf_counter()
    say(f"teacher data: {cfg.teacher} on {cfg.episodes} workloads")
    teacher_rows = recipe.teacher_data()
    policy = build_student(cfg, recipe.codec, recipe.obs_size)
    checkpoints: list[Path] = []
    for round_ in range(cfg.dagger_rounds + 1):
        phase = "student" if round_ == 0 else "dagger"
        say(f"{phase}: fitting on {sum(d.decisions for d in recipe.demos)} decisions")
        accuracy = recipe.fit(policy, phase, round_)
        path = out / f"student-{round_}"
        export_student(policy, cfg, recipe.codec, path,
                       {"phase": phase, "round": round_, "action_accuracy": accuracy,
                        **recipe.fitted_range()})
        checkpoints.append(path)
        if round_ < cfg.dagger_rounds:
            say(f"dagger round {round_ + 1}: student drives, teacher labels")
            recipe.dagger_round(path / "policy.json", round_)
    if cfg.finetune_steps > 0:
        say(f"fine-tuning: PPO for {cfg.finetune_steps} decisions from the last student")
        recipe.finetune(policy)
        path = out / "student-finetuned"
        export_student(policy, cfg, recipe.codec, path,
                       {"phase": "finetune", **recipe.fitted_range()})
        checkpoints.append(path)
    say(f"selection on full-length validation windows: {len(checkpoints)} checkpoints")
    best, scores = recipe.select(checkpoints)
    wall = time.perf_counter() - start
    final = copy_artifact(best, out / "best", {"selection_scores": scores,
                                                     "train_wall_s": wall})
    summary = {"best": str(final), "checkpoints": [str(c) for c in checkpoints],
               "selection_scores": scores, "wall_s": wall,
               "selection_knee_rates": recipe.knee,
               "teacher_goodput_rps": [r["goodput_rps"] for r in teacher_rows],
               "decisions": sum(d.decisions for d in recipe.demos), "config": asdict(cfg)}
    (out / "recipe.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary
