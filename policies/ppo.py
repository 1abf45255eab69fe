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
``ppo:PATH:release=F`` for another fraction, ``ppo:PATH:release=off`` for none,
``ppo:PATH:release_tpot=1`` to hold the total while TPOT P99 is over its SLA), then the guard
makes it safe.

Admission's queues are in deadline order: a request that can no longer meet its TTFT goes
after those that still can, and the engines are given no more requests than they run at once,
so the waiting happens where that order applies (:mod:`rlbatch.control.discipline`;
``ppo:PATH:order=fifo`` for FIFO).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from policies.artifact import ArtifactError, PolicyArtifact, load_artifact
from policies.rules import GuardedController
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, Codec, make_codec
from rlbatch.control.discipline import PPO_QUEUE_ORDER, QueueOrder, check_queue_order
from rlbatch.control.guard import GuardConfig
from rlbatch.control.guard_record import guard_from_record, record_mismatch
from rlbatch.control.hold_release import (
    HOLD_RELEASE_FRACTION,
    RELEASE_TPOT_TOLERANCE,
    HoldRelease,
)
from rlbatch.control.observation import ObservationBuilder
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats

log = logging.getLogger(__name__)



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


class PpoController(GuardedController):
    """A trained policy, deterministic, behind the guard its artifact records.

    :param artifact: the loaded artifact.
    :param name: controller name (``ppo:PATH``).
    :param guard: guard configuration (default: the one the artifact records, see
        :func:`artifact_guard`); differences from the recorded one are logged as warnings
        and kept in :attr:`guard_warnings`.
    :param release: when what the policy holds back is released
        (:class:`~rlbatch.control.hold_release.HoldRelease`); ``None``: the policy's trims
        and total stand however long requests wait.
    :param order: the order of admission's queues (:mod:`rlbatch.control.discipline`;
        default :data:`~rlbatch.control.discipline.PPO_QUEUE_ORDER`).
    """

    def __init__(self, artifact: PolicyArtifact, name: str = "ppo",
                 guard: GuardConfig | None = None,
                 release: HoldRelease | None = HoldRelease(),  # noqa: B008 (frozen)
                 order: QueueOrder = PPO_QUEUE_ORDER) -> None:
        super().__init__(name, guard or artifact_guard(artifact), order, release)
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


_OPTION = re.compile(r"[a-z_]+=")
"""What a ``ppo:PATH:KEY=VALUE`` option looks like (a path's last part rarely does)."""


def _option_error(key: str, value: str, arg: str) -> ValueError:
    hint = {"release": "a fraction of the SLA's TTFT > 0 or 'off', e.g. release=0.5",
            "release_tpot": "a multiple of the SLA's TPOT >= 1 or 'inf', e.g. release_tpot=1.5",
            "order": "fifo or deadline, e.g. order=fifo"}[key]
    return ValueError(f"ppo option {key} takes {hint}; got {key}={value} in ppo:{arg}")


def _release_option(value: str, arg: str) -> float | None:
    """``release=F`` (a finite fraction > 0) or ``release=off`` (``None``)."""
    if value == "off":
        return None
    try:
        release = float(value)
    except ValueError:
        raise _option_error("release", value, arg) from None
    if not (math.isfinite(release) and release > 0):
        raise _option_error("release", value, arg)
    return release


def _tolerance_option(value: str, arg: str) -> float:
    """``release_tpot=X`` (>= 1, ``inf`` allowed)."""
    try:
        tolerance = float(value)
    except ValueError:
        raise _option_error("release_tpot", value, arg) from None
    if not tolerance >= 1.0:
        raise _option_error("release_tpot", value, arg)
    return tolerance


def ppo_factory(arg: str) -> PpoController:
    """``ppo:PATH`` (a folder with policy.json + policy.safetensors, or the JSON file),
    optionally followed, in any order, by ``:release=F`` / ``:release=off`` (the hold release's
    fraction of the SLA's TTFT, default
    :data:`~rlbatch.control.hold_release.HOLD_RELEASE_FRACTION`; ``off``: none) and
    ``:release_tpot=X`` (the total is released unless TPOT P99 is over X times the SLA's TPOT,
    default :data:`~rlbatch.control.hold_release.RELEASE_TPOT_TOLERANCE`; ``inf``: whatever
    TPOT is) and ``:order=fifo`` / ``:order=deadline`` (the order of admission's queues,
    default :data:`~rlbatch.control.discipline.PPO_QUEUE_ORDER`).

    :raises ValueError: an unknown option, one given twice, a bad value, ``release_tpot``
        with ``release=off`` (it would do nothing), or no path.
    """
    release: float | None = HOLD_RELEASE_FRACTION
    tolerance = RELEASE_TPOT_TOLERANCE
    order: QueueOrder = PPO_QUEUE_ORDER
    seen: set[str] = set()
    path = arg
    while True:
        head, sep, option = path.rpartition(":")
        if not (sep and _OPTION.match(option)):
            break
        key, _, value = option.partition("=")
        if key not in ("release", "release_tpot", "order"):
            raise ValueError(f"unknown ppo option {key!r} in ppo:{arg} (options: release=F or "
                             f"release=off, release_tpot=X, order=fifo|deadline)")
        if key in seen:
            raise ValueError(f"ppo option {key} given twice in ppo:{arg}")
        seen.add(key)
        if key == "release":
            release = _release_option(value, arg)
        elif key == "order":
            try:
                order = check_queue_order(value)
            except ValueError:
                raise _option_error("order", value, arg) from None
        else:
            tolerance = _tolerance_option(value, arg)
        path = head
    if not path:
        raise ValueError("ppo needs an artifact path, e.g. ppo:policies/default")
    if release is None and "release_tpot" in seen:
        raise ValueError(f"ppo option release_tpot does nothing with release=off (ppo:{arg})")
    return PpoController(load_artifact(Path(path)), name=f"ppo:{arg}",
                         release=None if release is None else HoldRelease(release, tolerance),
                         order=order)
