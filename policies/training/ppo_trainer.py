"""PPO training on the simulator: vectorised envs, TensorBoard, periodic evaluation against
the baselines, best-model checkpointing, safe export.

``train.py`` is a thin command line over :func:`train`.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np

import envs
from policies.artifact import load_artifact, save_artifact
from policies.evaluation.compare import starved_buckets
from policies.ppo import PpoController
from policies.training.board import ticks_median
from rlbatch import __version__
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import PPO_QUEUE_ORDER
from rlbatch.control.guard_record import guard_record
from rlbatch.control.observation import feature_names
from rlbatch.control.stats_metrics import MetricContext, tensorboard_scalars
from rlbatch.control.types import DeploymentStats
from rlbatch.engine.config import parse_pools
from rlbatch.paths import default_training_traces, trace_ref
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import Workload, load_trace
from rlbatch.workload.scenarios import make_scenario, slice_trace

TB_SAMPLE_EVERY = 10
"""Ticks between two samples of the metric table in training's TensorBoard means."""
CAP_TAG = "decision/batch_cap/"
"""The table's cap tags: training logs caps as histograms (:func:`bucket_limits`), not means."""

@dataclass
class TrainConfig:
    """Everything a training run depends on (recorded in the artifact and TensorBoard).

    :param timesteps: environment steps (control ticks) to train for.
    :param n_envs: parallel environments.
    :param vec_env: ``dummy`` (in-process) or ``subproc`` (one process per env).
    :param seed: seed of PPO and the envs.
    :param scenario: env scenario (``mixed``, a named scenario, or a trace path).
    :param traces: training traces for ``mixed``.
    :param gpu: GPU profile.
    :param model: model profile.
    :param pools: pools, e.g. ``fp16`` or ``fp16:1,fp8:1``.
    :param episode_s: seconds of arrivals per episode.
    :param out: run folder (TensorBoard logs, checkpoints, artifacts).
    :param eval_freq: evaluate every this many steps (0: only at the end).
    :param n_steps: PPO rollout length per env.
    :param batch_size: PPO minibatch.
    :param n_epochs: PPO epochs per update.
    :param learning_rate: Adam step size.
    :param gamma: discount (0.99 at 1 s ticks: a ~100 s horizon, long enough to see a queue
        that over-admission builds).
    :param gae_lambda: GAE lambda.
    :param ent_coef: entropy bonus.
    :param net_arch: hidden layer widths of the actor and critic.
    """

    timesteps: int = 400_000
    n_envs: int = 2
    vec_env: Literal["dummy", "subproc"] = "dummy"
    seed: int = 0
    scenario: str = "mixed"
    traces: tuple[str, ...] = field(
        default_factory=lambda: tuple(str(p) for p in default_training_traces()))
    gpu: str = "a100-80g"
    model: str = "llama-2-7b"
    pools: str = "fp16"
    episode_s: float = 600.0
    out: str = "runs/ppo"
    eval_freq: int = 40_000
    n_steps: int = 1024
    batch_size: int = 256
    n_epochs: int = 10
    learning_rate: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    ent_coef: float = 0.01
    net_arch: tuple[int, ...] = (64, 64)

    def __post_init__(self) -> None:
        if self.timesteps < 1 or self.n_envs < 1:
            raise ValueError(f"timesteps and n_envs must be >= 1, got {self.timesteps}, "
                             f"{self.n_envs}")
        if self.vec_env not in ("dummy", "subproc"):
            raise ValueError(f"vec_env must be 'dummy' or 'subproc', got {self.vec_env!r}")
        parse_pools(self.pools)

    def env_kwargs(self) -> dict[str, Any]:
        # the queue order the checkpoints are evaluated and served in (ppo:PATH's default)
        return {"scenario": self.scenario, "traces": self.traces, "gpu": self.gpu,
                "model": self.model, "pools": self.pools, "episode_s": self.episode_s,
                "queue_order": PPO_QUEUE_ORDER}


