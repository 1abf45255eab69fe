"""Checkpoint selection's validation windows: full-length windows of the training traffic
(never the held-back window), at fixed rate scales or where that traffic is contested, and
the static caps each window's score is judged against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from policies.evaluation.compare import CONTESTED
from policies.evaluation.protocol import training_window
from rlbatch.buckets import DEFAULT_EDGES
from rlbatch.control.controllers import make_controller
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import Workload, load_trace
from rlbatch.workload.families import FAMILIES, drift, family_workload
from rlbatch.workload.remix import length_pools, remix


class SelectionConfig(Protocol):
    """What selection reads of :class:`policies.training.recipe.RecipeConfig`."""

    traces: tuple[str, ...]
    gpu: str
    model: str
    pools: str
    selection_rates: tuple[float, ...]
    selection_knee: bool
    selection_mixes: bool
    family_share: float
    episode_s: float

    def train_deployments(self) -> list[tuple[str, str]]: ...

    def spec(self, deployment: int = 0) -> DeploymentSpec: ...

    def multiplier(self, deployment: int = 0) -> float: ...


SELECTION_STATICS: tuple[str, ...] = tuple(f"static:{n}" for n in (16, 32, 64, 128, 256))
"""The static caps a validation window's best is taken from."""
KNEE_SCAN: tuple[float, ...] = tuple(round(0.5 + 0.05 * i, 2) for i in range(15))
"""Rate scales (times the deployment's multiplier) scanned for the contested ones."""


def knee_selection_rates(cfg: SelectionConfig, trace: str, count: int = 3,
                         scan: Sequence[float] = KNEE_SCAN
                         ) -> tuple[list[float], dict[float, list[dict[str, Any]]]]:
    """The rate scales (``scan`` times the first deployment's multiplier, in order) at which
    ``trace``'s training window is contested on the first deployment: its best selection
    static meets the SLA for 20-95% of the requests. The scan stops at the first collapsed
    scale after a contested one; ``count`` of the contested scales are kept, evenly spread
    from the lightest to the busiest. Only the training window is read.

    :returns: the kept scales and, for each, the selection statics' rows (reused by
        selection).
    :raises ValueError: no scanned scale is contested.
    """
    spec, multiplier, window = cfg.spec(), cfg.multiplier(), training_window(trace)
    contested: dict[float, list[dict[str, Any]]] = {}
    for s in scan:
        rate = s * multiplier
        w = load_trace(trace, rate_scale=rate, window_s=window)
        rows = [run(w, make_controller(c), spec).row for c in SELECTION_STATICS]
        best_sla = float(max(rows, key=lambda r: float(r["goodput_rps"]))["sla_attainment"]
                         or 0.0)
        if CONTESTED[0] <= best_sla <= CONTESTED[1]:
            contested[rate] = rows
        elif best_sla < CONTESTED[0] and contested:
            break
    if not contested:
        raise ValueError(f"no scanned rate scale ({scan[0]:g}-{scan[-1]:g} x "
                         f"{multiplier:g}) makes the training window of {trace} contested "
                         f"on {cfg.gpu}/{cfg.model} ({cfg.pools}): give --rate-scale")
    rates = sorted(contested)
    picks = sorted({rates[round(i * (len(rates) - 1) / max(count - 1, 1))]
                    for i in range(min(count, len(rates)))})
    return picks, {r: contested[r] for r in picks}


