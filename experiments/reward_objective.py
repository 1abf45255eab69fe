"""Does the reward rank a starving cap set below fair ones? Returns on fixed trace slices.

    .venv/bin/python experiments/reward_objective.py [--starts 1050 1200] [--rate-scale 0.75]

For each 600 s slice of the Azure trace (time-compressed to ``--rate-scale``) it runs the
env under fixed cap sets and the shipped policy (``policies/default``, deterministic) and
prints, per run: the episode return under the current reward, the same without the
late-queue term, the return the pre-issue-14 reward would have given (misses booked at
completion only, no end-of-episode booking, fairness over buckets with completions only),
the requests left unfinished, goodput, the worst bucket's attainment and
:func:`~rlbatch.control.reward.episode_objective`'s score.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from envs.batch_size import BatchSizeEnv
from policies.artifact import load_artifact
from rlbatch.control.reward import episode_objective
from rlbatch.control.types import SLA, ControlAction, DeploymentStats, meets_sla
from rlbatch.paths import default_training_traces
from rlbatch.workload.scenarios import slice_trace
from rlbatch.workload.traces import load_trace

CAP_SETS: tuple[tuple[int, ...], ...] = (
    (64, 1, 64, 64), (1, 64, 64, 64), (64, 64, 1, 64), (64, 64, 64, 1),
    (64, 64, 64, 64), (32, 32, 32, 32), (16, 16, 16, 16), (8, 8, 8, 8))


def legacy_reward(stats: DeploymentStats, overrides: int, norm: float, sla: SLA) -> float:
    """The reward before issue 14 (weights as shipped), for comparison."""
    met = missed = met_fp8 = 0
    for rec in stats.finished:
        if meets_sla(rec, sla):
            met += 1
            met_fp8 += rec.pool == "fp8"
        else:
            missed += 1
    missed += sum(stats.rejected)
    n_b = max(len(stats.queued), 1)
    late = sum(min(max(w / sla.ttft_s - 1.0, 0.0), 5.0) for w in stats.oldest_wait_s) / n_b
    w = stats.window
    attain = [m / c for m, c in zip(w.sla_met, w.completed, strict=True) if c > 0]
    worst = min(attain) if attain else 1.0
    norm = max(norm, 1e-6)
    return ((met - 0.5 * missed) / norm - 0.2 * late - 0.05 * stats.preemptions / norm
            - 1.0 * float(stats.kv_overflows > 0) - 0.02 * overrides / n_b
            - 0.015 * met_fp8 / norm + 0.2 * (worst - 1.0))


def run_episode(workload: Any, policy: tuple[int, ...] | str,
                artifact: Any) -> dict[str, Any]:
    """One episode of the env on ``workload`` under fixed caps or ``"ppo"``."""
    env = raw = BatchSizeEnv(scenario="night")
    obs, _ = env.reset(seed=0, options={"workload": workload})
    assert raw.deployment_info is not None
    sla = raw.deployment_info.sla
    new = legacy = late = 0.0
    while True:
        if isinstance(policy, str):
            action = artifact.act(obs)
        else:
            action = raw.encode_action(ControlAction(policy, ("fp16",) * len(policy)))
        obs, reward, terminated, truncated, info = env.step(action)
        new += float(reward)
        late += info["reward_parts"]["late_queue"]
        legacy += legacy_reward(info["stats"], len(info["overrides"]), raw._norm, sla)
        if terminated or truncated:
            break
    loop = raw._loop
    assert loop is not None
    summary = info["episode_summary"]
    obj = episode_objective(loop.records, loop.unfinished_by_bucket(), sla)
    env.close()
    return {"new": new, "no_late": new - late, "legacy": legacy,
            "unfinished": summary["unfinished"], "goodput_rps": summary["goodput_rps"],
            "worst": obj.worst_attainment, "score": obj.score, "met": obj.met}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(default_training_traces()[0]))
    parser.add_argument("--starts", type=float, nargs="+", default=[1050.0])
    parser.add_argument("--rate-scale", type=float, default=0.75)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--policy", default="policies/default")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    artifact = load_artifact(args.policy)
    print("| start | policy | return | w/o late_queue | legacy return | unfinished | goodput/s "
          "| worst att. | episode score |")
    print("|---|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for start in args.starts:
        workload = slice_trace(trace, start, args.duration_s, args.rate_scale)
        policies: list[tuple[int, ...] | str] = [*CAP_SETS, "ppo"]
        for policy in policies:
            r = run_episode(workload, policy, artifact)
            name = policy if isinstance(policy, str) else "(" + ",".join(map(str, policy)) + ")"
            print(f"| {start:.0f} | {name} | {r['new']:.1f} | {r['no_late']:.1f} | "
                  f"{r['legacy']:.1f} | {r['unfinished']} | {r['goodput_rps']:.2f} | "
                  f"{r['worst']:.2f} | {r['score']:.3f} |", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; {len(args.starts)} slices at rate "
          f"x{args.rate_scale}, {args.duration_s:.0f} s each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