def _make_env(kwargs: dict[str, Any]) -> Callable[[], gym.Env[Any, Any]]:
    def thunk() -> gym.Env[Any, Any]:
        import envs as _envs  # registers the env in subprocesses

        return gym.make(_envs.ENV_ID, **kwargs)

    return thunk


def training_record(training: dict[str, Any]) -> dict[str, Any]:
    """A training configuration as an artifact records it: trace names relative to the
    traces folder (the artifact travels to other machines), tuples as lists."""
    return {k: ([trace_ref(x) for x in v] if k == "traces" else
                list(v) if isinstance(v, tuple) else v)
            for k, v in training.items()}


def export_actor(policy: Any, spec: DeploymentSpec, training: dict[str, Any], path: Path,
                 layout: dict[str, Any]) -> Path:
    """Export an SB3 ``ActorCriticPolicy``'s actor to the safe artifact format.

    :param policy: the SB3 policy (``model.policy``).
    :param spec: the deployment it was trained for (buckets, SLA, tick).
    :param training: the training configuration (recorded; trace paths made relative).
    :param path: the artifact folder.
    :param layout: action and observation fields (``nvec``, ``obs_size``, ``ladder``,
        ``pools``, ``feature_names``, ...) and any provenance to record.
    """
    hidden = [(layer.weight.detach().cpu().numpy(), layer.bias.detach().cpu().numpy())
              for layer in policy.mlp_extractor.policy_net if hasattr(layer, "weight")]
    head = (policy.action_net.weight.detach().cpu().numpy(),
            policy.action_net.bias.detach().cpu().numpy())
    meta = {
        "activation": "tanh",
        "obs_norm": None,
        "bucket_edges": list(spec.buckets.edges),
        "sla": {"ttft_s": spec.sla.ttft_s, "tpot_s": spec.sla.tpot_s},
        "tick_s": spec.tick_s,
        "training": training_record(training),
        "rlbatch_version": __version__,
        **layout,
    }
    return save_artifact(path, hidden, head, meta)


def export_policy(model: Any, env_unwrapped: Any, cfg: TrainConfig, path: Path,
                  extra: dict[str, Any] | None = None) -> Path:
    """Export a PPO model trained on the env (per-bucket actions, observation version 1)."""
    spec = env_unwrapped.deployment_spec
    return export_actor(model.policy, spec, asdict(cfg), path, {
        "nvec": [int(n) for n in env_unwrapped.action_space.nvec],
        "obs_size": int(env_unwrapped.observation_space.shape[0]),
        "feature_names": feature_names(spec.buckets.names),
        "ladder": list(env_unwrapped.ladder),
        "pools": list(env_unwrapped.pool_names),
        "guard": guard_record(env_unwrapped.guard.config),
        **(extra or {}),
    })


def eval_workloads(cfg: TrainConfig) -> list[tuple[str, Workload]]:
    """Fixed evaluation workloads used during training: training-trace slices from light to
    contested load at different offsets, and the guide's night and a bursty scenario."""
    out: list[tuple[str, Workload]] = []
    if cfg.traces:
        trace = load_trace(cfg.traces[0])
        for start, scale in ((300.0, 0.35), (1200.0, 0.5), (2000.0, 0.65), (600.0, 0.8)):
            span = cfg.episode_s * scale
            if start + span > trace.duration_s:  # a shorter trace: same place, proportionally
                start = max(trace.duration_s - span, 0.0) * start / 2000.0
            out.append((f"{trace.name}@{scale:g}",
                        slice_trace(trace, start, cfg.episode_s, scale)))
    out.append(("night", make_scenario("night", seed=10_000, duration_s=cfg.episode_s)))
    out.append(("bursty", make_scenario("bursty", seed=10_001, duration_s=cfg.episode_s)))
    return out