def validation_workloads(cfg: SelectionConfig,
                         knee: dict[str, Sequence[float]] | None = None
                         ) -> list[tuple[str, int, Workload]]:
    """Full-length windows of the training traffic: the whole training window of each trace
    at each selection rate on the first deployment (``knee``: the given absolute rate scales
    per trace instead), at the middle selection rate on each further one, and
    (``selection_mixes``) each trace's window at the middle rate with equal bucket shares
    (:func:`mixed_window`). Items: ``(name, deployment index, workload)``."""
    out = []
    middle = sorted(cfg.selection_rates)[len(cfg.selection_rates) // 2]
    for d, (gpu, model) in enumerate(cfg.train_deployments()):
        rates = cfg.selection_rates if d == 0 else (middle,)
        for t in cfg.traces:
            window = training_window(t)
            scaled = ([r * cfg.multiplier(d) for r in rates] if knee is None or d > 0
                      else list(knee[t]))
            for rate in scaled:
                w = load_trace(t, rate_scale=rate, window_s=window)
                name = f"{w.name}@{rate:g}" + ("" if d == 0 else f" on {gpu}/{model}")
                out.append((name, d, w))
            if cfg.selection_mixes and d == 0:
                out.append(mixed_window(t, middle * cfg.multiplier(d)))
    return out


FAMILY_WINDOW_SEED = 101
"""Seed of the family validation windows (not one the family judge uses)."""
FAMILY_STATICS: tuple[str, ...] = tuple(f"static:{n}" for n in (4, 8, 16, 32, 64, 128, 256))
"""A family window's best static is taken from the whole ladder: on code completion it is a
small one."""


def family_windows(cfg: SelectionConfig) -> list[tuple[str, int, Workload]]:
    """With ``family_share``: each traffic family, and a drift from code completion to chat,
    at its knee on the first deployment (seed :data:`FAMILY_WINDOW_SEED`), so that selection
    prefers a checkpoint that reads the traffic."""
    if cfg.family_share <= 0:
        return []
    load = cfg.multiplier(0)
    out = [(f"family {name}", 0, family_workload(name, load, cfg.episode_s,
                                                  FAMILY_WINDOW_SEED)) for name in FAMILIES]
    out.append(("family drift", 0, drift(("code", "chat"), load, 2 * cfg.episode_s,
                                         cfg.episode_s, FAMILY_WINDOW_SEED)))
    return out


MIXED_WINDOW_SEED = 0
"""The draws of the mixed validation window are fixed: every checkpoint of every run meets
the same requests."""


def mixed_window(trace: str, rate: float) -> tuple[str, int, Workload]:
    """The training window of ``trace`` at ``rate`` with every prompt-length bucket equally
    likely (the centre of the simplex the recipe's ``mix_share`` draws from: lengths from
    the window's own requests, thinned to its token rate; :func:`rlbatch.workload.remix.
    remix`), on the first deployment."""
    window = training_window(trace)
    w = load_trace(trace, rate_scale=rate, window_s=window)
    pools = length_pools(w.requests, DEFAULT_EDGES)
    mixed = remix(w, pools, [1.0] * len(pools), np.random.default_rng(MIXED_WINDOW_SEED))
    return f"{w.name}@{rate:g} mixed", 0, mixed


def validation_statics(cfg: SelectionConfig, specs: Sequence[DeploymentSpec],
                       log: Callable[[str, float, int], None] | None = None
                       ) -> tuple[list[tuple[str, int, Workload]],
                                  dict[str, list[dict[str, Any]]],
                                  dict[str, Sequence[float]] | None]:
    """The validation windows of ``cfg`` and the selection statics' rows on each (the knee
    scan's rows reused with ``selection_knee``).

    :param cfg: the recipe.
    :param specs: the simulated deployment of each of ``cfg``'s deployments, in order.
    :param log: TensorBoard scalars (``select/knee_rate``).
    :returns: ``(windows, statics by window name, knee rates per trace or None)``.
    """
    knee: dict[str, Sequence[float]] | None = None
    known: list[list[dict[str, Any]]] = []  # the knee scan's rows, in validation order
    if cfg.selection_knee:
        knee = {}
        for t in cfg.traces:
            rates, rows = knee_selection_rates(cfg, t)
            knee[t] = rates
            for rate in rates:
                if log is not None:
                    log("select/knee_rate", rate, len(known))
                known.append(rows[rate])
    validation = validation_workloads(cfg, knee)
    scanned = iter(known)
    statics = {name: (next(scanned) if knee is not None and d == 0 else
                      [run(w, make_controller(s), specs[d]).row for s in SELECTION_STATICS])
               for name, d, w in validation}
    for name, d, w in family_windows(cfg):
        validation.append((name, d, w))
        statics[name] = [run(w, make_controller(s), specs[d]).row for s in FAMILY_STATICS]
    return validation, statics, knee
