"""The host KV tier (issue 12, item 3): where it helps, what it costs.

    .venv/bin/python benchmarks/bench_host_tier.py
    .venv/bin/python benchmarks/bench_host_tier.py --runs "h200-141g:0.3" --gib 0,256 \
        --controllers static:64,fixed:256 --json host.json

Runs Mooncake (whose requests carry prefix hash ids) on each GPU at each rate with each host
tier size (``--kv-offload-gib``; 0 = off) and prints one markdown table: the prefix hit rate
of the GPU cache and of the host tier (tokens, share of the prompt tokens looked up), TTFT
P50/P99 of the *returning* requests (at least one hash id seen in an earlier request: a
conversation coming back) and of all, goodput and SLA attainment, and the cost: host memory,
bytes over the host link each way (stores also as a mean rate over the run), the mean wait
of a request for its copy, the host tier's peak occupancy, and the run's wall time (the
best of ``--repeat`` runs; simulated seconds per wall second on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from rlbatch.control.controllers import make_controller
from rlbatch.paths import traces_dir
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import load_trace

GB = 1e9


def _returning(requests: list[Any]) -> set[int]:
    """Ids of the requests with a hash id some earlier request had (arrival order)."""
    seen: set[int] = set()
    out: set[int] = set()
    for r in requests:
        ids = r.prefix_ids or ()
        if any(i in seen for i in ids):
            out.add(r.request_id)
        seen.update(ids)
    return out


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def measure(trace: Path, gpu: str, model: str, rate: float, gib: float,
            controller: str, repeat: int = 1) -> dict[str, Any]:
    """One run and the table's figures (the wall time the best of ``repeat`` runs).

    :param trace: the Mooncake trace.
    :param gpu: GPU profile.
    :param model: model profile.
    :param rate: rate scale.
    :param gib: host tier, GiB (0: off).
    :param controller: controller name.
    :param repeat: runs (the same result each time) to take the fastest wall time of.
    """
    workload = load_trace(trace, rate_scale=rate)
    back = _returning(workload.requests)
    spec = DeploymentSpec(gpu=gpu, model=model, kv_offload_gib=gib)
    res = run(workload, make_controller(controller), spec, rate_scale=rate)
    wall = min([res.row["wall_seconds"]] + [
        run(workload, make_controller(controller), spec).row["wall_seconds"]
        for _ in range(repeat - 1)])
    row = res.row
    done = [r for r in res.records if not r.rejected]
    ttft_back = [r.ttft_s for r in done if r.request_id in back]
    ttft_all = [r.ttft_s for r in done]
    loads = row["kv_offload_loads"]
    return {
        "gpu": gpu, "model": model, "rate": rate, "gib": gib, "controller": controller,
        "returning": len(back), "requests": len(workload.requests),
        "gpu_hit": row["prefix_hit_rate"], "host_hit": row["kv_offload_hit_rate"],
        "ttft_back_p50": _p(ttft_back, 50), "ttft_back_p99": _p(ttft_back, 99),
        "ttft_p50": _p(ttft_all, 50), "ttft_p99": _p(ttft_all, 99),
        "goodput": row["goodput_rps"], "sla": row["sla_attainment"],
        "prefill_tokens": row["prefill_tokens"], "preemptions": row["preemptions"],
        "load_gb": row["kv_offload_load_bytes"] / GB,
        "store_gb": row["kv_offload_store_bytes"] / GB,
        "wait_ms": 1e3 * row["kv_offload_load_s"] / loads if loads else math.nan,
        "loads": loads, "host_evictions": row["kv_offload_evictions"],
        "host_peak": row["kv_offload_usage_peak"], "wall_s": wall,
        "sim_s": row["sim_seconds"],
    }


def _f(value: float, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, fmt)


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure` results, prefill relative to no host tier."""
    base = {(r["gpu"], r["rate"], r["controller"]): r for r in results if r["gib"] == 0}
    head = ("| GPU | rate | controller | host GiB | GPU hit% | host hit% | returning TTFT "
            "p50 / p99 s | all TTFT p50 / p99 s | goodput/s | SLA% | prefill vs off | "
            "loaded GB | stored GB (GB/s) | wait/load ms | host peak% | wall s |")
    lines = [head, "|---|---:|---|" + "---:|" * 13]
    for r in results:
        off = base.get((r["gpu"], r["rate"], r["controller"]))
        prefill = r["prefill_tokens"] / off["prefill_tokens"] if off else math.nan
        lines.append(
            f"| {r['gpu']} | {r['rate']:g} | {r['controller']} | {r['gib']:g} | "
            f"{100 * r['gpu_hit']:.1f} | {100 * r['host_hit']:.1f} | "
            f"{_f(r['ttft_back_p50'], '.2f')} / {_f(r['ttft_back_p99'], '.1f')} | "
            f"{_f(r['ttft_p50'], '.2f')} / {_f(r['ttft_p99'], '.1f')} | "
            f"{r['goodput']:.2f} | {100 * r['sla']:.1f} | {_f(prefill, '.3f')} | "
            f"{r['load_gb']:.0f} | {r['store_gb']:.0f} ({r['store_gb'] / r['sim_s']:.2f}) | "
            f"{_f(r['wait_ms'], '.1f')} | "
            f"{100 * r['host_peak']:.0f} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(traces_dir() / "mooncake_synthetic.jsonl"))
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--runs", default="a100-80g:0.05,0.1;h200-141g:0.2,0.3,0.4",
                        help="GPU:rate,rate;GPU:rate,... (default: %(default)s)")
    parser.add_argument("--gib", default="0,64,256,1024",
                        help="host tier sizes, GiB, 0 = off (default: %(default)s)")
    parser.add_argument("--controllers", default="static:64")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per cell; the wall time is the best (default 1)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results = []
    for part in args.runs.split(";"):
        gpu, _, rates = part.partition(":")
        for rate in (float(x) for x in rates.split(",")):
            for controller in args.controllers.split(","):
                for gib in (float(x) for x in args.gib.split(",")):
                    r = measure(Path(args.trace), gpu, args.model, rate, gib, controller,
                                args.repeats)
                    results.append(r)
                    print(f"{gpu} {rate:g} {controller} {gib:g} GiB: goodput "
                          f"{r['goodput']:.2f}, host hit {100 * r['host_hit']:.1f}%, "
                          f"{r['wall_s']:.2f} s, {r['sim_s'] / r['wall_s']:,.0f}x real time",
                          file=sys.stderr)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
