"""``ppo:PATH``: a trained policy artifact behind the guard.

Serving loads the safetensors artifact (no pickle, no SB3, no torch) and runs the same
observation code and guard as the environment it was trained in. The artifact says which
action space (``per_bucket`` or ``total_share``), observation version and decision interval
the policy was trained with; artifacts without those fields are the first policies'
(per-bucket caps, observation version 1, a decision every tick).

The policy's proposals go through the one decision pipeline
(:class:`~rlbatch.control.pipeline.DecisionPipeline`), as in the env it was trained in: what
it holds back is released once a queue head has waited half the SLA's TTFT (the trimmed
bucket's trim, and the total whatever TPOT is: :mod:`rlbatch.control.hold_release`;
``ppo:PATH[release.wait_fraction=F]`` for another fraction, ``ppo:PATH[release=none]`` for
none, ``ppo:PATH[release.tpot_tolerance=1]`` to hold the total while TPOT P99 is over its
SLA), then the guard makes it safe.

Admission's queues are in deadline order: a request that can no longer meet its TTFT goes
after those that still can, and the engines are given no more requests than they run at once,
so the waiting happens where that order applies (:mod:`rlbatch.control.discipline`;
``ppo:PATH[order=fifo]`` for FIFO). The settings are :class:`PpoSettings`.

``PATH`` may also name a policy shipped with the package (``ppo:default``, ``ppo:two-pool``,
``ppo:seeds/seed1``; :func:`resolve_policy`), so an installed rlbatch serves them from any
folder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from policies.artifact import ArtifactError, PolicyArtifact, load_artifact
from policies.rules import GuardedController
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, Codec, make_codec
from rlbatch.control.discipline import PPO_QUEUE_ORDER, QueueOrder
from rlbatch.control.guard import GuardConfig
from rlbatch.control.guard_record import guard_from_record, record_mismatch
from rlbatch.control.hold_release import DEFAULT_RELEASE, HoldRelease
from rlbatch.control.observation import ObservationBuilder
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.settings import apply

log = logging.getLogger(__name__)

SHIPPED_POLICIES = Path(__file__).resolve().parent
"""Where the shipped policies lie: beside this module, in a checkout and once installed."""


def resolve_policy(ref: str) -> Path:
    """The artifact ``ppo:ref`` names: ``ref`` as a path when it exists (a path the user
    gives wins over a shipped name), else the shipped policy of that name (``default``,
    ``two-pool``, ``seeds/seed1``; ``policies/default`` too, the spelling of a checkout, so
    the README's commands run from any folder once installed). Otherwise ``ref`` unchanged,
    for :func:`~policies.artifact.load_artifact` to say what is missing.

    :param ref: what follows ``ppo:``.
    """
    path = Path(ref)
    if path.exists():
        return path
    shipped = (SHIPPED_POLICIES / ref.removeprefix("policies/")).resolve()
    if shipped.is_relative_to(SHIPPED_POLICIES) and (shipped / "policy.json").is_file():
        return shipped
    return path


def artifact_release(artifact: PolicyArtifact) -> HoldRelease | None:
    """The hold release a policy is served with: none for a student trained without it (its
    artifact records ``hold_release: false``: it learned not to hold requests too long),
    else the default one."""
    return None if artifact.metadata.get("hold_release") is False else DEFAULT_RELEASE


def artifact_guard(artifact: PolicyArtifact) -> GuardConfig:
    """The guard a policy is served behind: the one its artifact records (the one it was
    trained behind, or re-measured behind: :mod:`rlbatch.control.guard_record`), else
    (artifacts written before the record) the default rules on its cap ladder."""
    record = artifact.metadata.get("guard")
    if isinstance(record, dict):
        try:
            return guard_from_record(record)
        except (TypeError, ValueError) as exc:
            raise ArtifactError(f"policy's recorded guard: {exc}") from exc
    ladder = tuple(int(c) for c in artifact.metadata["ladder"])
    return GuardConfig(ladder=ladder)


def guard_warnings(artifact: PolicyArtifact, config: GuardConfig) -> list[str]:
    """Why ``artifact``'s figures may not hold behind ``config``: empty when the guard in
    force is the one it records (:mod:`rlbatch.control.guard_record`)."""
    record = artifact.metadata.get("guard")
    if not isinstance(record, dict):
        return ["the artifact does not record the guard it was trained behind (written "
                "before guard records): its figures hold only behind that guard"]
    return record_mismatch(record, config)


def check_trained_sla(meta: Mapping[str, Any], sla: SLA) -> None:
    """Refuse an SLA outside the ranges the policy was trained under.

    A policy that reads the SLA (observation version 5) records the ranges it was trained
    over (``sla_ttft_s``, ``sla_tpot_s``: ``[low, high]``); one trained under one SLA records
    that SLA as both ends. Artifacts from before the record serve any SLA, as they did.

    :raises ArtifactError: the SLA is outside a recorded range.
    """
    for name, value in (("sla_ttft_s", sla.ttft_s), ("sla_tpot_s", sla.tpot_s)):
        if name not in meta:
            continue
        low, high = (float(x) for x in meta[name])
        if not low * (1 - 1e-9) <= value <= high * (1 + 1e-9):
            raise ArtifactError(
                f"the SLA's {name.removeprefix('sla_').replace('_s', '').upper()} limit "
                f"{value:g} s is outside the range this policy was trained under "
                f"({low:g}-{high:g} s); serve it within that range or train one for this SLA "
                f"(train.py --train-sla-ttft-s / --train-sla-tpot-s)")


class PpoController(GuardedController):
    """A trained policy, deterministic, behind the guard its artifact records.

    :param artifact: the loaded artifact.
    :param name: controller name (``ppo:PATH``).
    :param guard: guard configuration (default: the one the artifact records, see
        :func:`artifact_guard`); differences from the recorded one are logged as warnings
        and kept in :attr:`guard_warnings`.
    :param release: when what the policy holds back is released
        (:class:`~rlbatch.control.hold_release.HoldRelease`); ``None``: the policy's trims
        and total stand however long requests wait; ``artifact``: as the policy was trained
        (:func:`artifact_release`).
    :param order: the order of admission's queues (:mod:`rlbatch.control.discipline`;
        default :data:`~rlbatch.control.discipline.PPO_QUEUE_ORDER`).
    """

    def __init__(self, artifact: PolicyArtifact, name: str = "ppo",
                 guard: GuardConfig | None = None,
                 release: HoldRelease | Literal["artifact"] | None = "artifact",
                 order: QueueOrder = PPO_QUEUE_ORDER) -> None:
        super().__init__(name, guard or artifact_guard(artifact), order,
                         artifact_release(artifact) if release == "artifact" else release)
        self.artifact = artifact
        self.guard_warnings = guard_warnings(artifact, self.guard.config)
        for line in self.guard_warnings:
            log.warning("%s: %s", name, line)
        meta = artifact.metadata
        self.action_kind = str(meta.get("action_kind", "per_bucket"))
        self.obs_version = int(meta.get("obs_version", 1))
        self.decision_ticks = max(1, int(meta.get("decision_ticks", 1)))
        self._builder: ObservationBuilder | None = None
        self._codec: Codec | None = None
        self._held: ControlAction | None = None
        self._ticks = 0

    def on_reset(self, info: DeploymentInfo) -> None:
        meta = self.artifact.metadata
        if list(info.buckets.edges) != [int(e) for e in meta["bucket_edges"]]:
            raise ArtifactError(f"policy was trained on bucket edges {meta['bucket_edges']}, "
                                f"the deployment uses {list(info.buckets.edges)}")
        check_trained_sla(meta, info.sla)
        if list(info.pool_names) != list(meta["pools"]):
            raise ArtifactError(f"policy was trained on pools {meta['pools']}, the deployment "
                                f"has {list(info.pool_names)}")
        self._builder = ObservationBuilder(info, self.guard.config.max_cap,
                                           self.guard.config.warmup_s, self.obs_version)
        if self._builder.size != self.artifact.obs_size:
            raise ArtifactError(f"policy expects {self.artifact.obs_size} observation "
                                f"features, the deployment gives {self._builder.size}")
        self._codec = make_codec(
            self.action_kind, ladder=self.guard.config.ladder, pools=info.pool_names,
            num_buckets=len(info.buckets),
            totals=tuple(int(t) for t in meta.get("totals", TOTAL_LADDER)),
            shares=tuple(float(s) for s in meta.get("shares", SHARE_LADDER)))
        if self._codec.nvec != self.artifact.nvec:
            raise ArtifactError(f"policy's action head {self.artifact.nvec} does not match "
                                f"its {self.action_kind} action space {self._codec.nvec}")
        self._held = None
        self._ticks = 0

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        if self._builder is None or self._codec is None:
            raise RuntimeError("propose() before reset()")
        if stats is None:
            self._held = self._codec.decode(self.artifact.act(self._builder.initial()))
            return self._held
        # The observation is built every tick (its smoothed rates need every tick); the
        # policy acts every decision_ticks ticks and its proposal holds in between.
        obs = self._builder.build(stats, self.guard.flags())
        self._ticks += 1
        if self._held is None or (self._ticks - 1) % self.decision_ticks == 0:
            self._held = self._codec.decode(self.artifact.act(obs))
        return self._held


@dataclass(frozen=True)
class PpoSettings:
    """Settings of ``ppo:PATH`` (:class:`PpoController`).

    :param order: the order of admission's queues (``deadline``, the order the shipped
        policies are fine-tuned and served in, or ``fifo``).
    :param release: when what the policy holds back is released
        (:class:`~rlbatch.control.hold_release.HoldRelease`: ``release.wait_fraction``,
        ``release.tpot_tolerance``); ``none``: never. Default: the one the policy was
        trained with (:func:`artifact_release`).
    :param guard: the guard to serve behind (default: the one the artifact records; ``guard.*``
        settings change that one, and any difference from it is logged as a warning).
    """

    order: QueueOrder = PPO_QUEUE_ORDER
    release: HoldRelease | None = DEFAULT_RELEASE
    guard: GuardConfig | None = None


def ppo_factory(arg: str, settings: Mapping[str, Any]) -> PpoController:
    """``ppo:PATH``: a folder with policy.json + policy.safetensors, or the JSON file, or a
    shipped policy's name (:func:`resolve_policy`); settings:
    :class:`PpoSettings`, e.g. ``ppo:policies/default[order=fifo,release=none]``,
    ``ppo:policies/default[release.wait_fraction=0.25]``.

    :raises ValueError: no path, or a bad setting.
    :raises ArtifactError: the artifact cannot be loaded.
    """
    if not arg:
        raise ValueError("ppo needs an artifact path, e.g. ppo:policies/default")
    artifact = load_artifact(resolve_policy(arg))
    # guard.* settings change the guard the artifact records, not the default one
    cfg = apply(PpoSettings(guard=artifact_guard(artifact), release=artifact_release(artifact)),
                settings)
    return PpoController(artifact, name=f"ppo:{arg}", guard=cfg.guard, release=cfg.release,
                         order=cfg.order)
