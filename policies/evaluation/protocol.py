"""The evaluation protocol: which traffic a policy may learn from, which it is judged on.

Every training trace is split in time: the first ``1 - HOLDOUT_FRACTION`` (75%) is training
traffic (episodes, teacher data, checkpoint selection); the last 25% is held back. The other
shipped trace family (Mooncake, long-context) is never used for training or selection.
A policy is judged on the held-back windows and the other family, at rate scales around
their knees, against the static caps 4 to 256, the playbook and any other controller, per
run and per bucket; the regime of each run (light / contested / collapsed) comes from the
hindsight-best static (:mod:`policies.evaluation.compare`).

    python -m policies.evaluation.protocol --controllers ppo:policies/default,mpc \\
        --json rows.json --markdown EVAL-unseen.md
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from policies.evaluation.compare import CONTESTED, compare, gmean, starved_shortfalls
from rlbatch.commands.options import (
    CONTROLLER_HELP,
    add_deployment_options,
    add_settings_option,
    controllers_from_args,
    deployment_spec_from_args,
)
from rlbatch.paths import traces_dir
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.evaluate import EvalJob, load_job_workload, run_jobs
from rlbatch.tools.report import write_json
from rlbatch.workload import Workload, load_trace

HOLDOUT_FRACTION = 0.25
STATICS: tuple[str, ...] = tuple(f"static:{n}" for n in (4, 8, 16, 32, 64, 128, 256))
BASELINE = "playbook"
MIN_RUN_RATIO = 0.95


@cache
def trace_duration_s(path: str) -> float:
    """Span of a trace file in its own time (seconds)."""
    return load_trace(path).duration_s


def training_window(path: str | Path) -> tuple[float, float]:
    """The part of a training trace that training and selection may use."""
    return 0.0, trace_duration_s(str(path)) * (1.0 - HOLDOUT_FRACTION)


def held_back_window(path: str | Path) -> tuple[float, float]:
    """The later part of a training trace that only evaluation sees."""
    duration = trace_duration_s(str(path))
    return duration * (1.0 - HOLDOUT_FRACTION), duration + 1.0


@dataclass(frozen=True)
class RunSet:
    """Runs of one trace at several rate scales.

    :param name: label in reports.
    :param trace: trace file.
    :param window: ``(start, end)`` seconds of the trace, ``None``: all of it.
    :param rates: rate scales (around the knee of this traffic).
    :param unseen: never used for training or selection.
    """

    name: str
    trace: str
    window: tuple[float, float] | None
    rates: tuple[float, ...]
    unseen: bool


def _scaled(rates: tuple[float, ...], multiplier: float) -> tuple[float, ...]:
    if not multiplier > 0:
        raise ValueError(f"rate multiplier must be > 0, got {multiplier}")
    return tuple(round(r * multiplier, 6) for r in rates)


def unseen_runs(rate_scale: float = 1.0,
                mooncake_rate_scale: float | None = None) -> list[RunSet]:
    """The traffic a shipped policy is judged on: the held-back later window of the Azure
    training trace and the Mooncake family, at rate scales that put the best static cap at
    20-95% SLA attainment on one A100 serving llama-2-7b (measured: BENCHMARKS.md,
    "Evaluation protocol").

    :param rate_scale: multiplies every rate scale, for deployments with more capacity
        (e.g. 2.5 for one FP16 and one FP8 engine, :data:`DEPLOYMENT_RATE_SCALES`).
    :param mooncake_rate_scale: multiplies the Mooncake rate scales instead (``None``: the
        same as ``rate_scale``). A long-context model serves Mooncake's 10-100k-token
        prompts whole, where a 4k-context one truncates them, so its knee on Mooncake is not
        where its knee on Azure is (:data:`MOONCAKE_RATE_SCALES`).
    """
    azure = str(traces_dir() / "azure_conv_2023.csv")
    mooncake = str(traces_dir() / "mooncake_synthetic.jsonl")
    m = rate_scale
    mm = rate_scale if mooncake_rate_scale is None else mooncake_rate_scale
    return [RunSet("azure held-back", azure, held_back_window(azure),
                   _scaled((0.8, 0.85, 0.9, 0.95), m), True),
            RunSet("mooncake", mooncake, None, _scaled((0.5, 0.6, 0.75), mm), True)]


def training_runs(rate_scale: float = 1.0) -> list[RunSet]:
    """The training traffic the user's static pick is made on.

    :param rate_scale: as in :func:`unseen_runs`.
    """
    azure = str(traces_dir() / "azure_conv_2023.csv")
    return [RunSet("azure training", azure, training_window(azure),
                   _scaled((0.5, 0.75, 0.9, 1.0), rate_scale), False)]


DEPLOYMENT_RATE_SCALES: dict[tuple[str, str, str], float] = {
    ("a100-80g", "llama-2-7b", "fp16:1"): 1.0,
    ("a100-80g", "llama-2-7b", "fp16:1,fp8:1"): 2.5,
    ("h100-80g", "llama-2-7b", "fp16:1"): 2.0,
    ("a100-80g", "llama-3.1-8b", "fp16:1"): 1.6,
    ("h100-80g", "llama-3.1-8b", "fp16:1"): 4.4,
    ("h200-141g", "llama-3.1-8b", "fp16:1"): 5.0,
    ("h200-141g", "llama-3.1-70b", "fp16:1"): 2.0,
}
"""Measured rate multipliers (GPU, model, pools; the model's default tensor parallelism) that
put the Azure runs of the protocol around the knee (docs/notebook/BENCHMARKS-archive.md, its
long-context section for the long-context ones): e.g. one FP16 engine and one FP8-KV engine
serve about 2.5x the load of one FP16 engine within the SLA."""


MOONCAKE_RATE_SCALES: dict[tuple[str, str, str], float] = {
    ("h100-80g", "llama-3.1-8b", "fp16:1"): 0.3,
    ("h200-141g", "llama-3.1-8b", "fp16:1"): 0.4,
    ("h200-141g", "llama-3.1-70b", "fp16:1"): 0.18,
}
"""Measured Mooncake rate multipliers of the long-context deployments (GPU, model, pools),
where Mooncake's prompts are served whole (docs/notebook/BENCHMARKS-archive.md); a deployment
not listed uses its :data:`DEPLOYMENT_RATE_SCALES` entry for Mooncake too."""


def _deployment_key(gpu: str, model: str, pools: dict[str, int]) -> tuple[str, str, str]:
    """The key of the multiplier tables: GPU, model and pools spelled as ``--pools``."""
    return gpu, model, ",".join(f"{p}:{n}" for p, n in pools.items())


def mooncake_rate_scale_for(gpu: str, model: str, pools: dict[str, int]) -> float | None:
    """:data:`MOONCAKE_RATE_SCALES` for a deployment (``None`` when not measured).

    :param gpu: GPU profile name.
    :param model: model profile name.
    :param pools: engines per pool.
    """
    return MOONCAKE_RATE_SCALES.get(_deployment_key(gpu, model, pools))


def deployment_rate_scale(gpu: str, model: str, pools: dict[str, int]) -> float:
    """:data:`DEPLOYMENT_RATE_SCALES` for a deployment (1 when not measured).

    :param gpu: GPU profile name.
    :param model: model profile name.
    :param pools: engines per pool.
    """
    return DEPLOYMENT_RATE_SCALES.get(_deployment_key(gpu, model, pools), 1.0)


def run_label(run: RunSet) -> str:
    return run.name.replace(" ", "-")


def unseen_run(label_prefix: str, gpu: str, model: str, pools: dict[str, int]) -> RunSet:
    """The first unseen run of the deployment whose label starts with ``label_prefix``.

    :raises ValueError: none does (the message lists the labels).
    """
    runs = unseen_runs(deployment_rate_scale(gpu, model, pools))
    for run_set in runs:
        if run_label(run_set).startswith(label_prefix):
            return run_set
    raise ValueError(f"no protocol run starts with {label_prefix!r}: "
                     f"{', '.join(run_label(r) for r in runs)}")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """``--run``, ``--rate-scale`` and the deployment options of a script that studies one unseen
    run (read back with :func:`run_from_args`)."""
    p.add_argument("--run", required=True,
                   help="start of the protocol run's label (e.g. azure, mooncake)")
    p.add_argument("--rate-scale", type=float, required=True,
                   help="one of the run's rate scales")
    add_deployment_options(p)
    p.set_defaults(over_length="truncate")


def run_from_args(p: argparse.ArgumentParser, args: argparse.Namespace
                  ) -> tuple[DeploymentSpec, RunSet, Workload]:
    """The deployment, the unseen run and its workload at ``--rate-scale`` that
    :func:`add_run_options` asked for (a run that does not exist: ``p.error``)."""
    spec = deployment_spec_from_args(args)
    try:
        run_set = unseen_run(args.run, spec.gpu, spec.model, spec.pools)
    except ValueError as e:
        p.error(str(e))
    job = EvalJob(args.run, run_set.trace, args.rate_scale, spec, run_set.window, None, 0, 600.0,
                  None)
    return spec, run_set, load_job_workload(job)


def protocol_jobs(candidates: Sequence[str], spec: DeploymentSpec,
                  run_sets: Sequence[RunSet], *, drain_s: float = 600.0,
                  max_tokens: int | None = None) -> list[EvalJob]:
    """Statics 4-256, the playbook and every candidate on every run."""
    controllers = [*STATICS, BASELINE, *(c for c in candidates if c not in STATICS)]
    return [EvalJob(c, rs.trace, rate, replace(spec), rs.window, None, 0, drain_s, max_tokens)
            for rs in run_sets for rate in rs.rates for c in controllers]


def label_rows(rows: list[dict[str, Any]], jobs: Sequence[EvalJob],
               run_sets: Sequence[RunSet]) -> list[dict[str, Any]]:
    """Name each row's trace after its run set (so windows of one file stay apart)."""
    by_key = {(rs.trace, rs.window): run_label(rs) for rs in run_sets}
    for row, job in zip(rows, jobs, strict=True):
        row["trace"] = by_key[(job.trace, job.window)]
    return rows


def user_pick(training_rows: Sequence[dict[str, Any]]) -> str:
    """The static a user would configure: best mean goodput over the non-collapsed
    training runs (a run is collapsed when its best static meets the SLA for < 20%)."""
    by_run: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in training_rows:
        if row["controller"] in STATICS:
            by_run.setdefault((row["trace"], float(row["rate_scale"])), []).append(row)
    kept = [rows for rows in by_run.values()
            if max(float(r["sla_attainment"] or 0.0) for r in rows) >= CONTESTED[0]]
    if not kept:
        raise ValueError("every training run collapsed: no basis for a user's pick")
    means = {s: sum(float(r["goodput_rps"] or 0.0) for rows in kept for r in rows
                    if r["controller"] == s) / len(kept) for s in STATICS}
    return max(means, key=lambda s: (means[s], -int(s.split(":")[1])))


def judge(rows: Sequence[dict[str, Any]], candidate: str, pick: str) -> dict[str, Any]:
    """Verdicts of one candidate on the unseen runs and the issue's must-checks."""
    verdicts = compare(rows, candidate, pick, BASELINE)
    contested = [v for v in verdicts if v["contested"]]

    def over(key: str) -> float:
        return gmean([v[key] for v in contested])

    summary = {
        "contested_runs": len(contested),
        "vs_best_static_gmean": over("vs_best_static"),
        "vs_best_static_min": min((v["vs_best_static"] for v in contested), default=math.nan),
        "vs_user_pick_gmean": over("vs_user_pick"),
        "vs_playbook_gmean": over("vs_baseline"),
        "kv_overflows": sum(v["kv_overflows"] for v in verdicts),
        "runs_with_starved_bucket": sum(1 for v in contested if v["starved"]),
    }
    summary["must_met"] = bool(
        contested and summary["vs_best_static_gmean"] >= 1.0
        and summary["vs_best_static_min"] >= MIN_RUN_RATIO
        and summary["vs_playbook_gmean"] >= 1.15 and summary["kv_overflows"] == 0
        and summary["runs_with_starved_bucket"] == 0)
    return {"verdicts": verdicts, "summary": summary}


def _bucket_cells(row: dict[str, Any]) -> list[str]:
    cells = []
    for b in row["per_bucket"].values():
        value = b.get("sla_attainment")
        ok = value is not None and not (isinstance(value, float) and math.isnan(value))
        cells.append(f"{100 * value:.0f}" if ok else "-")
    return cells


def render(rows: Sequence[dict[str, Any]], candidates: Sequence[str], pick: str) -> str:
    """Markdown: per candidate, one line per unseen run with the per-bucket SLA attainment
    of the candidate and of the best static, the regime, and the summary checks."""
    index = {(r["trace"], float(r["rate_scale"]), r["controller"]): r for r in rows}
    buckets = list(next(iter(rows))["per_bucket"]) if rows else []
    parts = [f"User's pick (best mean goodput over the non-collapsed training runs): {pick}.",
             "Starved: a bucket whose SLA attainment is more than 5 points under the best "
             "static's, with the gap in requests (N of the bucket's decided requests).", ""]
    for cand in candidates:
        result = judge(rows, cand, pick)
        parts += [f"### {cand}", "",
                  "| run | rate | regime | best static (SLA%) | goodput/s | vs best static | "
                  f"vs {pick} | vs playbook | SLA% per bucket ({', '.join(buckets)}) | "
                  "best static per bucket | starved | KV overflows |",
                  "|---|---:|---|---|---:|---:|---:|---:|---|---|---|---:|"]
        for v in result["verdicts"]:
            regime = "contested" if v["contested"] else "light" if v["light"] else "collapsed"
            mine = index[(v["trace"], v["rate_scale"], cand)]
            best = index[(v["trace"], v["rate_scale"], v["best_static"])]
            parts.append(
                f"| {v['trace']} | {v['rate_scale']:g} | {regime} | {v['best_static']} "
                f"({100 * v['best_static_sla']:.0f}) | {v['goodput_rps']:.2f} | "
                f"{v['vs_best_static']:.2f}x | {v['vs_user_pick']:.2f}x | "
                f"{v['vs_baseline']:.2f}x | {' / '.join(_bucket_cells(mine))} | "
                f"{' / '.join(_bucket_cells(best))} | "
                f"{', '.join(starved_shortfalls(mine, best)) or '-'} | {v['kv_overflows']} |")
        s = result["summary"]
        parts += ["", f"Contested runs: {s['contested_runs']}; goodput vs best static: "
                  f"geo-mean {s['vs_best_static_gmean']:.2f}x, worst run "
                  f"{s['vs_best_static_min']:.2f}x; vs {pick}: {s['vs_user_pick_gmean']:.2f}x; "
                  f"vs playbook: {s['vs_playbook_gmean']:.2f}x; KV overflows: "
                  f"{s['kv_overflows']}; runs with a starved bucket: "
                  f"{s['runs_with_starved_bucket']}. Must-checks "
                  f"{'met' if s['must_met'] else 'NOT met'}.", ""]
    return "\n".join(parts)


def evaluate_protocol(candidates: Sequence[str], spec: DeploymentSpec, *, n_jobs: int = 2,
                      quiet: bool = False, max_tokens: int | None = None,
                      rate_scale: float = 1.0, mooncake_rate_scale: float | None = None
                      ) -> tuple[list[dict[str, Any]], str, str]:
    """Run the training runs (for the user's pick) and the unseen runs; return the unseen
    rows, the user's pick and the Markdown report.

    :param max_tokens: the clients' declared output limit (``None``: none declared).
    :param rate_scale: multiplies every run's rate scale (:func:`unseen_runs`).
    :param mooncake_rate_scale: multiplies the Mooncake runs' instead (``None``: the same).
    """
    train_sets = training_runs(rate_scale)
    unseen_sets = unseen_runs(rate_scale, mooncake_rate_scale)
    train_jobs = protocol_jobs([], spec, train_sets, max_tokens=max_tokens)
    unseen_jobs = protocol_jobs(candidates, spec, unseen_sets, max_tokens=max_tokens)
    rows = run_jobs([*train_jobs, *unseen_jobs], n_jobs=n_jobs, quiet=quiet, desc="protocol")
    train_rows = label_rows(rows[:len(train_jobs)], train_jobs, train_sets)
    unseen_rows = label_rows(rows[len(train_jobs):], unseen_jobs, unseen_sets)
    pick = user_pick(train_rows)
    return unseen_rows, pick, render(unseen_rows, candidates, pick)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m policies.evaluation.protocol",
        description="Judge controllers on traffic no policy trained on (held-back Azure "
        "window, Mooncake) against static caps 4-256 and the playbook, per run and bucket.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--controllers", required=True,
                   help=f"comma-separated candidates, e.g. ppo:policies/default,mpc, each "
                        f"{CONTROLLER_HELP}")
    add_settings_option(p)
    p.add_argument("--json", type=Path, help="write the unseen rows here")
    p.add_argument("--markdown", type=Path, help="write the report here")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="clients declare max_tokens=N (or the real output, if longer): the "
                        "ceiling of the guard's KV count (--kv-reserve); default: none declared")
    p.add_argument("--rate-scale", type=float, default=None, metavar="X",
                   help="multiply every run's rate scale by X (a deployment with more "
                        "capacity than one A100 serving llama-2-7b needs more load to be "
                        "contested); default: the measured one for the deployment "
                        "(DEPLOYMENT_RATE_SCALES: 2.5 for --pools fp16:1,fp8:1), else 1")
    p.add_argument("--mooncake-rate-scale", type=float, default=None, metavar="X",
                   help="multiply the Mooncake runs' rate scales by X instead (a long-context "
                        "model serves Mooncake's prompts whole, so its knee there is not its "
                        "Azure knee); default: the measured one for the deployment "
                        "(MOONCAKE_RATE_SCALES), else the --rate-scale")
    add_deployment_options(p)
    # Mooncake prompts exceed a 4k context: the protocol truncates them (and counts them).
    p.set_defaults(over_length="truncate")
    args = p.parse_args(argv)
    try:
        spec = deployment_spec_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    try:
        candidates = controllers_from_args(args.controllers, args.settings)
    except ValueError as exc:
        p.error(str(exc))
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    multiplier = (deployment_rate_scale(spec.gpu, spec.model, spec.pools)
                  if args.rate_scale is None
                  else args.rate_scale)
    if not multiplier > 0:
        p.error(f"--rate-scale must be > 0, got {multiplier}")
    mooncake = (mooncake_rate_scale_for(spec.gpu, spec.model, spec.pools)
                if args.mooncake_rate_scale is None else args.mooncake_rate_scale)
    if mooncake is not None and not mooncake > 0:
        p.error(f"--mooncake-rate-scale must be > 0, got {mooncake}")
    rows, _pick, text = evaluate_protocol(candidates, spec, n_jobs=args.jobs,
                                          quiet=args.quiet, max_tokens=args.max_tokens,
                                          rate_scale=multiplier,
                                          mooncake_rate_scale=mooncake)
    if args.json:
        write_json(args.json, rows)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
