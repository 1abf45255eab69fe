"""The admission-control sidecar: an OpenAI-compatible proxy in front of vLLM servers that
applies a controller's per-bucket batch caps and pool routing (see ``docs/sidecar.md``)."""

from rlbatch.sidecar.app import SIDECAR, create_app, serve
from rlbatch.sidecar.service import Sidecar
from rlbatch.sidecar.settings import SidecarSettings, UpstreamSpec

__all__ = ["SIDECAR", "Sidecar", "SidecarSettings", "UpstreamSpec", "create_app", "serve"]