def eval_score(row: dict[str, Any], statics: list[dict[str, Any]]) -> float:
    """Goodput ratio to the best static cap of the workload (capped at 1.5 so one collapsed
    run cannot hide the others), minus 0.1 per bucket more than 5 points below that static's
    SLA attainment (no starving a bucket)."""
    best = max(statics, key=lambda r: float(r["goodput_rps"]))
    best_goodput = float(best["goodput_rps"])
    ratio = float(row["goodput_rps"]) / best_goodput if best_goodput > 0 else 1.0
    return min(ratio, 1.5) - 0.1 * len(starved_buckets(row, best))


class TickMeans:
    """Training's TensorBoard figures over a logging period: the metric table's means (every
    :data:`TB_SAMPLE_EVERY`-th tick), the reward parts' means, and each bucket's caps as a
    histogram (:func:`bucket_limits`).

    :param bucket_names: bucket names, in bucket order.
    :param pool_names: pool names, in the deployment's order.
    """

    def __init__(self, bucket_names: tuple[str, ...], pool_names: tuple[str, ...]) -> None:
        self.bucket_names = bucket_names
        self.pool_names = pool_names
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.caps: dict[str, list[float]] = defaultdict(list)
        self.count = 0

    def add(self, info: dict[str, Any]) -> None:
        """One env step's info (nothing without typed ``stats``)."""
        stats = info.get("stats")
        if not isinstance(stats, DeploymentStats):
            return
        self.count += 1
        # The whole table costs ~40 us a tick (~3% of a PPO step); a mean over every
        # TB_SAMPLE_EVERY-th tick of the 2,000 logged is as good a curve.
        if self.count % TB_SAMPLE_EVERY == 0:
            ctx = MetricContext(self.bucket_names, self.pool_names, Counter(info["overrides"]),
                                **info.get("guard_readings", {}))
            for tag, value in tensorboard_scalars(stats, ctx).items():
                if math.isfinite(value) and not tag.startswith(CAP_TAG):
                    self.sums[tag] += value
                    self.counts[tag] += 1
            for name, limit in bucket_limits(stats, self.bucket_names).items():
                self.caps[name].append(limit)
        for k, v in info["reward_parts"].items():
            self.sums[f"reward/{k}"] += float(v)
            self.counts[f"reward/{k}"] += 1

    def flush(self, logger: Any) -> None:
        """Record the period's figures in an SB3 logger and start a new period."""
        for k, v in self.sums.items():
            logger.record(k, v / self.counts[k])
        # the envs serve different workloads: a mean cap over them is a cap no workload had;
        # the distribution is what the policy chose
        for name, caps in self.caps.items():
            logger.record(f"decision/batch_cap_hist/{name}", np.asarray(caps),
                          exclude=("stdout", "log", "json", "csv"))
        self.sums.clear()
        self.counts.clear()
        self.caps.clear()
        self.count = 0


