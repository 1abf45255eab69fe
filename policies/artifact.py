"""The safe policy artifact: safetensors weights + JSON metadata, loaded without pickle.

A trained SB3 PPO MlpPolicy (MultiDiscrete actions) is exported as:

* ``policy.safetensors``: the actor's layers ``pi.{i}.weight`` / ``pi.{i}.bias`` and the
  action head ``action.weight`` / ``action.bias`` (float32);
* ``policy.json``: format version, activation, the action layout (ladder, pools, buckets),
  observation size and feature names, observation normalisation (mean / std / clip), the
  range of the observations a cloned student was fitted on (``obs_range``: low / high per
  feature; each observation is clipped into it before the network sees it), the
  training scenario and command, rlbatch version, and a SHA-256 of the weights file.

Serving needs only numpy (no torch, no SB3): deterministic action = per-dimension argmax of
the logits, as SB3's ``predict(deterministic=True)`` does for MultiDiscrete.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

FORMAT = "rlbatch-policy"
FORMAT_VERSION = 1
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


class ArtifactError(ValueError):
    """A policy artifact is missing, corrupt, or does not match the deployment."""


@dataclass
class PolicyArtifact:
    """A loaded policy: weights, layout and provenance.

    :param hidden: ``[(weight, bias), ...]`` of the actor's hidden layers.
    :param head: ``(weight, bias)`` of the action logits.
    :param metadata: the JSON metadata (see module docstring).
    """

    hidden: list[tuple[np.ndarray, np.ndarray]]
    head: tuple[np.ndarray, np.ndarray]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._act = ACTIVATIONS[self.metadata.get("activation", "tanh")]
        self.nvec = [int(n) for n in self.metadata["nvec"]]
        norm = self.metadata.get("obs_norm") or {}
        size = int(self.metadata["obs_size"])
        self._mean = np.asarray(norm.get("mean", np.zeros(size)), dtype=np.float32)
        self._std = np.asarray(norm.get("std", np.ones(size)), dtype=np.float32)
        self._clip = float(norm.get("clip", 1e9))
        # a network fitted on a range extrapolates arbitrarily past it (measured: the 4k+
        # features on Mooncake sit at 4x their training maximum); the clip bounds that
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None
        if (bounds := self.metadata.get("obs_range")) is not None:
            low = np.asarray(bounds["low"], dtype=np.float32)
            high = np.asarray(bounds["high"], dtype=np.float32)
            if low.shape != (size,) or high.shape != (size,):
                raise ArtifactError(f"obs_range has {low.shape} / {high.shape} bounds for "
                                    f"{size} features")
            self._bounds = (low, high)
        self._splits = np.cumsum(self.nvec)[:-1]

    @property
    def obs_size(self) -> int:
        return int(self.metadata["obs_size"])

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Action logits for one observation (or a batch)."""
        x = np.asarray(obs, dtype=np.float32)
        if self._bounds is not None:
            x = np.clip(x, *self._bounds)
        x = np.clip((x - self._mean) / self._std, -self._clip, self._clip)
        for w, b in self.hidden:
            x = self._act(x @ w.T + b)
        w, b = self.head
        out: np.ndarray = x @ w.T + b
        return out

    def act(self, obs: np.ndarray) -> np.ndarray:
        """Deterministic MultiDiscrete action for one observation."""
        if obs.shape[-1] != self.obs_size:
            raise ArtifactError(f"observation has {obs.shape[-1]} features, the policy "
                                f"expects {self.obs_size}")
        logits = self.logits(obs)
        parts = np.split(logits, self._splits, axis=-1)
        return np.stack([p.argmax(axis=-1) for p in parts], axis=-1).astype(np.int64)


def save_artifact(path: Path, hidden: list[tuple[np.ndarray, np.ndarray]],
                  head: tuple[np.ndarray, np.ndarray], metadata: dict[str, Any]) -> Path:
    """Write ``path/policy.safetensors`` and ``path/policy.json``; returns the JSON path."""
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for i, (w, b) in enumerate(hidden):
        tensors[f"pi.{i}.weight"] = np.ascontiguousarray(w, dtype=np.float32)
        tensors[f"pi.{i}.bias"] = np.ascontiguousarray(b, dtype=np.float32)
    tensors["action.weight"] = np.ascontiguousarray(head[0], dtype=np.float32)
    tensors["action.bias"] = np.ascontiguousarray(head[1], dtype=np.float32)
    weights = path / "policy.safetensors"
    save_file(tensors, str(weights))
    meta = dict(metadata, format=FORMAT, format_version=FORMAT_VERSION,
                num_hidden=len(hidden),
                weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest())
    meta_path = path / "policy.json"
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta_path


def load_artifact(path: str | Path) -> PolicyArtifact:
    """Load an artifact from its folder or its ``policy.json``; never unpickles anything.

    :raises ArtifactError: missing files, wrong format, checksum mismatch, bad shapes.
    """
    p = Path(path)
    meta_path = p / "policy.json" if p.is_dir() else p
    if not meta_path.exists():
        raise ArtifactError(f"policy artifact not found: {meta_path} (expected a folder with "
                            f"policy.json and policy.safetensors)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{meta_path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f"{meta_path}: not an rlbatch policy (format={meta.get('format')!r}"
                            if isinstance(meta, dict) else f"{meta_path}: not an object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{meta_path}: format_version {meta.get('format_version')} is not "
                            f"supported (this rlbatch reads {FORMAT_VERSION})")
    for key in ("nvec", "obs_size", "ladder", "pools", "bucket_edges", "num_hidden"):
        if key not in meta:
            raise ArtifactError(f"{meta_path}: metadata field {key!r} missing")
    weights = meta_path.parent / "policy.safetensors"
    if not weights.exists():
        raise ArtifactError(f"{weights}: weights file missing")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != meta.get("weights_sha256"):
        raise ArtifactError(f"{weights}: checksum mismatch (corrupt or replaced weights)")
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # safetensors raises its own error types
        raise ArtifactError(f"{weights}: unreadable safetensors file ({exc})") from None
    try:
        hidden = [(tensors[f"pi.{i}.weight"], tensors[f"pi.{i}.bias"])
                  for i in range(int(meta["num_hidden"]))]
        head = (tensors["action.weight"], tensors["action.bias"])
    except KeyError as exc:
        raise ArtifactError(f"{weights}: tensor {exc} missing") from None
    width = int(meta["obs_size"])
    for i, (w, b) in enumerate([*hidden, head]):
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise ArtifactError(f"{weights}: layer {i} has shape {w.shape} / {b.shape}, "
                                f"expected input width {width}")
        width = w.shape[0]
    if width != sum(int(n) for n in meta["nvec"]):
        raise ArtifactError(f"{weights}: action head has {width} outputs, nvec sums to "
                            f"{sum(meta['nvec'])}")
    return PolicyArtifact(hidden, head, meta)


def copy_artifact(src: str | Path, dst: Path, extra: dict[str, Any]) -> Path:
    """Write the artifact at ``src`` to ``dst`` with ``extra`` metadata (same weights)."""
    artifact = load_artifact(src)
    meta = {k: v for k, v in artifact.metadata.items()
            if k not in ("format", "format_version", "num_hidden", "weights_sha256")}
    return save_artifact(dst, artifact.hidden, artifact.head, {**meta, **extra})
