"""Build the deployment a :class:`DeploymentSpec` names: simulated, calibrated or live vLLM.

:func:`build_deployment` is the one entry point (evaluate, simulate, the Gymnasium env, the
sweep). It picks the engines the spec asks for and hands them to
:func:`~rlbatch.serving.deployment.assemble_deployment`, the one place that puts engines
behind admission and describes them to controllers:

* ``engine="sim"`` without a profile: the simulator with the roofline step-time model of
  the GPU and model profiles (:func:`build_sim_deployment`);
* ``engine="sim"`` with ``profile=FILE``: the simulator with a calibrated step-time model,
  KV blocks and budgets of a measured live engine (:func:`build_profile_deployment`);
* ``engine="vllm"``: real in-process vLLM engines (:func:`build_live_deployment`; vLLM is
  imported only when an engine starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlbatch.engine.base import Engine
from rlbatch.engine.config import EngineConfig, vllm_default_budgets
from rlbatch.engine.host_tier import host_link_of
from rlbatch.engine.reserve import KvReserveMode
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.vllm.config import TINY_KV_CACHE_BYTES, TINY_MODEL, VllmEngineConfig
from rlbatch.profiles import RooflineStepTimeModel, StepTimeModel, load_gpu, load_model
from rlbatch.profiles.calibrated import CalibratedProfile, load_profile
from rlbatch.profiles.step_time import pool_precision
from rlbatch.serving.clients import ClientMix
from rlbatch.serving.deployment import Deployment, DeploymentSpec, assemble_deployment

if TYPE_CHECKING:
    from rlbatch.engine.vllm.engine import VllmEngine

__all__ = [
    "build_deployment",
    "build_live_deployment",
    "build_profile_deployment",
    "build_sim_deployment",
    "live_config_from_spec",
    "profile_engine_config",
    "profile_sim_engine",
]


def build_deployment(spec: DeploymentSpec, live: VllmEngineConfig | None = None) -> Deployment:
    """Build the engines ``spec`` names: simulated (roofline or calibrated profile) or live
    vLLM.

    :param spec: the deployment.
    :param live: live engine settings the spec does not carry (dtype, KV memory, block
        size, seed); ``None``: :class:`VllmEngineConfig`'s defaults. Used when
        ``spec.engine == "vllm"`` only.
    """
    if spec.engine == "vllm":
        deployment = build_live_deployment(spec, live_config_from_spec(spec, live))
    elif spec.profile is not None:
        deployment = build_profile_deployment(spec)
    else:
        deployment = build_sim_deployment(spec)
    mix = ClientMix.parse(spec.clients)
    if not mix.patient:
        deployment.client_mix = (mix, spec.clients_seed)
    return deployment


def build_sim_deployment(spec: DeploymentSpec) -> Deployment:
    """The simulator with the roofline step-time model of ``spec.gpu`` and ``spec.model``.

    :param spec: the deployment (budgets default to vLLM's for the GPU, ``max_model_len`` to
        the model's context; a host KV tier of ``spec.kv_offload_gib`` per engine, its link
        from the GPU profile).
    :raises ValueError: ``max_model_len`` beyond the model's context, an unknown profile, or
        a host KV tier on a GPU profile without a host link bandwidth.
    """
    gpu = load_gpu(spec.gpu)
    model = load_model(spec.model)
    default_seqs, default_tokens = vllm_default_budgets(gpu.name)
    max_num_seqs = spec.max_num_seqs or default_seqs
    max_tokens = spec.max_num_batched_tokens or default_tokens
    max_model_len = spec.max_model_len or model.max_model_len
    if max_model_len > model.max_model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds {model.name}'s context "
                         f"{model.max_model_len}")
    engines: list[Engine] = []
    step_models: dict[str, StepTimeModel] = {}
    for pool, count in spec.pools.items():
        precision = pool_precision(pool)
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_tokens,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            precision=precision,
            max_model_len=max_model_len,
            num_kv_blocks_override=spec.num_kv_blocks,
            kv_reserve=spec.kv_reserve,
            kv_reserve_quantile=spec.kv_reserve_quantile,
            kv_reserve_shift=spec.kv_reserve_shift,
            enable_prefix_caching=spec.enable_prefix_caching,
            kv_offload_gib=spec.kv_offload_gib,
        )
        step_model = RooflineStepTimeModel(gpu, model, precision=precision, tp=spec.tp,
                                           max_num_batched_tokens=max_tokens,
                                           max_num_seqs=max_num_seqs)
        blocks = config.num_kv_blocks_override or step_model.kv_capacity_blocks(
            spec.gpu_memory_utilization, config.block_size)
        link = host_link_of(step_model, config.block_size) if spec.kv_offload_gib else None
        step_models[pool] = step_model
        for _ in range(count):
            engines.append(SimEngine(
                engine_id=len(engines), pool=pool, config=config, step_model=step_model,
                num_kv_blocks=blocks, max_model_len=max_model_len,
                gpu_memory_total_bytes=gpu.memory_bytes, num_buckets=len(spec.buckets),
                event_skipping=spec.event_skipping, host_link=link))
    return assemble_deployment(
        engines, buckets=spec.buckets, admission=spec.admission, gpu=gpu.name,
        model=model.name, max_model_len=max_model_len, block_size=EngineConfig.block_size,
        default_max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
        tick_s=spec.tick_s, sla=spec.sla, cold_start=spec.cold_start, step_models=step_models)


# --------------------------------------------------------------------------- calibrated


def profile_engine_config(profile: CalibratedProfile, pool: str, *,
                          max_num_seqs: int | None = None,
                          max_num_batched_tokens: int | None = None) -> EngineConfig:
    """The simulator's :class:`EngineConfig` for ``pool`` of a calibrated profile (block size
    and budgets of the measured engine unless overridden).

    :param profile: the calibrated profile.
    :param pool: ``fp16`` or ``fp8``.
    :param max_num_seqs: override.
    :param max_num_batched_tokens: override.
    """
    return EngineConfig(
        max_num_seqs=max_num_seqs or profile.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or profile.max_num_batched_tokens,
        block_size=profile.block_size, precision=pool_precision(pool),
        max_model_len=profile.max_model_len,
        num_kv_blocks_override=profile.num_kv_blocks(pool))


def profile_sim_engine(profile: CalibratedProfile, pool: str, engine_id: int,
                       num_buckets: int, *, max_num_seqs: int | None = None,
                       max_num_batched_tokens: int | None = None,
                       num_kv_blocks: int | None = None, event_skipping: bool = True,
                       start_s: float = 0.0, max_model_len: int | None = None,
                       kv_reserve: KvReserveMode = "observed",
                       kv_reserve_quantile: float = 0.9, kv_reserve_shift: bool = True,
                       enable_prefix_caching: bool = True) -> SimEngine:
    """A simulated engine standing in for ``pool``'s live engine of a calibrated profile.

    :param profile: the calibrated profile.
    :param pool: ``fp16`` or ``fp8``.
    :param engine_id: index in the deployment.
    :param num_buckets: prompt-length buckets.
    :param max_num_seqs: override the measured engine's ``max_num_seqs``.
    :param max_num_batched_tokens: override its token budget.
    :param num_kv_blocks: override its KV block count.
    :param event_skipping: the simulator's event skipping.
    :param start_s: initial clock.
    :param max_model_len: a shorter context than the measured engine's.
    :param kv_reserve: how the KV budget counts a request (:mod:`rlbatch.engine.reserve`).
    :param kv_reserve_quantile: output quantile ``observed`` reserves.
    :param kv_reserve_shift: ``observed`` forgets older outputs at a turn to longer ones.
    :param enable_prefix_caching: the simulator's prefix caching.
    """
    config = replace(profile_engine_config(profile, pool, max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens),
                     kv_reserve=kv_reserve, kv_reserve_quantile=kv_reserve_quantile,
                     kv_reserve_shift=kv_reserve_shift,
                     enable_prefix_caching=enable_prefix_caching)
    return SimEngine(
        engine_id=engine_id, pool=pool, config=config,
        step_model=profile.step_time_model(pool),
        num_kv_blocks=num_kv_blocks or profile.num_kv_blocks(pool),
        max_model_len=max_model_len or profile.max_model_len,
        gpu_memory_total_bytes=profile.gpu_memory_total_bytes, num_buckets=num_buckets,
        event_skipping=event_skipping, start_s=start_s)


def build_profile_deployment(spec: DeploymentSpec,
                             profile: CalibratedProfile | None = None) -> Deployment:
    """The simulator standing in for calibrated live engines (``DeploymentSpec(profile=FILE)``):
    step-time model, KV blocks, block size and budgets from the profile;
    ``spec.max_num_seqs``, ``spec.max_num_batched_tokens``, ``spec.num_kv_blocks`` and
    ``spec.max_model_len`` (at most the profile's) override when given.

    :param spec: the deployment (pools, buckets, admission, SLA, tick, event skipping).
    :param profile: the profile (default: ``load_profile(spec.profile)``).
    :raises ValueError: no profile given, or ``max_model_len`` beyond the profile's.
    """
    if profile is None:
        if spec.profile is None:
            raise ValueError("build_profile_deployment needs a profile (spec.profile)")
        profile = load_profile(spec.profile)
    max_model_len = spec.max_model_len or profile.max_model_len
    if max_model_len > profile.max_model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the calibrated engine's "
                         f"{profile.max_model_len}")
    engines: list[SimEngine] = []
    for pool, count in spec.pools.items():
        for _ in range(count):
            eng = profile_sim_engine(
                profile, pool, len(engines), len(spec.buckets), max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                num_kv_blocks=spec.num_kv_blocks, event_skipping=spec.event_skipping,
                max_model_len=max_model_len, kv_reserve=spec.kv_reserve,
                kv_reserve_quantile=spec.kv_reserve_quantile,
                kv_reserve_shift=spec.kv_reserve_shift,
                enable_prefix_caching=spec.enable_prefix_caching)
            engines.append(eng)
    first = engines[0]
    return assemble_deployment(
        engines, buckets=spec.buckets, admission=spec.admission, gpu=profile.device,
        model=profile.model, max_model_len=max_model_len, block_size=profile.block_size,
        default_max_num_seqs=first.config.max_num_seqs,
        max_num_batched_tokens=first.config.max_num_batched_tokens, tick_s=spec.tick_s,
        sla=spec.sla, cold_start=spec.cold_start,
        step_models={pool: profile.step_time_model(pool) for pool in spec.pools})


# --------------------------------------------------------------------------- live


def live_config_from_spec(spec: DeploymentSpec,
                          base: VllmEngineConfig | None = None) -> VllmEngineConfig:
    """The live engine settings ``spec`` asks for.

    ``base`` (default: :class:`VllmEngineConfig`'s defaults) supplies what the spec does not
    set; the spec's ``model`` is used when it is ``"tiny"`` or a checkpoint folder (a
    simulator profile name is not a live model), and its ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``num_kv_blocks`` and
    ``gpu_memory_utilization`` override the base when given.

    :param spec: the deployment.
    :param base: settings to start from.
    """
    config = base or VllmEngineConfig()
    model = config.model
    if spec.model == TINY_MODEL or Path(spec.model).is_dir():
        model = spec.model
    max_num_seqs = spec.max_num_seqs or config.max_num_seqs
    max_tokens = spec.max_num_batched_tokens
    if max_tokens is None:
        max_tokens = max(config.max_num_batched_tokens, spec.max_num_seqs or 0)
    kv_bytes = config.kv_cache_memory_bytes
    if kv_bytes is None and spec.num_kv_blocks is None and model == TINY_MODEL:
        # On CPU vLLM otherwise reserves gpu_memory_utilization x host memory and refuses to
        # start when other processes hold part of it; the tiny model needs very little.
        kv_bytes = TINY_KV_CACHE_BYTES
    return replace(
        config, model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
        max_model_len=spec.max_model_len or config.max_model_len,
        num_kv_blocks=spec.num_kv_blocks if spec.num_kv_blocks is not None
        else config.num_kv_blocks,
        gpu_memory_utilization=spec.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
        kv_reserve=spec.kv_reserve, kv_reserve_quantile=spec.kv_reserve_quantile,
        kv_reserve_shift=spec.kv_reserve_shift)


def build_live_deployment(spec: DeploymentSpec, config: VllmEngineConfig | None = None, *,
                          engines: Sequence[VllmEngine] | None = None) -> Deployment:
    """A deployment over live vLLM engines, one per engine of each pool in ``spec.pools``
    (``fp8`` pools get an FP8 KV cache).

    :param spec: the deployment (pools, buckets, admission, SLA, tick, budgets).
    :param config: engine settings (default :func:`live_config_from_spec`).
    :param engines: already started engines to reuse (their pools must match ``spec.pools``
        and they must share one clock, which is reset).

    The deployment's reference capacity (observation version 3) comes from ``spec.profile``,
    a calibrated profile of these engines; without one it is unknown (0).
    :returns: the deployment; ``Deployment.close()`` closes its engines.
    :raises ValueError: reused engines that do not match the spec.
    """
    from rlbatch.engine.vllm.launch import start_vllm_pools  # numpy, telemetry: live only

    config = config or live_config_from_spec(spec)
    pools = dict(spec.pools)
    if engines is None:
        started = start_vllm_pools(pools, config, num_buckets=len(spec.buckets))
    else:
        started = list(engines)
        have: dict[str, int] = {}
        for eng in started:
            have[eng.pool] = have.get(eng.pool, 0) + 1
        if have != pools:
            raise ValueError(f"engines {have} do not match the spec's pools {pools}")
        if any(e.clock is not started[0].clock for e in started):
            raise ValueError("live engines of one deployment must share one LiveClock "
                             "(start them with clock=...)")
        started[0].clock.reset()
    first = started[0]
    max_model_len = min(e.max_model_len for e in started)
    reading = first.telemetry.read()
    device = reading.devices[0].name if reading.devices else "cpu"
    step_models: dict[str, StepTimeModel] | None = None
    if spec.profile is not None:
        # A live engine has no step-time model of its own; its calibrated profile is one.
        profile = load_profile(spec.profile)
        step_models = {pool: profile.step_time_model(pool) for pool in pools}
    return assemble_deployment(
        started, buckets=spec.buckets, admission=spec.admission, gpu=device,
        model=config.model, max_model_len=max_model_len, block_size=first.block_size,
        default_max_num_seqs=first.configured_max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, tick_s=spec.tick_s,
        sla=spec.sla, cold_start=spec.cold_start, step_models=step_models)
