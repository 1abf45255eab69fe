"""Simulator speed: the target figures side by side, each against a baseline commit.

    .venv/bin/python benchmarks/bench_sim.py [--baseline d08d6e7] [--repeats 3] [--no-env]
    .venv/bin/python benchmarks/bench_sim.py --controller vllm-default --rate-scale 0.5
    .venv/bin/python benchmarks/bench_sim.py --controller mpc --rate-scale 3.96 --gpu h100-80g \
        --model llama-3.1-8b --first 1500 --drain-s 60 --no-env --repeats 2

One command, one table. The baseline is another commit of this repository, unpacked read-only
(``git archive``) into a temporary folder and run in the same way, interleaved with this
tree's runs (best of ``--repeat`` each), so every ratio compares runs made minutes apart on
the same machine:

* whole process: ``python -m rlbatch simulate`` on the Azure conversation trace at rate 0.5,
  llama-3.1-8b on a100-80g, ``static:64`` (target <= 1.7 s);
* in-run: ``run()`` on the full Azure trace, ``static:16`` at rate 1 (``--controller``,
  ``--rate-scale``, ``--gpu``, ``--model`` pick another run), simulated seconds per wall
  second (target >= 10,000x real time), in a fresh process per run;
* CLI start: ``python -m rlbatch --help`` (target <= 0.3 s);
* exactness: this tree's rows and per-request records equal the baseline's for both runs
  above, and event skipping on equals off (every request field) in this tree;
* the env step (``rlbatch/BatchSize-v0``, random actions): median microseconds (target <=
  300 us; ``--no-env`` skips it).

Without git or the baseline commit, the baseline columns are left empty.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared/data/traces/azure_conv_2023.csv"
BASELINE = "d08d6e7"
"""The last commit before the simulator's speed work (event skipping, lean stats)."""

# Runs one simulation in a fresh interpreter of either tree; prints one JSON line.
_RUN = r"""
import hashlib, json, sys, time
from rlbatch.control.controllers import make_controller
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import load_trace
trace, rate, controller, gpu, model, skipping, first, drain = sys.argv[1:9]
workload = load_trace(trace, rate_scale=float(rate), max_requests=int(first) or None)
spec = DeploymentSpec(gpu=gpu, model=model, event_skipping=skipping == "1")
start = time.perf_counter()
res = run(workload, make_controller(controller), spec, rate_scale=float(rate),
          drain_s=float(drain))
wall = time.perf_counter() - start
records = sorted(r.comparable() for r in res.records)
row = {k: v for k, v in res.row.items()  # wall-clock figures differ from run to run
       if k not in ("wall_seconds", "speedup_x") and not k.startswith("mpc_decision_ms")}
print(json.dumps({"wall": wall, "sim": res.row["sim_seconds"], "row": row,
                  "records": hashlib.sha256(repr(records).encode()).hexdigest()},
                 default=str))
"""

# The env step: median and P99 microseconds per control tick, random actions.
_ENV = r"""
import json, sys, time
import gymnasium as gym
import numpy as np
import envs
env = gym.make(envs.ENV_ID, scenario="mixed")
env.action_space.seed(0)
env.reset(seed=0)
times = []
for _ in range(int(sys.argv[1])):
    action = env.action_space.sample()
    t0 = time.perf_counter()
    _, _, terminated, truncated, _ = env.step(action)
    times.append(time.perf_counter() - t0)
    if terminated or truncated:
        env.reset()
us = np.array(times) * 1e6
print(json.dumps({"median": float(np.median(us)), "p99": float(np.percentile(us, 99))}))
"""


