"""Evaluation runs: (controller x workload x rate scale) jobs, in parallel processes."""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rlbatch.control.controllers import make_controller
from rlbatch.control.types import DeploymentStats
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import (
    Workload,
    build_workload,
    declare_max_tokens,
    load_trace,
    resolve_workload,
)
from rlbatch.workload.scenarios import make_scenario


@dataclass(frozen=True)
class EvalJob:
    """One (controller, workload, rate scale) run of an evaluation."""

    controller: str
    trace: str
    rate_scale: float
    spec: DeploymentSpec
    window: tuple[float, float] | None
    max_requests: int | None
    seed: int
    drain_s: float
    max_tokens: int | None = None


def load_job_workload(job: EvalJob) -> Workload:
    """A trace file (with window / max-requests) or a generator spec, at the job's rate,
    with the clients' declared ``max_tokens`` if the job sets one."""
    workload = _load_source(job)
    return workload if job.max_tokens is None else declare_max_tokens(workload, job.max_tokens)


def _load_source(job: EvalJob) -> Workload:
    if Path(job.trace).exists():
        return load_trace(job.trace, rate_scale=job.rate_scale, window_s=job.window,
                          max_requests=job.max_requests, seed=job.seed)
    if job.window is not None:
        raise ValueError(f"--window applies to trace files, not to generator {job.trace!r}")
    if job.trace.startswith("scenario:"):
        name, _, duration = job.trace.removeprefix("scenario:").partition(":")
        workload = make_scenario(name, seed=job.seed, duration_s=float(duration or 900),
                                 load_scale=job.rate_scale)
        return _first(workload, job.max_requests)
    return _first(resolve_workload(job.trace, job.seed, rate_scale=job.rate_scale),
                  job.max_requests)


def _first(workload: Workload, max_requests: int | None) -> Workload:
    if max_requests is None or max_requests >= len(workload):
        return workload
    rows = [(r.arrival_s, r.prompt_tokens, r.max_output_tokens, r.prefix_ids)
            for r in workload.requests[:max_requests]]
    return build_workload(rows, name=workload.name, source=workload.source,
                          transforms=(*workload.transforms, f"first {max_requests} requests"))


def run_job(job: EvalJob, bar: tqdm[Any] | None = None) -> dict[str, Any]:
    workload = load_job_workload(job)
    controller = make_controller(job.controller)

    def on_tick(stats: DeploymentStats) -> None:
        if bar is not None:
            bar.update(stats.tick_s)

    result = run(workload, controller, job.spec, drain_s=job.drain_s,
                 on_tick=on_tick if bar is not None else None, rate_scale=job.rate_scale)
    result.row["trace"] = workload.name
    result.row["skipped_rows"] = workload.skipped_rows
    return result.row


def run_jobs(jobs: list[EvalJob], *, n_jobs: int = 1, quiet: bool = False,
             desc: str = "evaluate") -> list[dict[str, Any]]:
    """Run every job (in ``n_jobs`` processes), rows in job order, with a progress bar.

    Every distinct workload is loaded once up front so a bad file fails before minutes of
    simulation.
    """
    for key in {(j.trace, j.rate_scale, j.window, j.max_requests, j.seed, j.max_tokens)
                for j in jobs}:
        first = next(j for j in jobs if (j.trace, j.rate_scale, j.window, j.max_requests,
                                         j.seed, j.max_tokens) == key)
        load_job_workload(first)
    for name in {j.controller for j in jobs}:
        make_controller(name)
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(jobs), unit="run", desc=desc, file=sys.stderr, disable=quiet) as bar:
        if n_jobs > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(max_workers=n_jobs) as pool:
                for row in pool.map(run_job, jobs):
                    rows.append(row)
                    bar.update(1)
        else:
            for job in jobs:
                rows.append(run_job(job))
                bar.update(1)
    return rows
