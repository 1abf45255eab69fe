"""BatchSizeEnv: choose per-bucket batch caps and pools for an LLM serving engine."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rlbatch.buckets import Buckets
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, make_codec
from rlbatch.control.discipline import QueueOrder
from rlbatch.control.guard import DEFAULT_LADDER, GuardConfig
from rlbatch.control.hold_release import HoldRelease
from rlbatch.control.observation import (
    CLIP,
    ObservationBuilder,
    observation_size,
)
from rlbatch.control.pipeline import DecisionPipeline
from rlbatch.control.reward import RewardConfig, compute_reward
from rlbatch.control.stats_metrics import guard_readings
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.engine.config import parse_pools
from rlbatch.paths import default_training_traces
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import Deployment, DeploymentSpec
from rlbatch.serving.loop import ControlLoop
from rlbatch.workload import Workload
from rlbatch.workload.scenarios import SCENARIOS, ScenarioSampler, make_scenario


class BatchSizeEnv(gym.Env[np.ndarray, np.ndarray]):
    """Per-bucket batch caps and precision pools for a vLLM-style serving engine.

    ## Description
    Requests arrive from a real trace slice or a generator and wait in one FIFO queue per
    prompt-length bucket (default ``0-1k``, ``1k-2k``, ``2k-4k``, ``4k+`` tokens). An engine
    (the vLLM V1 simulator by default) runs them with continuous batching, chunked prefill
    and a paged KV cache. Every control tick (``tick_s`` of engine time, 1 s by default) the
    agent sets, per bucket, the cap (most requests of that bucket an engine holds at once)
    and the pool (``fp16`` or ``fp8`` KV cache) the bucket is routed to. The proposal goes
    through the one decision pipeline every served controller uses
    (:class:`~rlbatch.control.pipeline.DecisionPipeline`): the hold release, if set, then a
    hard rule-based :class:`~rlbatch.control.guard.Guard` (warm-up ramp, KV-usage and P99
    circuit breakers, efficiency monitor, committed-KV admission budget), whose overrides
    are penalised and reported.

    ## Action space
    ``MultiDiscrete([L, P] * B)``: for each bucket ``b`` in order, ``action[2b]`` is an index
    into the cap ladder (default ``1, 2, 4, 8, 12, 16, 24, 32, 48, 64``, ``L = 10``) and
    ``action[2b + 1]`` an index into the deployment's pools (``P = 1`` when it has one pool,
    so that dimension is fixed at 0). Anything else raises ``ValueError``.

    With ``action_kind="total_share"``: ``MultiDiscrete([T] + [S, P] * B)``: ``action[0]``
    indexes the total cap ladder (``4 ... 256``, engine-wide ``max_num_seqs``, what a static
    cap sets) and, per bucket, ``action[1 + 2b]`` its share of the total (``1/8, 1/4, 1/2,
    1``: cap ``ceil(share * total)``, 1 = only the total limits it) and ``action[2 + 2b]``
    its pool. With ``decision_ticks = k`` one step holds the action for ``k`` ticks (the
    guard still checks every tick) and returns the summed reward. With ``release`` set, what
    the action holds back is released on every tick where a queue head has waited that
    fraction of the SLA's TTFT (a trimmed bucket's trim; the total, whatever TPOT is:
    :mod:`rlbatch.control.hold_release`), exactly as ``ppo:PATH`` serves a policy.

    ## Observation space
    ``Box(0, 10, (8 B + 13,), float32)``; every feature is normalised and clipped to [0, 10].
    ``obs_version=2`` appends smoothed trends (``3 B + 4`` more: per bucket arrival and
    departure rates and queue growth; total running, total cap in force, arrivals /
    departures, doomed rate; see :mod:`rlbatch.control.observation`). ``obs_version=3`` has
    version 2's features with every rate (arrivals, departures, queue growth, doomed
    requests), queue length and throughput stated relative to the deployment's reference
    capacity (:mod:`rlbatch.profiles.capacity`) instead of absolute, plus two more: the
    capacity (log1p(requests/s) / log1p(100)) and the reference requests one engine's KV pool
    holds / 256. ``obs_version=4`` is version 3 without the action in force (per bucket cap
    and pool, and the total cap: ``2 B + 1`` fewer), which a cloned student would copy.
    ``obs_version=5`` is version 4 plus 7 features of the kind of traffic served and the SLA:
    the prefill share of the computed tokens, the mean output length of finished requests
    (both smoothed), TTFT and TPOT P99 of all buckets / the SLA's, the engines' busy time, and
    the SLA's TTFT / 5 s and TPOT / 0.15 s (:data:`rlbatch.control.observation.
    TRAFFIC_GLOBAL_FEATURES`). ``obs_version=6`` is version 5 plus the share of the prompt
    tokens looked up in the engines' prefix caches that were found there (smoothed; 0 before
    any lookup): long prompts with shared prefixes cost little prefill. ``obs_version=7`` is
    version 6 plus the share of the total ladder (4-256) whose TPOT, predicted by the
    deployment's step-time model at the traffic's mean context and prefill rate, meets the
    SLA's (:class:`rlbatch.control.tpot_fit.TpotFit`; needs GPU and model profiles).

    | index | feature | unit / normalisation |
    |---|---|---|
    | 8b+0 | queue length of bucket b | log1p(requests) / log1p(1000) |
    | 8b+1 | arrival rate of bucket b in the last tick | log1p(req/s) / log1p(100) |
    | 8b+2 | requests of bucket b inside engines (running + engine-waiting) | / ladder max |
    | 8b+3 | cap in force for bucket b | / ladder max |
    | 8b+4 | pool in force for bucket b | pool index / (pools - 1); any pool: 0.5 |
    | 8b+5 | TTFT P99 of bucket b over the last 30 s | / SLA TTFT (0: no completions) |
    | 8b+6 | TPOT P99 of bucket b over the last 30 s | / SLA TPOT (0: no completions) |
    | 8b+7 | wait of bucket b's oldest queued request | / SLA TTFT |
    | 8B+0 | KV cache usage (max over engines) | fraction |
    | 8B+1 | committed KV (prompt + expected output admitted) | fraction of the KV pool |
    | 8B+2 | GPU memory used | fraction (simulator: vLLM's pre-allocation) |
    | 8B+3 | preemptions | log1p(per s) |
    | 8B+4 | output throughput | log1p(tokens/s) / log1p(10000) |
    | 8B+5 | batch efficiency in the tick | useful / computed tokens |
    | 8B+6 | SLA attainment over the window | fraction (1: no completions) |
    | 8B+7 | warm-up progress | time / warm-up length, clipped to 1 |
    | 8B+8..12 | guard rule active: warmup, kv_high, p99, efficiency, kv_budget | 0 / 1 |

    ## Rewards
    Per tick (see :mod:`rlbatch.control.reward`)::

        r = (met - 0.5 missed) / norm - 0.5 unbooked_at_end / norm
            - 0.2 mean_b min(late_b, 30) - 0.05 preemptions / norm
            - 1.0 [kv_overflow] - 0.02 overrides / B - 0.015 met_fp8 / norm
            + 0.2 (worst bucket attainment - 1)

    with ``norm`` the episode's expected arrivals per tick. ``missed`` books every request
    that cannot meet the SLA once, as soon as that is known: its TTFT deadline passed without
    a first token (queued or inside an engine: ``stats.doomed``), it completed over the TPOT
    limit, or it was refused. At the episode's last step every request still unfinished and
    not yet booked counts as missed (``unbooked_at_end``), so leaving work undone never pays.
    ``late_b`` is how many TTFT limits bucket b's queue head is past its deadline. The
    attainment is per bucket over the 30 s window; a bucket with no completions there but
    doomed requests (or a queue head past its deadline) counts 0. ``info["reward_parts"]``
    holds every component; ``info["stats"]`` is the tick's typed
    :class:`~rlbatch.control.types.DeploymentStats` (what training's TensorBoard reads through
    :mod:`rlbatch.control.stats_metrics`), ``info["guard_readings"]`` the guard's ``tpot_fit``
    ceiling and slowdown after the step where the rule sets them
    (:func:`~rlbatch.control.stats_metrics.guard_readings`; empty with the rule off).

    ## Starting state
    An idle deployment at time 0; the workload of the episode is drawn from the scenario
    (a trace slice at a random rate scale, or a Poisson / bursty / diurnal generator with a
    random rate and length mix) using ``self.np_random``.

    ## Episode end
    ``truncated`` once every request of the episode's workload has finished or been rejected,
    or ``drain_s`` after its last arrival (the service goes on; nothing terminates). The
    registration adds a ``max_episode_steps`` time limit.

    ## Arguments
    ``gymnasium.make("rlbatch/BatchSize-v0", scenario="mixed", traces=None,
    episode_s=600, tick_s=1.0, drain_s=120, gpu="a100-80g", model="llama-2-7b",
    pools="fp16", ladder=None, guard=None, reward=None, sla=None, buckets=None,
    rate_scale=1.0, window_s=30, engine="sim", max_model_len=None,
    action_kind="per_bucket", obs_version=1, decision_ticks=1, shares=SHARE_LADDER,
    release=None, queue_order="fifo")``

    * ``scenario``: ``mixed`` (trace slices + generators), a named scenario (``day``,
      ``night``, ``bursty``, ``diurnal``), or a trace file path (random slices of it).
    * ``traces``: training traces for ``mixed`` (default: the shipped Azure trace).
    * ``pools``: ``fp16``, ``fp8`` or ``fp16:1,fp8:1`` (then the pool action is live).
    * ``guard``: a :class:`~rlbatch.control.guard.GuardConfig` (default: the guide's rules).
    * ``engine``: ``sim`` (default) or ``vllm``: real in-process vLLM engines (``model="tiny"``
      here, a checkpoint folder on a GPU host); ticks are then wall-clock, each reset starts
      fresh engines, and the guard's warm-up applies (a cold start).
    * ``max_model_len``: longest prompt + output accepted (default: the model's).
    * ``action_kind``: ``per_bucket`` (caps per bucket) or ``total_share`` (a total cap and
      per-bucket shares; the guard's ladder is then the total ladder, up to 256).
    * ``obs_version``: 1 (snapshot features), 2 (plus trends), 3 (version 2 in units of
      the deployment's capacity), 4 (version 3 without the action in force), 5 (version 4
      plus the kind of traffic and the SLA), 6 (version 5 plus the prefix-cache hit rate) or
      7 (version 6 plus the share of totals whose predicted TPOT meets the SLA).
    * ``decision_ticks``: ticks one action is held for.
    * ``shares``: the ``total_share`` action's share ladder (``(1.0,)``: the total cap
      only).
    * ``release``: the hold release, a :class:`~rlbatch.control.hold_release.HoldRelease`
      (``None``: off, the default).
    * ``queue_order``: the order of admission's queues, ``fifo`` (the default) or
      ``deadline`` (requests that can no longer meet their TTFT after those that can:
      :mod:`rlbatch.control.discipline`).

    ## Version history
    * v0: initial version; observation version 3, the hold release and ``queue_order``
      added without a new env version (the defaults are unchanged).
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium convention)

    def __init__(
        self,
        scenario: str = "mixed",
        traces: tuple[str | Path, ...] | None = None,
        episode_s: float = 600.0,
        tick_s: float = 1.0,
        drain_s: float = 120.0,
        gpu: str = "a100-80g",
        model: str = "llama-2-7b",
        pools: str = "fp16",
        ladder: tuple[int, ...] | None = None,
        guard: GuardConfig | None = None,
        reward: RewardConfig | None = None,
        sla: SLA | None = None,
        buckets: Buckets | None = None,
        rate_scale: float = 1.0,
        window_s: float = 30.0,
        engine: str = "sim",
        max_model_len: int | None = None,
        action_kind: str = "per_bucket",
        obs_version: int = 1,
        decision_ticks: int = 1,
        shares: tuple[float, ...] = SHARE_LADDER,
        release: HoldRelease | None = None,
        queue_order: QueueOrder = "fifo",
    ) -> None:
        super().__init__()
        if not episode_s > 0 or not tick_s > 0 or not drain_s >= 0:
            raise ValueError(f"episode_s and tick_s must be > 0 and drain_s >= 0, got "
                             f"{episode_s}, {tick_s}, {drain_s}")
        if decision_ticks < 1:
            raise ValueError(f"decision_ticks must be >= 1, got {decision_ticks}")
        guard_cfg = guard or GuardConfig(
            ladder=TOTAL_LADDER if action_kind == "total_share" else DEFAULT_LADDER)
        if ladder is not None:
            guard_cfg = replace(guard_cfg, ladder=tuple(ladder))
        self.pipeline = DecisionPipeline(guard_cfg, release, queue_order)
        self.guard = self.pipeline.guard
        self.ladder = guard_cfg.ladder
        self.reward_cfg = reward or RewardConfig()
        self.obs_version = obs_version
        self.decision_ticks = decision_ticks
        self.scenario = scenario
        self.episode_s = episode_s
        self.drain_s = drain_s
        self.window_s = window_s
        self.rate_scale = rate_scale
        self.deployment_spec = DeploymentSpec(
            gpu=gpu, model=model, pools=parse_pools(pools), buckets=buckets or Buckets(),
            sla=sla or SLA(), tick_s=tick_s,
            max_model_len=max_model_len or guard_cfg.max_seq_len,
            admission=AdmissionConfig(over_length=guard_cfg.over_length), engine=engine,
            cold_start=engine == "vllm")
        self.pool_names = tuple(self.deployment_spec.pools)
        n_b = len(self.deployment_spec.buckets)
        self.codec = make_codec(action_kind, ladder=self.ladder, pools=self.pool_names,
                                num_buckets=n_b, shares=shares)
        self.action_kind = action_kind
        self.action_space = spaces.MultiDiscrete(np.array(self.codec.nvec, dtype=np.int64))
        size = observation_size(n_b, obs_version)
        self.observation_space = spaces.Box(0.0, CLIP, shape=(size,), dtype=np.float32)
        if scenario == "mixed":
            self._sampler: ScenarioSampler | None = ScenarioSampler(
                tuple(traces) if traces is not None else default_training_traces(),
                rate_scale=rate_scale)
        elif scenario in SCENARIOS:
            self._sampler = None
        else:
            self._sampler = ScenarioSampler((scenario,), trace_fraction=1.0,
                                            rate_scale=rate_scale)
        self._loop: ControlLoop | None = None
        self._deployment: Deployment | None = None
        self._info: DeploymentInfo | None = None
        self._builder: ObservationBuilder | None = None
        self._last_stats: DeploymentStats | None = None
        self._norm = 1.0
        self.workload: Workload | None = None

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        workload = (options or {}).get("workload")
        if workload is None:
            workload = self._draw_workload()
        self.workload = workload
        self.close()
        deployment = build_deployment(self.deployment_spec)
        self._deployment = deployment
        info = deployment.info
        self._info = info
        self.pipeline.reset(info)
        initial, _ = self.pipeline.decide(None, None)
        self._loop = ControlLoop(deployment, workload.requests, initial,
                                 discipline=self.pipeline.discipline, window_s=self.window_s,
                                 drain_s=self.drain_s)
        self._builder = ObservationBuilder(info, self.guard.config.max_cap,
                                           self.guard.config.warmup_s, self.obs_version)
        self._last_stats = None
        rate = len(workload) / max(workload.duration_s, self.deployment_spec.tick_s)
        self._norm = max(rate * self.deployment_spec.tick_s, 1e-3)
        return self._builder.initial(), {"workload": workload.name,
                                         "requests": len(workload)}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._loop is None or self._builder is None or self._info is None:
            raise RuntimeError("call reset() before step()")
        proposed = self.decode_action(action)
        # The proposal holds for decision_ticks ticks; the guard checks it every tick and
        # the observation's smoothed rates see every tick.
        reward = 0.0
        parts: dict[str, float] = {}
        fired: list[str] = []
        for _ in range(self.decision_ticks):
            safe, overrides = self.pipeline.decide(proposed, self._last_stats)
            self._loop.apply(safe)
            stats = self._loop.tick()
            self._last_stats = stats
            truncated = self._loop.finished
            r, tick_parts = compute_reward(
                stats, len(overrides), self._norm, self._info.sla, self.reward_cfg,
                unbooked=self._loop.unbooked_by_bucket() if truncated else ())
            reward += r
            for k, v in tick_parts.items():
                parts[k] = parts.get(k, 0.0) + v
            fired.extend(o.rule for o in overrides)
            obs = self._builder.build(stats, self.guard.flags())
            if truncated:
                break
        info: dict[str, Any] = {
            "time_s": stats.time_s,
            "reward_parts": parts,
            "overrides": fired,
            # only the known readings: NaN would make equal steps' infos unequal
            "guard_readings": {k: v for k, v in guard_readings(self.guard).items()
                               if not math.isnan(v)},
            "caps": safe.caps,
            "pools": safe.pools,
            "stats": stats,
        }
        if truncated:
            info["episode_summary"] = self._loop.summary()
        return obs, reward, False, truncated, info

    def close(self) -> None:
        """Release the engines of the current episode (live vLLM engines hold a model)."""
        if self._deployment is not None:
            self._deployment.close()
            self._deployment = None

    # ------------------------------------------------------------------ helpers
    def decode_action(self, action: np.ndarray | list[int] | tuple[int, ...]) -> ControlAction:
        """MultiDiscrete action -> ControlAction; raises ValueError on anything invalid."""
        return self.codec.decode(action)

    def encode_action(self, action: ControlAction) -> np.ndarray:
        """ControlAction -> nearest MultiDiscrete action (cap rounded down the ladder)."""
        return self.codec.encode(action)

    def _draw_workload(self) -> Workload:
        rng = self.np_random
        if self._sampler is not None:
            return self._sampler.sample(rng, self.episode_s)
        return make_scenario(self.scenario, seed=int(rng.integers(2**31)),
                             duration_s=self.episode_s, rate_scale=self.rate_scale)

    @property
    def deployment_info(self) -> DeploymentInfo | None:
        return self._info