def _python(tree: Path, args: list[str]) -> tuple[float, str]:
    """Run ``python ARGS`` with ``tree`` first on the path; (wall seconds, stdout)."""
    # the baseline is unpacked outside the checkout, where ../shared/data does not lie
    env = {"RLBATCH_TRACES_DIR": str(AZURE.parent), **os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{args[:3]} in {tree} failed:\n{done.stderr[-2000:]}")
    return wall, done.stdout


def _unpack(ref: str, into: Path) -> Path | None:
    """This repository at ``ref``, unpacked into ``into`` (read-only git); None if not
    possible."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"baseline {ref} unavailable ({exc}); its columns stay empty", file=sys.stderr)
        return None
    return into


def _best(trees: dict[str, Path], repeat: int, measure: Any) -> dict[str, Any]:
    """``measure(tree)`` ``repeat`` times per tree, interleaved; the best (lowest first
    element) result per tree."""
    best: dict[str, Any] = {}
    for _ in range(repeat):
        for name, tree in trees.items():
            result = measure(tree)
            if name not in best or result[0] < best[name][0]:
                best[name] = result
    return best


def _sim_run(trace: Path, rate: float, controller: str, gpu: str, model: str,
             first: int = 0, drain_s: float = 600.0, skipping: bool = True) -> Any:
    def measure(tree: Path) -> tuple[float, dict[str, Any]]:
        _, out = _python(tree, ["-c", _RUN, str(trace), str(rate), controller, gpu, model,
                                "1" if skipping else "0", str(first), str(drain_s)])
        data = json.loads(out.strip().splitlines()[-1])
        return data["wall"], data
    return measure


def _fmt_ratio(before: float | None, after: float, higher_is_better: bool = False) -> str:
    if before is None or after <= 0 or before <= 0:
        return ""
    return f"{(after / before) if higher_is_better else (before / after):.1f}x"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE,
                        help=f"commit to compare with (default {BASELINE}, before the speed work)")
    parser.add_argument("--trace", default=str(AZURE))
    parser.add_argument("--controller", default="static:16", help="the in-run figure's run")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--first", type=int, default=0, metavar="N",
                        help="the in-run figure's run on the trace's first N requests only")
    parser.add_argument("--drain-s", type=float, default=600.0,
                        help="the in-run figure's run: seconds it may run past the last arrival")
    parser.add_argument("--gpu", default="a100-80g")
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--repeats", type=int, default=3, help="best of N for each figure")
    parser.add_argument("--no-env", action="store_true", help="skip the env step figure")
    parser.add_argument("--env-steps", type=int, default=5000)
    return parser


def main() -> int:
    args = _parser().parse_args()
    trace = Path(args.trace)
    print(f"python {platform.python_version()}, cpus visible {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.2f}; best of {args.repeats}, baseline {args.baseline}\n")
    with tempfile.TemporaryDirectory(prefix="bench_sim_") as tmp:
        trees = {"this": ROOT}
        base = _unpack(args.baseline, Path(tmp))
        if base is not None:
            trees["base"] = base
        rows: list[tuple[str, float | None, float, str, str, bool]] = []

        # whole process: simulate, Azure rate 0.5, llama-3.1-8b on a100-80g, static:64
        cmd = ["-m", "rlbatch", "simulate", "--trace", str(trace), "--rate-scale", "0.5",
               "--model", "llama-3.1-8b", "--gpu", "a100-80g", "--controller", "static:64",
               "--quiet"]
        whole = _best(trees, args.repeats, lambda tree: _python(tree, cmd))
        rows.append(("simulate, whole process (s)", whole.get("base", (None,))[0],
                     whole["this"][0], _fmt_ratio(whole.get("base", (None,))[0],
                                                  whole["this"][0]),
                     "<= 1.7 s", whole["this"][0] <= 1.7))

        # in-run: full trace, static:16 at rate 1 (and the target run's row for exactness)
        run_of = (trace, args.rate_scale, args.controller, args.gpu, args.model, args.first,
                  args.drain_s)
        label = f"in-run, {args.controller} rate {args.rate_scale:g} (x real time)"
        inrun = _best(trees, args.repeats, _sim_run(*run_of))
        speed = {k: v[1]["sim"] / v[1]["wall"] for k, v in inrun.items()}
        rows.append((label, speed.get("base"), speed["this"],
                     _fmt_ratio(speed.get("base"), speed["this"], True), ">= 10,000x",
                     speed["this"] >= 10_000))
        target = _best(trees, 1, _sim_run(trace, 0.5, "static:64", "a100-80g", "llama-3.1-8b"))

        # CLI start
        cli = _best(trees, max(args.repeats, 5),
                    lambda tree: _python(tree, ["-m", "rlbatch", "--help"]))
        rows.append(("CLI start, rlbatch --help (s)", cli.get("base", (None,))[0],
                     cli["this"][0], _fmt_ratio(cli.get("base", (None,))[0], cli["this"][0]),
                     "<= 0.3 s", cli["this"][0] <= 0.3))

        # the env step
        if not args.no_env:
            def env_step(tree: Path) -> tuple[float, dict[str, float]]:
                _, out = _python(tree, ["-c", _ENV, str(args.env_steps)])
                data = json.loads(out.strip().splitlines()[-1])
                return data["median"], data
            envs = _best(trees, args.repeats, env_step)
            rows.append(("env step, median (us)", envs.get("base", (None,))[0],
                         envs["this"][0], _fmt_ratio(envs.get("base", (None,))[0],
                                                     envs["this"][0]),
                         "<= 300 us", envs["this"][0] <= 300))

        # exactness: skipping off in this tree, and the baseline's rows and records
        off = _sim_run(*run_of, skipping=False)(ROOT)[1]
        same_skip = off["records"] == inrun["this"][1]["records"] and \
            off["row"] == inrun["this"][1]["row"]
        # Rows compared on the baseline's fields (fields added since, e.g. fp8_token_share,
        # have nothing to compare with); per-request records in full.
        same_base = None if "base" not in trees else all(
            runs["base"][1]["records"] == runs["this"][1]["records"]
            and all(runs["this"][1]["row"].get(k) == v for k, v in runs["base"][1]["row"].items())
            for runs in (inrun, target))

    _print_table(rows, same_skip, off["wall"] / inrun["this"][1]["wall"], same_base)
    ok = same_skip and same_base is not False
    return 0 if ok else 1


def _print_table(rows: list[tuple[str, float | None, float, str, str, bool]], same_skip: bool,
                 skip_ratio: float, same_base: bool | None) -> None:
    """The figures, then the two exactness checks (event skipping; the baseline's rows)."""
    print(f"{'figure':44} {'baseline':>12} {'this tree':>12} {'ratio':>7}  {'target':11} met")
    print("-" * 95)
    for name, before, after, ratio, goal, met in rows:
        b = "" if before is None else f"{before:,.3f}" if before < 100 else f"{before:,.0f}"
        a = f"{after:,.3f}" if after < 100 else f"{after:,.0f}"
        print(f"{name:44} {b:>12} {a:>12} {ratio:>7}  {goal:11} {'yes' if met else 'NO'}")
    print(f"{'event skipping on == off (that run)':44} {'':>12} "
          f"{'identical' if same_skip else 'DIFFERENT':>12} {skip_ratio:>6.1f}x  "
          f"{'identical':11} {'yes' if same_skip else 'NO'}")
    if same_base is not None:
        print(f"{'rows and records == baseline (both runs)':44} {'':>12} "
              f"{'identical' if same_base else 'DIFFERENT':>12} {'':>7}  {'identical':11} "
              f"{'yes' if same_base else 'NO'}")


if __name__ == "__main__":
    raise SystemExit(main())
