"""Evaluation runs: (controller x workload x rate scale) jobs, serial, in parallel processes,
or as Ray tasks on a local or remote cluster (``ray=``)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rlbatch.control.controllers import make_controller
from rlbatch.control.types import DeploymentStats
from rlbatch.scale.tasks import TaskError
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
                                 rate_scale=job.rate_scale)
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


def job_key(job: EvalJob) -> tuple[Any, ...]:
    """What a job's workload depends on (jobs with one key share one workload)."""
    return (job.trace, job.rate_scale, job.window, job.max_requests, job.seed, job.max_tokens)


def describe_job(job: EvalJob) -> str:
    """A job's inputs in words (failure reports)."""
    return (f"{job.controller} on {job.trace} at rate {job.rate_scale:g} (window "
            f"{job.window}, max_requests {job.max_requests}, seed {job.seed}, drain "
            f"{job.drain_s:g} s, max_tokens {job.max_tokens}, {job.spec.gpu} / "
            f"{job.spec.model})")


def run_job(job: EvalJob, bar: tqdm[Any] | None = None,
            workload: Workload | None = None) -> dict[str, Any]:
    """One run's row.

    :param job: the run.
    :param bar: advanced by simulated seconds (optional).
    :param workload: the job's workload if already loaded (default: load it).
    """
    workload = load_job_workload(job) if workload is None else workload
    controller = make_controller(job.controller)

    def on_tick(stats: DeploymentStats) -> None:
        if bar is not None:
            bar.update(stats.tick_s)

    result = run(workload, controller, job.spec, drain_s=job.drain_s,
                 on_tick=on_tick if bar is not None else None, rate_scale=job.rate_scale)
    result.row["trace"] = workload.name
    result.row["skipped_rows"] = workload.skipped_rows
    return result.row


def _ray_task(job: EvalJob, workload: Workload) -> dict[str, Any]:
    return run_job(job, workload=workload)


def error_row(job: EvalJob, workload: Workload, failure: TaskError) -> dict[str, Any]:
    """The row of a run that failed on every attempt: its inputs and its error.

    :param job: the run.
    :param workload: its workload (for the trace's name).
    :param failure: what the task reported.
    """
    return {"controller": job.controller, "trace": workload.name,
            "rate_scale": job.rate_scale, "trace_source": job.trace, "window": job.window,
            "max_requests": job.max_requests, "seed": job.seed, "drain_s": job.drain_s,
            "max_tokens": job.max_tokens, "gpu": job.spec.gpu, "model": job.spec.model,
            "error": failure.error, "attempts": failure.attempts}


# Row fields measured in wall-clock time on whatever machine ran the row: the only fields that
# may differ between two runs of one job (serial, process pool, Ray).
WALL_CLOCK_FIELDS = frozenset({"wall_seconds", "speedup_x", "mpc_decision_ms_mean",
                               "mpc_decision_ms_p95"})


def comparable_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Rows as canonical JSON without their wall-clock fields: equal lists mean identical
    results (NaN compares equal here, unlike in the dicts).

    :param rows: evaluation rows.
    """
    return [json.dumps({k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS},
                       sort_keys=True, default=str) for r in rows]


def error_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of failed runs (only a ``ray=`` run has them)."""
    return [r for r in rows if "error" in r]


def run_jobs(jobs: list[EvalJob], *, n_jobs: int = 1, quiet: bool = False,
             desc: str = "evaluate", ray: str | None = None) -> list[dict[str, Any]]:
    """Run every job, rows in job order, with one progress bar over the grid.

    Every distinct workload is loaded once up front so a bad file fails before minutes of
    simulation. Without ``ray`` the jobs run in ``n_jobs`` processes (or in this one) and a
    failing run raises. With ``ray`` they run as Ray tasks (:mod:`rlbatch.scale`), each
    workload put in the object store once; a run that fails twice becomes a row with its
    inputs and ``error`` (:func:`error_rows`). The rows are the same either way: a run's
    seed is the job's own.

    :param jobs: the runs.
    :param n_jobs: processes without Ray.
    :param quiet: no progress bar.
    :param desc: the progress bar's label.
    :param ray: ``None`` (no Ray), :data:`rlbatch.scale.LOCAL` (a local cluster) or a
        cluster address.
    """
    workloads = {key: load_job_workload(next(j for j in jobs if job_key(j) == key))
                 for key in dict.fromkeys(job_key(j) for j in jobs)}
    for name in {j.controller for j in jobs}:
        make_controller(name)
    if ray is not None:
        from rlbatch.scale import connect, run_tasks

        connect(ray)
        results = run_tasks(_ray_task, jobs, shared=workloads, shared_key=job_key,
                            describe=describe_job, desc=desc, quiet=quiet)
        return [error_row(job, workloads[job_key(job)], r) if isinstance(r, TaskError)
                else r for job, r in zip(jobs, results, strict=True)]
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
