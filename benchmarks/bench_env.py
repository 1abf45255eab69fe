"""Env step cost: median and P99 microseconds per control tick, random actions.

    .venv/bin/python benchmarks/bench_env.py [--scenario mixed] [--steps 5000]
    .venv/bin/python benchmarks/bench_env.py --no-ppo --gpu h200-141g --model llama-3.1-8b \
        --scenario ../shared/data/traces/mooncake_synthetic.jsonl --kv-offload-gib 256

``--gpu``, ``--model`` and ``--kv-offload-gib`` change the env's simulated deployment (the
host KV tier engages only on traffic with prefix ids, e.g. Mooncake slices).

    .venv/bin/python benchmarks/bench_env.py --no-ppo --rule-cost

``--rule-cost`` also times, one after the other in the same run, the recipe's env without and
with the guard's ``tpot_fit`` rule (total-share actions held for 5 ticks; observation version
5 without the rule, 7 with it: the observation that states the rule's fit) and prints the
ratio.

Also times SB3's PPO overhead per step on the same machine (a rollout + update of a small
run, divided by steps) so the two figures are comparable.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np

import envs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="mixed")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--ppo-steps", type=int, default=2048)
    parser.add_argument("--gpu", default="a100-80g")
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--kv-offload-gib", type=float, default=0.0)
    parser.add_argument("--no-ppo", action="store_true", help="skip the PPO figure")
    parser.add_argument("--rule-cost", action="store_true",
                        help="also time the recipe's env without and with the tpot_fit rule")
    args = parser.parse_args()
    if args.rule_cost:
        _rule_cost(args.scenario, args.steps)
    env = gym.make(envs.ENV_ID, scenario=args.scenario, gpu=args.gpu, model=args.model)
    inner = env.unwrapped
    inner.deployment_spec = replace(inner.deployment_spec,  # type: ignore[attr-defined]
                                    kv_offload_gib=args.kv_offload_gib)
    us, resets, loaded = _step_times_us(env, args.steps)
    print(f"env step ({args.scenario}, {args.gpu}, {args.model}, host tier "
          f"{args.kv_offload_gib:g} GiB, random actions, {args.steps} steps, {resets} resets, "
          f"{loaded} blocks loaded from the host): median {np.median(us):.0f} us, mean "
          f"{us.mean():.0f} us, P99 {np.percentile(us, 99):.0f} us")
    if args.no_ppo:
        return 0

    from stable_baselines3 import PPO

    model = PPO("MlpPolicy", gym.make(envs.ENV_ID, scenario=args.scenario), n_steps=512,
                batch_size=128, seed=0, device="cpu", verbose=0)
    t0 = time.perf_counter()
    model.learn(args.ppo_steps)
    total = (time.perf_counter() - t0) / args.ppo_steps * 1e6
    print(f"PPO learn ({args.ppo_steps} steps, 1 env): {total:.0f} us per step in total, of "
          f"which about {np.median(us):.0f} us is the env")
    return 0


def _step_times_us(env: gym.Env, steps: int) -> tuple[np.ndarray, int, int]:
    """Microseconds per step of random actions, the resets, and the KV blocks loaded from the
    host tier."""
    inner = env.unwrapped
    env.action_space.seed(0)
    env.reset(seed=0)
    times = []
    resets = 0
    loaded = 0
    for _ in range(steps):
        action = env.action_space.sample()
        t0 = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        times.append(time.perf_counter() - t0)
        loaded += sum(e.kv_offload_loaded_blocks
                      for e in inner._last_stats.engines)  # type: ignore[attr-defined]
        if terminated or truncated:
            env.reset()
            resets += 1
    return np.array(times) * 1e6, resets, loaded


def _median_step_us(env: gym.Env, steps: int) -> float:
    return float(np.median(_step_times_us(env, steps)[0]))


def _rule_cost(scenario: str, steps: int) -> None:
    from rlbatch.control.guard import GuardConfig

    recipe: dict[str, Any] = {"action_kind": "total_share", "decision_ticks": 5}
    plain = _median_step_us(gym.make(envs.ENV_ID, scenario=scenario, obs_version=5, **recipe),
                            steps)
    ruled = _median_step_us(gym.make(envs.ENV_ID, scenario=scenario, obs_version=7,
                                     guard=GuardConfig(tpot_fit=True), **recipe), steps)
    print(f"recipe env step ({scenario}, 5 ticks a step, random actions, {steps} steps): "
          f"median {plain:.0f} us without the tpot_fit rule (observation 5), {ruled:.0f} us "
          f"with it (observation 7): {ruled / plain:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
