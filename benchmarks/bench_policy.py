"""Policy artifact: load time and per-decision latency (numpy forward pass, no SB3/torch).

    .venv/bin/python benchmarks/bench_policy.py [--policy policies/default]

"decision" = the artifact's forward pass + argmax on one observation; "controller tick" adds
building the observation and the guard, i.e. everything the sidecar does per control tick.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from policies.artifact import load_artifact
from policies.ppo import PpoController
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.loop import ControlLoop
from rlbatch.workload.scenarios import make_scenario


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="policies/default")
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    loads = []
    for _ in range(20):
        t0 = time.perf_counter()
        artifact = load_artifact(args.policy)
        loads.append(time.perf_counter() - t0)
    print(f"load: median {np.median(loads) * 1e3:.2f} ms (20 loads)")
    rng = np.random.default_rng(0)
    obs = rng.uniform(0, 2, size=(args.n, artifact.obs_size)).astype(np.float32)
    times = np.empty(args.n)
    for i in range(args.n):
        t0 = time.perf_counter()
        artifact.act(obs[i])
        times[i] = time.perf_counter() - t0
    print(f"decision: median {np.median(times) * 1e3:.3f} ms, P99 "
          f"{np.percentile(times, 99) * 1e3:.3f} ms ({args.n} decisions)")

    controller = PpoController(artifact)
    deployment = build_deployment(DeploymentSpec())
    loop = ControlLoop(deployment, make_scenario("night", seed=0, duration_s=600).requests,
                       controller.reset(deployment.info), discipline=controller.discipline)
    ticks = []
    while not loop.finished:
        stats = loop.tick()
        t0 = time.perf_counter()
        action = controller.decide(stats)
        ticks.append(time.perf_counter() - t0)
        loop.apply(action)
    t = np.array(ticks)
    print(f"controller tick (observation + policy + guard): median {np.median(t) * 1e3:.3f} "
          f"ms, P99 {np.percentile(t, 99) * 1e3:.3f} ms ({len(t)} ticks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
