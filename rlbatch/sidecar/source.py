"""The sidecar's upstreams as a source of the control loop, and the deployment they make.

:class:`~rlbatch.serving.loop.ControlLoop` builds every
:class:`~rlbatch.control.types.DeploymentStats` of the project, the sidecar's included:
:class:`UpstreamSource` is what it ticks here. Time passes by itself (``run_until`` only lets
queued requests into upstreams that came back), and each upstream's
:class:`~rlbatch.engine.stats.EngineStats` comes from the sidecar's bookkeeping and the
upstream's last ``/metrics`` scrape.
"""

from __future__ import annotations

from rlbatch.control.types import ControlAction, DeploymentInfo
from rlbatch.engine.stats import EngineStats
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.serving.deployment import describe_deployment
from rlbatch.sidecar.dispatch import Dispatcher
from rlbatch.sidecar.settings import SidecarSettings
from rlbatch.sidecar.upstream import HttpUpstream

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block until an upstream's ``vllm:cache_config_info`` tells its own."""


def describe_upstreams(settings: SidecarSettings, by_pool: dict[str, list[HttpUpstream]],
                       max_model_len: int) -> DeploymentInfo:
    """What the controller is told about the upstreams: the settings, plus the KV size of
    each pool as its first upstream that reported one tells it (0 while none has).

    :param settings: the sidecar's settings.
    :param by_pool: the upstreams of each pool.
    :param max_model_len: longest sequence admitted.
    """
    blocks: dict[str, int] = {}
    block_size = DEFAULT_BLOCK_SIZE
    for pool, ups in by_pool.items():
        known = [u.metrics for u in ups if u.metrics is not None]
        blocks[pool] = next((m.num_gpu_blocks for m in known if m.num_gpu_blocks), 0)
        block_size = next((m.block_size for m in known if m.block_size), block_size)
    capacity = settings.capacity_rps
    if capacity is None:
        capacity = _profile_capacity(settings, blocks, block_size)
    return describe_deployment(
        pools=settings.pool_sizes, num_kv_blocks=blocks, buckets=settings.buckets,
        gpu=settings.gpu, model=settings.model, max_model_len=max_model_len,
        block_size=block_size, default_max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, tick_s=settings.tick_s,
        sla=settings.sla, cold_start=settings.cold_start, capacity_rps=capacity)


def _profile_capacity(settings: SidecarSettings, blocks: dict[str, int],
                      block_size: int) -> float:
    """The upstreams' reference capacity from ``--gpu`` / ``--model`` profiles (and their
    KV sizes once reported); 0 when either is not a profile."""
    from rlbatch.profiles.capacity import profile_capacity_rps

    try:
        return profile_capacity_rps(
            settings.gpu, settings.model, settings.pool_sizes,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            num_kv_blocks=blocks, block_size=block_size)
    except ValueError:  # ProfileError included: not a profile name, or does not fit
        return 0.0


class UpstreamSource:
    """The upstreams behind admission, as :class:`~rlbatch.serving.loop.ServingSource`.

    :param dispatch: the request path over the upstreams (their admission included).
    :param info: the deployment as described so far (:func:`describe_upstreams`).
    :param in_force: the action in force before the first :meth:`apply`.
    """

    def __init__(self, dispatch: Dispatcher, info: DeploymentInfo,
                 in_force: ControlAction) -> None:
        self.dispatch = dispatch
        self.admission = dispatch.admission
        self.upstreams = dispatch.upstreams
        self.info = info
        self.in_force = in_force
        self.telemetry: MemoryTelemetry | None = None

    def apply(self, action: ControlAction) -> None:
        """Put an action in force (caps, routes, KV budget, engine-wide cap) and admit what
        it lets in.

        :param action: a guarded action.
        """
        if action.max_num_seqs is None:
            for u in self.upstreams:
                u.clear_max_num_seqs()
        self.admission.apply(action)
        self.in_force = action
        self.dispatch.admit_all()

    def run_until(self, t_s: float) -> None:
        """Real time passes by itself; an upstream may be back, so admit into it.

        :param t_s: the tick time (unused).
        """
        self.dispatch.admit_all()

    def snapshot(self) -> tuple[EngineStats, ...]:
        """One EngineStats per upstream (with the GPU memory NVML reads, when it can)."""
        used = total = 0
        if self.telemetry is not None:
            reading = self.telemetry.read()
            if reading.source == "nvml":
                used, total = reading.used_bytes, reading.total_bytes
        return tuple(u.snapshot_with_memory(used, total) for u in self.upstreams)

    def done(self) -> bool:
        """Never: a service has no last request."""
        return False

    def unfinished(self) -> int:
        """Requests queued in admission or inside an upstream."""
        return self.admission.num_queued() + sum(sum(u.unfinished) for u in self.upstreams)
