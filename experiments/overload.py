"""Overload handling measured: the rejection rules tuned on training traffic, judged on
traffic no rule was tuned on, the queued-tokens baseline, and recovery after a surge.

    .venv/bin/python experiments/overload.py tune --jobs 2
    .venv/bin/python experiments/overload.py judge --slack 1.5 --ttl 6 --jobs 2 \\
        [--gpu h100-80g --model llama-3.1-8b]
    .venv/bin/python experiments/overload.py bound --slack 1.5 --ttl 6 --jobs 2
    .venv/bin/python experiments/overload.py surge --slack 1.5 --ttl 6 --jobs 2

Every run serves ``sdk`` and ``interactive`` clients (:mod:`rlbatch.serving.clients`);
goodput counts user requests (from their first attempt's arrival). Training traffic: the
Azure training window at 0.9-1.5x the deployment's knee. Judged traffic: the protocol's
unseen runs (held-back Azure window at 0.8-0.95, Mooncake at 0.5-0.75) and the held-back
window past the knee (1.2, 1.5). The rule that picks the defaults (``tune``): the highest
geo-mean goodput over the training runs and both client profiles, among the settings whose
time to any answer p99 stays within 3x the SLA's TTFT on every run (all settings when none
does), fewer refusals breaking ties.
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies.evaluation.compare import gmean
from policies.evaluation.protocol import (
    deployment_rate_scale,
    held_back_window,
    mooncake_rate_scale_for,
    training_window,
    unseen_runs,
)
from rlbatch.control.controllers import make_controller
from rlbatch.control.types import SLA
from rlbatch.paths import traces_dir
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.tools.evaluate import EvalJob, run_jobs
from rlbatch.workload.families import FAMILIES
from rlbatch.workload.spec import resolve_workload

DEFAULT = "ppo:policies/default"
CLIENTS = ("sdk", "interactive")
SLACKS = (None, 1.0, 1.5, 2.0, 3.0)
TTLS = (None, 4.0, 6.0, 10.0)
"""The grid of the first tuning (each alone, and every pair); ``tune`` takes any other."""
TOKEN_BOUNDS = (512, 1024, 2048, 4096, 8192, 16384)
TRAIN_LOADS = (0.9, 1.0, 1.2, 1.5)
OVERLOAD_LOADS = (1.2, 1.5)

Rule = tuple[float | None, float | None, int | None]
"""``(reject_ttft_slack, queue_ttl_s, max_num_queued_tokens)``."""


def _spec(args: argparse.Namespace, clients: str, rule: Rule) -> DeploymentSpec:
    slack, ttl, tokens = rule
    return DeploymentSpec(
        gpu=args.gpu, model=args.model, clients=clients, sla=SLA(args.sla_ttft_s, 0.1),
        admission=AdmissionConfig(over_length="truncate", reject_ttft_slack=slack,
                                  queue_ttl_s=ttl, max_num_queued_tokens=tokens,
                                  max_retry_after_s=args.max_retry_after,
                                  retry_overload=not args.no_retry_overload))


def _azure() -> str:
    return str(traces_dir() / "azure_conv_2023.csv")


def _runs(args: argparse.Namespace, judged: bool) -> list[tuple[str, tuple[float, float] | None,
                                                                float]]:
    """``(trace, window, rate_scale)`` of the training or the judged runs."""
    m = deployment_rate_scale(args.gpu, args.model, {"fp16": 1})
    azure = _azure()
    if not judged:
        return [(azure, training_window(azure), load * m) for load in TRAIN_LOADS]
    out = [(rs.trace, rs.window, rate) for rs in unseen_runs(
        m, mooncake_rate_scale_for(args.gpu, args.model, {"fp16": 1})) for rate in rs.rates]
    return out + [(azure, held_back_window(azure), load * m) for load in OVERLOAD_LOADS]


def _grid(args: argparse.Namespace, rules: list[Rule], judged: bool,
          controller: str = DEFAULT) -> dict[Rule, list[dict[str, Any]]]:
    """Every rule on every run and client profile: rows per rule, in one order."""
    jobs = [EvalJob(controller, trace, rate, _spec(args, clients, rule), window, None, 0,
                    600.0)
            for rule in rules for clients in CLIENTS
            for trace, window, rate in _runs(args, judged)]
    rows = run_jobs(jobs, n_jobs=args.jobs, quiet=args.quiet, desc="overload")
    per = len(jobs) // len(rules)
    return {rule: rows[i * per:(i + 1) * per] for i, rule in enumerate(rules)}


def _name(rule: Rule) -> str:
    slack, ttl, tokens = rule
    parts = [f"slack {slack:g}" if slack is not None else "",
             f"TTL {ttl:g} s" if ttl is not None else "",
             f"queued tokens {tokens}" if tokens is not None else ""]
    return ", ".join(p for p in parts if p) or "none"


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]] | None,
             sla_ttft_s: float) -> dict[str, float]:
    out = {"goodput": gmean([r["goodput_rps"] for r in rows]),
           "answer_p99_worst_s": max(r["any_answer_p99_s"] for r in rows),
           "answer_ok": float(all(r["any_answer_p99_s"] <= 3 * sla_ttft_s for r in rows)),
           "rejected": float(sum(r["rejected"] for r in rows)),
           "wasted_share_worst": max(r["wasted_token_share"] for r in rows),
           "kv_overflows": float(sum(r["kv_overflows"] for r in rows))}
    for clients in CLIENTS:
        mine = [r for r in rows if r["clients"] == clients]
        out[f"goodput_{clients}"] = gmean([r["goodput_rps"] for r in mine])
        if base is not None:
            theirs = [r for r in base if r["clients"] == clients]
            # a run where neither serves anything within the SLA has no ratio
            out[f"vs_none_{clients}"] = gmean([a["goodput_rps"] / b["goodput_rps"]
                                               for a, b in zip(mine, theirs, strict=True)
                                               if a["goodput_rps"] > 0 and b["goodput_rps"] > 0])
    return out


def tune(args: argparse.Namespace) -> None:
    rules: list[Rule] = [(None, None, None), *((s, t, None) for s in args.slacks
                                                for t in args.ttls)]
    grid = _grid(args, rules, judged=False)
    base = grid[(None, None, None)]
    scored = {rule: _summary(rows, base, args.sla_ttft_s) for rule, rows in grid.items()}
    ok = [r for r in rules if scored[r]["answer_ok"]] or rules
    best = max(ok, key=lambda r: (round(scored[r]["goodput"], 3), -scored[r]["rejected"]))
    print("| rule | goodput/s (geo) | vs none, sdk | vs none, interactive | any answer p99 "
          "(worst) | refused | wasted (worst) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rule in sorted(rules, key=lambda r: -scored[r]["goodput"]):
        s = scored[rule]
        print(f"| {_name(rule)}{' **(picked)**' if rule == best else ''} | "
              f"{s['goodput']:.3f} | {s['vs_none_sdk']:.3f}x | {s['vs_none_interactive']:.3f}x"
              f" | {s['answer_p99_worst_s']:.1f} s | {s['rejected']:.0f} | "
              f"{s['wasted_share_worst']:.2%} |")
    print(f"\npicked: {_name(best)}")


def judge(args: argparse.Namespace) -> None:
    rule: Rule = (args.slack, args.ttl, None)
    grid = _grid(args, [(None, None, None), rule], judged=True)
    base, mine = grid[(None, None, None)], grid[rule]
    print(f"{args.gpu} / {args.model}, {DEFAULT}, SLA {args.sla_ttft_s:g} s / 100 ms: "
          f"{_name(rule)} against none")
    print("| run | load | clients | goodput/s none | with rule | ratio | any answer p99 none"
          " / with | wasted none / with | refused (arrival / TTL) | KV overflows |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for a, b in zip(base, mine, strict=True):
        ratio = (f"{b['goodput_rps'] / a['goodput_rps']:.3f}x" if a["goodput_rps"] > 0
                 else "-")
        print(f"| {Path(b['trace']).stem} | {b['rate_scale']:g} | {b['clients']} | "
              f"{a['goodput_rps']:.3f} | {b['goodput_rps']:.3f} | "
              f"{ratio} | {a['any_answer_p99_s']:.1f} / "
              f"{b['any_answer_p99_s']:.1f} s | {a['wasted_token_share']:.2%} / "
              f"{b['wasted_token_share']:.2%} | {b['rejected_at_arrival']} / "
              f"{b['rejected_by_ttl']} | {b['kv_overflows']} |")
    s = _summary(mine, base, args.sla_ttft_s)
    print(f"\ngeo-mean vs none: sdk {s['vs_none_sdk']:.3f}x (must >= 1.0), interactive "
          f"{s['vs_none_interactive']:.3f}x (must >= 1.1); any answer p99 worst "
          f"{s['answer_p99_worst_s']:.1f} s (must <= {3 * args.sla_ttft_s:g}); wasted worst "
          f"{s['wasted_share_worst']:.2%} (must <= 2%); KV overflows {s['kv_overflows']:.0f}")


def bound(args: argparse.Namespace) -> None:
    """The queued-tokens bound tuned on training traffic against the predicted-TTFT rule,
    both with the same TTL, on the judged runs."""
    ttl = args.ttl
    rules: list[Rule] = [(None, ttl, t) for t in TOKEN_BOUNDS]
    train = _grid(args, rules, judged=False)
    best = max(rules, key=lambda r: gmean([x["goodput_rps"] for x in train[r]]))
    print(f"queued-tokens bound picked on training traffic: {best[2]} "
          + ", ".join(f"{r[2]}: {gmean([x['goodput_rps'] for x in train[r]]):.3f}"
                      for r in rules))
    mine: Rule = (args.slack, ttl, None)
    judged = _grid(args, [best, mine], judged=True)
    for rule in (best, mine):
        rows = judged[rule]
        print(f"| {_name(rule)} | goodput/s (geo) {gmean([r['goodput_rps'] for r in rows]):.3f}"
              f" | refused {sum(r['rejected'] for r in rows)} | any answer p99 worst "
              f"{max(r['any_answer_p99_s'] for r in rows):.1f} s |")


def _surge_run(task: tuple[str, str, Rule, argparse.Namespace, int]) -> dict[str, Any]:
    controller, clients, rule, args, seed = task
    chat = FAMILIES["chat"]
    rate = 0.8 * chat.reference_rps
    workload = resolve_workload(
        f"surge:rate={rate:g},duration={args.surge_duration_s:g},mix=chat,"
        f"factor=3.75,start={args.surge_start_s:g},length=60", seed=seed)
    result = run(workload, make_controller(controller), _spec(args, clients, rule),
                 outcomes=True)
    assert result.outcomes is not None
    return {"controller": controller, "rule": _name(rule), "seed": seed,
            **recovery(result.outcomes, args.surge_start_s, args.surge_start_s + 60.0),
            "goodput_rps": result.row["goodput_rps"],
            "any_answer_p99_s": result.row["any_answer_p99_s"]}


def recovery(outcomes: list[tuple[float, bool]], start_s: float, end_s: float
             ) -> dict[str, Any]:
    """Attainment per 10-s window of arrivals, and the recovery time: from the end of the
    surge until the attainment of the 30 s of arrivals before a moment is back within 5
    points of the 30 s before the surge (``inf``: never, within the run). The window slides
    past the surge's own arrivals, so a controller that serves everything arriving after the
    surge and nothing of the surge recovers in 30 s.

    :param outcomes: ``(arrival_s, met)`` of every request.
    :param start_s: the surge's start.
    :param end_s: its end.
    """
    def attainment(lo: float, hi: float) -> float:
        inside = [met for t, met in outcomes if lo <= t < hi]
        return sum(inside) / len(inside) if inside else math.nan

    last = max((t for t, _ in outcomes), default=0.0)
    before = attainment(start_s - 30.0, start_s)
    windows = [round(attainment(t, t + 10.0), 3) for t in range(0, int(last), 10)]
    back = math.inf
    t = end_s
    while t <= last:
        if attainment(t - 30.0, t) >= before - 0.05:
            back = t - end_s
            break
        t += 1.0
    return {"before": before, "windows": windows, "recovery_s": back}


def surge(args: argparse.Namespace) -> None:
    rule: Rule = (args.slack, args.ttl, None)
    none: Rule = (None, None, None)
    cases = [(DEFAULT, rule), (DEFAULT, none), ("fixed:256[order=deadline]", none),
             ("static:64", none), ("static:256", none)]
    tasks = [(c, "sdk", r, args, seed) for c, r in cases for seed in (0, 1)]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(_surge_run, tasks))
    print("| controller | rule | seed | attainment before | recovery | goodput/s | any answer "
          "p99 | attainment per 10 s from 30 s before the surge |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    first = int(args.surge_start_s // 10) - 3
    for r in rows:
        print(f"| {r['controller']} | {r['rule']} | {r['seed']} | {r['before']:.2f} | "
              f"{r['recovery_s']:g} s | {r['goodput_rps']:.3f} | {r['any_answer_p99_s']:.1f} s"
              f" | {' '.join(f'{w:.2f}' for w in r['windows'][first:first + 24])} |")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("tune", "judge", "bound", "surge"))
    p.add_argument("--slack", type=float, default=None, help="reject_ttft_slack judged")
    p.add_argument("--ttl", type=float, default=None, help="queue_ttl_s judged")
    p.add_argument("--max-retry-after", type=float, default=None,
                   help="max_retry_after_s of every rule")
    p.add_argument("--no-retry-overload", action="store_true",
                   help="overload refusals tell clients not to retry")
    p.add_argument("--slacks", type=_floats, default=SLACKS[1:], help="tune's slacks")
    p.add_argument("--ttls", type=_floats, default=TTLS[1:], help="tune's TTLs (s)")
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--sla-ttft-s", type=float, default=2.0)
    p.add_argument("--surge-start-s", type=float, default=300.0)
    p.add_argument("--surge-duration-s", type=float, default=900.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    {"tune": tune, "judge": judge, "bound": bound, "surge": surge}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