class TrainingCallbacks:
    """Builds the SB3 callback that logs the metric table's scalars (read off each tick's
    typed stats, tags from :data:`rlbatch.control.stats_metrics.METRICS`) and the reward parts,
    and evaluates periodically."""

    @staticmethod
    def build(cfg: TrainConfig, env_unwrapped: Any, out: Path) -> Any:
        from stable_baselines3.common.callbacks import BaseCallback
        from stable_baselines3.common.logger import Figure, HParam

        spec = DeploymentSpec(gpu=cfg.gpu, model=cfg.model, pools=parse_pools(cfg.pools))
        bucket_names, pool_names = spec.buckets.names, tuple(spec.pools)
        workloads = eval_workloads(cfg)
        baselines = ("static:8", "static:16", "static:32", "static:64", "playbook")

        class Callback(BaseCallback):
            def __init__(self) -> None:
                super().__init__()
                self.means = TickMeans(bucket_names, pool_names)
                self.baseline_rows: dict[str, dict[str, dict[str, Any]]] = {}
                self.best_score = -math.inf
                self.last_eval = 0
                self.history: list[dict[str, Any]] = []

            def _on_training_start(self) -> None:
                hparams = {k: (str(v) if isinstance(v, tuple) else v)
                           for k, v in asdict(cfg).items()}
                self.logger.record("hparams", HParam(hparams, {"eval/score": 0.0}),
                                   exclude=("stdout", "log", "json", "csv"))
                for name, workload in workloads:
                    self.baseline_rows[name] = {
                        b: run(workload, make_controller(b), spec, drain_s=120).row
                        for b in baselines}
                    for b, row in self.baseline_rows[name].items():
                        self._record_row(f"eval/{name}/{b}", row)

            def _record_row(self, prefix: str, row: dict[str, Any]) -> None:
                for key, value in row_figures(row).items():
                    self.logger.record(f"{prefix}/{key}", value)

            def _on_step(self) -> bool:
                for info in self.locals.get("infos", []):
                    self.means.add(info)
                if self.means.count >= 2000:
                    self.means.flush(self.logger)
                if cfg.eval_freq and self.num_timesteps - self.last_eval >= cfg.eval_freq:
                    self.last_eval = self.num_timesteps
                    self.evaluate()
                return True

            def evaluate(self) -> float:
                path = export_policy(self.model, env_unwrapped, cfg, out / "latest")
                scores = []
                rows: dict[str, dict[str, Any]] = {}
                ticks: list[DeploymentStats] = []
                for i, (name, workload) in enumerate(workloads):
                    controller = PpoController(load_artifact(path), name="ppo",
                                               order=PPO_QUEUE_ORDER)  # as served
                    row = run(workload, controller, spec, drain_s=120,
                              on_tick=ticks.append if i == len(workloads) - 1 else None).row
                    rows[name] = row
                    self._record_row(f"eval/{name}/ppo", row)
                    statics = [r for b, r in self.baseline_rows[name].items()
                               if b.startswith("static")]
                    scores.append(eval_score(row, statics))
                score = float(np.mean(scores))
                self.logger.record("eval/score", score)
                self.history.append({"timesteps": self.num_timesteps, "score": score})
                self.logger.record("figures/caps_vs_load",
                                   Figure(caps_figure(ticks, workloads[-1][0], bucket_names),
                                          close=True),
                                   exclude=("stdout", "log", "json", "csv"))
                self.logger.record("figures/throughput_latency",
                                   Figure(tradeoff_figure(self.baseline_rows, rows), close=True),
                                   exclude=("stdout", "log", "json", "csv"))
                if score > self.best_score:
                    self.best_score = score
                    export_policy(self.model, env_unwrapped, cfg, out / "best",
                                  {"eval_score": score, "timesteps": self.num_timesteps})
                self.logger.dump(self.num_timesteps)
                return score

        return Callback()


def bucket_limits(stats: DeploymentStats, bucket_names: Sequence[str]) -> dict[str, float]:
    """Each bucket's cap in force, by name; a bucket without a cap of its own: the total
    (which alone holds its requests then); neither: left out (not 0, which would read as
    "admit nothing")."""
    total = stats.action.max_num_seqs
    out = {}
    for name, cap in zip(bucket_names, stats.action.caps, strict=True):
        limit = total if cap is None else cap
        if limit is not None:
            out[name] = float(limit)
    return out


def row_limits(row: dict[str, Any]) -> dict[str, float]:
    """A run's median total and each bucket's median cap (``total_median``,
    ``batch_cap/<bucket>``), as :func:`bucket_limits` counts them; no limit: left out."""
    out = {"total_median": ticks_median(row.get("max_num_seqs_ticks", {}))}
    for name, ticks in row.get("bucket_cap_ticks", {}).items():
        out[f"batch_cap/{name}"] = ticks_median(ticks)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def row_figures(row: dict[str, Any]) -> dict[str, float]:
    """An evaluation run's figures: goodput, P99s, SLA attainment, and the run's own median
    total and caps (:func:`row_limits`: one workload's, never a mean over workloads)."""
    out = row_limits(row)
    for key in ("goodput_rps", "ttft_p99_s", "tpot_p99_s", "sla_attainment"):
        value = row[key]
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            out[key] = float(value)
    return out


