"""``rlbatch sweep --ray``: the simulator sweep's points as Ray tasks, the same result.

The simulator backend builds a fresh engine for every point, so points are independent: the
grid and the guide's extra points are known up front and run as one Ray task each
(:mod:`rlbatch.scale`), then assembled exactly as :func:`rlbatch.tools.sweep.checklist.run_spec`
does. A point that fails twice becomes a not-runnable point whose reason is the error (it
shows in every report) and is returned among the failures.
"""

from __future__ import annotations

from typing import Any, cast

from rlbatch.engine.config import Precision
from rlbatch.scale.tasks import TaskError
from rlbatch.tools.sweep.checklist import SweepResult, planned_max_batch
from rlbatch.tools.sweep.engines import open_backend
from rlbatch.tools.sweep.guide import PointKey, guide_checks, guide_point_keys
from rlbatch.tools.sweep.point import SweepPoint, measure_point
from rlbatch.tools.sweep.recommend import recommend
from rlbatch.tools.sweep.spec import SweepSpec

FAILED_PREFIX = "task failed: "


def _point_task(item: tuple[SweepSpec, PointKey], _shared: Any) -> SweepPoint:
    spec, (name, batch, seq_len) = item
    precision = cast(Precision, name)
    with open_backend(spec, planned_max_batch(spec)) as backend:
        backend.plan(precision)
        return measure_point(spec, batch, seq_len, precision, backend)


def _keys(spec: SweepSpec, max_model_len: int) -> tuple[list[PointKey], list[PointKey]]:
    """The grid's points (``seq_len``-major, as the serial sweep) and the guide's extra ones."""
    grid: list[PointKey] = [(spec.precision, b, s) for s in spec.seq_lens
                            for b in spec.batches]
    extra = [key for key in guide_point_keys(spec, max_model_len) if key not in grid]
    return grid, extra


def run_spec_ray(spec: SweepSpec, address: str, *, quiet: bool = False
                 ) -> tuple[SweepResult, list[SweepPoint]]:
    """Run a simulator sweep's points as Ray tasks.

    :param spec: the sweep (``engine`` must be ``sim``).
    :param address: :data:`rlbatch.scale.LOCAL` or a cluster address.
    :param quiet: no progress bar.
    :returns: the result (as :func:`run_spec` gives it) and the points that failed.
    :raises ValueError: a live engine (it runs in this process, on this machine).
    """
    from rlbatch.scale import connect, run_tasks

    if spec.engine != "sim":
        raise ValueError("--ray runs simulator sweeps; a live engine (--engine vllm) runs "
                         "in this process, one point at a time")
    with open_backend(spec, planned_max_batch(spec)) as backend:
        info = backend.info()
        max_model_len = backend.max_model_len
        grid, extra = _keys(spec, max_model_len)
        precisions = [cast(Precision, p)
                      for p in dict.fromkeys(p for p, _, _ in [*grid, *extra])]
        plans = {p: backend.plan(p) for p in precisions}
        precision_text = backend.precision_note(spec.precision)
    connect(address)
    keys = [*grid, *extra]
    results = run_tasks(_point_task, [(spec, k) for k in keys], desc="sweep", quiet=quiet,
                        describe=lambda item: f"point {item[1]} of {spec.gpu}/{spec.model}")
    measured: dict[PointKey, SweepPoint] = {}
    failures: list[SweepPoint] = []
    for key, r in zip(keys, results, strict=True):
        if isinstance(r, TaskError):
            r = SweepPoint(batch=key[1], seq_len=key[2], output_len=spec.output_len,
                           precision=cast(Precision, key[0]), runnable=False,
                           reason=f"{FAILED_PREFIX}{r.error} ({r.attempts} attempts)")
            failures.append(r)
        measured[key] = r
    points = [measured[k] for k in grid]
    grid_keys = set(grid)
    recs = recommend(points, spec.seq_lens, spec.output_len, plans[spec.precision])
    checks = []
    if spec.check_guide:
        checks = guide_checks(spec, measured, grid_keys, max_model_len, recs,
                              f"{info.gpu} / {info.model}")
    result = SweepResult(spec=spec, gpu=info.gpu, model=info.model,
                         max_model_len=max_model_len, gpu_fp8=info.gpu_fp8, points=points,
                         plans={p: plans[p] for p in precisions}, recommendations=recs,
                         guide_checks=checks, extra_points=[measured[k] for k in extra],
                         engine_label=info.engine_label, precision_text=precision_text,
                         notes=list(info.notes))
    return result, failures
