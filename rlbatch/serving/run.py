"""Run one controller over one workload on a simulated deployment: the control loop."""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from rlbatch.control.controllers import Controller
from rlbatch.control.types import DeploymentStats
from rlbatch.engine.stats import FinishedRequest
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.loop import ControlLoop
from rlbatch.serving.twin import DeploymentTwin, can_fork
from rlbatch.workload import Workload

TickCallback = Callable[[DeploymentStats], None]

GC_ALLOCATIONS = 100_000
"""Net allocations of container objects between two passes of the cyclic garbage collector
over its youngest generation while a simulated run goes (Python's default is 700)."""


@contextmanager
def _rare_collections() -> Iterator[None]:
    """The cyclic garbage collector's passes made rare (every :data:`GC_ALLOCATIONS`) for the
    block, its thresholds restored after. A simulated run allocates hundreds of thousands of
    small objects (requests' state, records, heap entries) that stay alive for a while and
    form no cycle; at the default thresholds the collector traverses them again and again,
    about 5% of a run. Cycles are still collected, so memory stays bounded (an ``mpc``
    controller's twin rollouts leave some)."""
    before = gc.get_threshold()
    if before[0] == 0 or before[0] >= GC_ALLOCATIONS:  # 0: automatic collection is off
        yield
        return
    gc.set_threshold(GC_ALLOCATIONS, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


@dataclass
class RunResult:
    """Outcome of one run.

    :param row: the evaluation row (DESIGN.md command contract fields and more).
    :param records: every request that left the system (each attempt, with clients that
        retry).
    :param outcomes: each request of the workload as its user saw it (``(arrival_s, met)``,
        :meth:`~rlbatch.serving.loop.ControlLoop.user_outcomes`), when asked for.
    """

    row: dict[str, Any]
    records: list[FinishedRequest]
    outcomes: list[tuple[float, bool]] | None = None


def run(
    workload: Workload,
    controller: Controller,
    spec: DeploymentSpec,
    *,
    window_s: float = 30.0,
    drain_s: float = 600.0,
    on_tick: TickCallback | None = None,
    rate_scale: float = 1.0,
    outcomes: bool = False,
) -> RunResult:
    """Drive ``controller`` over ``workload`` on a fresh deployment built from ``spec``.

    Every control tick (``spec.tick_s`` of engine time) the engines' stats are snapshotted,
    the controller decides, and its action is applied; admission serves under the
    controller's discipline. A simulated deployment's exact fork is offered to the
    controller as its digital twin (:meth:`Controller.bind
    <rlbatch.control.controllers.Controller.bind>`, :class:`~rlbatch.serving.twin.
    DeploymentTwin`: ``mpc`` plans with it); its ``row_extras()`` join the row. The run
    ends when every request has finished or been rejected, or ``drain_s`` after the last
    arrival (what is left counts as unfinished, against SLA attainment).

    :param workload: the arrivals.
    :param controller: the controller under test.
    :param spec: the deployment.
    :param window_s: sliding window of the latency percentiles handed to the controller.
    :param drain_s: how long after the last arrival the run may go on.
    :param on_tick: called with every tick's stats (progress bars, logging).
    :param rate_scale: recorded in the row (the workload is already scaled).
    :param outcomes: also return each user request's outcome (:attr:`RunResult.outcomes`).
    """
    wall_start = time.perf_counter()
    deployment = build_deployment(spec)
    if can_fork(deployment):
        controller.bind(DeploymentTwin(deployment))
    # how long each total (max_num_seqs, as the guard let it through) and each bucket's cap
    # were in force: whether a controller reads the traffic shows as totals that move
    # between workloads
    actions: Counter[tuple[int | None, tuple[int | None, ...]]] = Counter()
    loop = ControlLoop(deployment, workload.requests, controller.reset(deployment.info),
                       discipline=controller.discipline, window_s=window_s, drain_s=drain_s)
    try:
        with _rare_collections() if spec.engine == "sim" else nullcontext():
            while True:
                stats = loop.tick()
                if on_tick is not None:
                    on_tick(stats)
                if loop.finished:
                    break
                action = controller.decide(stats)
                actions[action.max_num_seqs, action.caps] += 1
                loop.apply(action)
    finally:
        deployment.close()
    info = deployment.info
    row: dict[str, Any] = {
        "controller": controller.name,
        "trace": workload.name,
        "rate_scale": rate_scale,
        "gpu": info.gpu,
        "model": info.model,
        "pools": ",".join(f"{p}:{n}" for p, n in info.pools.items()),
    }
    row.update(loop.summary())
    row["guard_overrides"] = controller.guard_overrides_total
    row.update(tick_fields(actions, info.buckets.names))
    row.update(controller.row_extras())
    row["wall_seconds"] = time.perf_counter() - wall_start
    row["speedup_x"] = row["sim_seconds"] / row["wall_seconds"] if row["wall_seconds"] > 0 else 0.0
    return RunResult(row=row, records=loop.records,
                     outcomes=loop.user_outcomes() if outcomes else None)


def tick_fields(actions: Counter[tuple[int | None, tuple[int | None, ...]]],
                bucket_names: Sequence[str]) -> dict[str, Any]:
    """The row's fields of the actions in force: ``max_num_seqs_ticks`` (ticks per total,
    ``"none"``: no total), ``max_num_seqs_median`` and ``bucket_cap_ticks`` (per bucket,
    ticks per cap; a bucket without a cap of its own counts the total, which alone holds
    its requests then; ``"none"``: neither).

    :param actions: ticks per ``(max_num_seqs, caps)`` in force.
    :param bucket_names: the buckets, in the order of ``caps``.
    """
    totals: Counter[int | None] = Counter()
    caps: list[Counter[int | None]] = [Counter() for _ in bucket_names]
    for (total, bucket_caps), n in actions.items():
        totals[total] += n
        for counter, cap in zip(caps, bucket_caps, strict=True):
            counter[total if cap is None else cap] += n
    return {"max_num_seqs_ticks": _ticks(totals), "max_num_seqs_median": _median_total(totals),
            "bucket_cap_ticks": {name: _ticks(counter)
                                 for name, counter in zip(bucket_names, caps, strict=True)}}


def _ticks(counter: Counter[int | None]) -> dict[str, int]:
    return {("none" if k is None else str(k)): n
            for k, n in sorted(counter.items(), key=_total_order)}


def _total_order(item: tuple[int | None, int]) -> float:
    return math.inf if item[0] is None else float(item[0])


def _median_total(totals: Counter[int | None]) -> float:
    """The total in force half the ticks were at or under (``inf``: no limit; NaN: none)."""
    ticks = sum(totals.values())
    seen = 0
    for total, n in sorted(totals.items(), key=_total_order):
        seen += n
        if 2 * seen >= ticks:
            return math.inf if total is None else float(total)
    return math.nan