def caps_figure(ticks: list[DeploymentStats], title: str,
                bucket_names: Sequence[str]) -> Any:
    """Caps per bucket over time against the arrival rate (one eval run); a bucket without a
    cap of its own is drawn at the total, one without either has a gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    if ticks:
        t = [s.time_s for s in ticks]
        for name in bucket_names:
            ax.step(t, [bucket_limits(s, bucket_names).get(name, math.nan) for s in ticks],
                    where="post", label=f"cap {name}")
        ax2 = ax.twinx()
        window = 10
        arrivals = np.convolve([sum(s.arrived) for s in ticks], np.ones(window) / window,
                               mode="same")
        ax2.plot(t, arrivals, color="grey", alpha=0.6, label="arrivals/s (10 s mean)")
        ax2.set_ylabel("arrivals per second")
        ax2.legend(loc="upper right")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("cap (requests)")
    ax.set_title(f"PPO caps vs load: {title}")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig


def tradeoff_figure(baselines: dict[str, dict[str, dict[str, Any]]],
                    ppo_rows: dict[str, dict[str, Any]]) -> Any:
    """Output tokens/s against TTFT P99 for every controller on every eval workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ppo_rows)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = dict(baselines.get(name, {}), ppo=ppo_rows[name])
        for ctrl, row in rows.items():
            y = row["ttft_p99_s"] if row["ttft_p99_s"] is not None else math.nan
            ax.scatter(row["throughput_tok_s"], y, marker="*" if ctrl == "ppo" else "o",
                       s=120 if ctrl == "ppo" else 40)
            ax.annotate(ctrl, (row["throughput_tok_s"], y), fontsize="small")
        ax.set_yscale("log")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("TTFT P99 (s, log)")
        ax.set_title(name)
    fig.tight_layout()
    return fig


@dataclass
class TrainResult:
    """Where a training run left its outputs."""

    out: Path
    final: Path
    best: Path
    history: list[dict[str, Any]]
    wall_s: float


def train(cfg: TrainConfig, *, progress_bar: bool = True) -> TrainResult:
    """Train PPO per ``cfg``; export the final and best policies; return their paths."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecMonitor

    torch.set_num_threads(1)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    kwargs = cfg.env_kwargs()
    thunks = [_make_env(kwargs) for _ in range(cfg.n_envs)]
    vec: Any = (SubprocVecEnv(thunks, start_method="fork") if cfg.vec_env == "subproc"
                and cfg.n_envs > 1 else DummyVecEnv(thunks))
    vec = VecMonitor(vec)
    vec.seed(cfg.seed)
    probe = gym.make(envs.ENV_ID, **kwargs).unwrapped
    model = PPO("MlpPolicy", vec, n_steps=cfg.n_steps, batch_size=cfg.batch_size,
                n_epochs=cfg.n_epochs, learning_rate=cfg.learning_rate, gamma=cfg.gamma,
                gae_lambda=cfg.gae_lambda, ent_coef=cfg.ent_coef, seed=cfg.seed,
                policy_kwargs={"net_arch": list(cfg.net_arch)}, device="cpu",
                tensorboard_log=str(out / "tb"), verbose=0)
    callback = TrainingCallbacks.build(cfg, probe, out)
    start = time.perf_counter()
    model.learn(cfg.timesteps, callback=callback, progress_bar=progress_bar,
                tb_log_name="ppo")
    callback.evaluate()
    wall = time.perf_counter() - start
    final = export_policy(model, probe, cfg, out / "final",
                          {"timesteps": cfg.timesteps, "train_wall_s": wall})
    vec.close()
    best = out / "best" / "policy.json"
    (out / "history.json").write_text(json.dumps(callback.history, indent=2) + "\n")
    return TrainResult(out=out, final=final, best=best, history=callback.history, wall_s=wall)


