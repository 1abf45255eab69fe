"""``ppo:PATH``: a trained policy artifact behind the guard.

Serving loads the safetensors artifact (no pickle, no SB3, no torch) and runs the same
observation code and guard as the environment it was trained in.
"""

from __future__ import annotations

from pathlib import Path

from policies.artifact import ArtifactError, PolicyArtifact, load_artifact
from policies.rules import GuardedController
from rlbatch.control.action_codec import ActionCodec
from rlbatch.control.guard import GuardConfig
from rlbatch.control.observation import ObservationBuilder
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats


class PpoController(GuardedController):
    """A trained policy, deterministic, behind the guard it was trained with.

    :param artifact: the loaded artifact.
    :param name: controller name (``ppo:PATH``).
    :param guard: guard configuration (default: the training run's ladder, default rules).
    """

    def __init__(self, artifact: PolicyArtifact, name: str = "ppo",
                 guard: GuardConfig | None = None) -> None:
        ladder = tuple(int(c) for c in artifact.metadata["ladder"])
        super().__init__(name, guard or GuardConfig(ladder=ladder))
        self.artifact = artifact
        self._builder: ObservationBuilder | None = None
        self._codec: ActionCodec | None = None

    def on_reset(self, info: DeploymentInfo) -> None:
        meta = self.artifact.metadata
        if list(info.buckets.edges) != [int(e) for e in meta["bucket_edges"]]:
            raise ArtifactError(f"policy was trained on bucket edges {meta['bucket_edges']}, "
                                f"the deployment uses {list(info.buckets.edges)}")
        if list(info.pool_names) != list(meta["pools"]):
            raise ArtifactError(f"policy was trained on pools {meta['pools']}, the deployment "
                                f"has {list(info.pool_names)}")
        self._builder = ObservationBuilder(info, self.guard.config.max_cap,
                                           self.guard.config.warmup_s)
        if self._builder.size != self.artifact.obs_size:
            raise ArtifactError(f"policy expects {self.artifact.obs_size} observation "
                                f"features, the deployment gives {self._builder.size}")
        self._codec = ActionCodec(self.guard.config.ladder, info.pool_names, len(info.buckets))

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self._builder is not None and self._codec is not None, "reset() first"
        obs = (self._builder.initial() if stats is None
               else self._builder.build(stats, self.guard.flags()))
        return self._codec.decode(self.artifact.act(obs))


def ppo_factory(arg: str) -> PpoController:
    """``ppo:PATH`` (a folder with policy.json + policy.safetensors, or the JSON file)."""
    if not arg:
        raise ValueError("ppo needs an artifact path, e.g. ppo:policies/default")
    return PpoController(load_artifact(Path(arg)), name=f"ppo:{arg}")
