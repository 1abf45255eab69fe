"""The recipe's TensorBoard: every phase's runs on one global step, histograms of the totals
and caps in force, the configuration as hparams and a custom-scalars layout.

Each run of a phase (a run row of :func:`rlbatch.serving.run.run`: a teacher or DAgger
episode, a checkpoint on a validation window; or a fine-tuning episode) is one point at the
recipe's global step, the simulated control ticks the recipe has run so far over all
phases, so the phases follow one another on one x-axis. Per run, ``<phase>`` one of
:data:`PHASES` and ``<bucket>`` a bucket's name (``0-1k``):

========================================================  ==================================
tag                                                       value
========================================================  ==================================
``<phase>/goodput_rps``, ``<phase>/goodput_rps/<bucket>``  requests per second meeting the SLA
``<phase>/sla_attainment[/<bucket>]``                     share of requests meeting the SLA
``<phase>/ttft_p99_s/<bucket>``, ``<phase>/sla_ttft_s``   TTFT P99 and the run's SLA limit
``<phase>/tpot_p99_s/<bucket>``, ``<phase>/sla_tpot_s``   TPOT P99 and the run's SLA limit
``<phase>/batch_cap/<bucket>``                            the bucket's median cap over the
                                                          run's ticks (a bucket without a
                                                          cap: the total; neither: no point)
``<phase>/total_median``                                  the median total
``<phase>/kv_cache_usage_peak``                           peak KV cache usage (fraction)
``<phase>/guard_overrides``                               the guard's overrides in the run
``<phase>/total_hist``, ``<phase>/batch_cap_hist/<b>``    histograms: ticks per total / cap
========================================================  ==================================

Values a chart cannot hold (an empty bucket's attainment, an uncapped total) are left out,
never drawn as 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ScalarLog = Callable[[str, float, int], None]
"""``log(tag, value, step)``: what every phase logs its scalars with."""

PHASES: tuple[str, ...] = ("teacher", "dagger", "finetune", "select")
"""The recipe's phases that log runs, in order."""

BUCKET_FIELDS: tuple[str, ...] = ("goodput_rps", "sla_attainment", "ttft_p99_s", "tpot_p99_s")
"""The ``per_bucket`` fields of a run row logged per bucket."""

HPARAM_METRICS: tuple[str, ...] = ("hparams/best_score", "hparams/teacher_goodput_rps",
                                   "hparams/decisions", "hparams/wall_s")
"""The figures the hparams dashboard shows against the configuration."""


class Board:
    """A TensorBoard writer as the phases' ``log(tag, value, step)`` (scalars; non-finite
    values left out), with histograms, hparams and the custom-scalars layout.

    :param writer: a ``SummaryWriter`` (torch's; tensorboardX's has the same methods).
    :param prefix: before every tag (a member of an ensemble: ``member-0/``).
    """

    def __init__(self, writer: Any, prefix: str = "") -> None:
        self.writer = writer
        self.prefix = prefix

    def __call__(self, tag: str, value: float, step: int) -> None:
        if math.isfinite(value):
            self.writer.add_scalar(self.prefix + tag, float(value), step)

    def histogram(self, tag: str, ticks: Mapping[str, int], step: int) -> None:
        """Ticks per value as a histogram (``"none"``, no limit, left out).

        :param ticks: a row's ``max_num_seqs_ticks`` or one bucket's ``bucket_cap_ticks``.
        """
        finite = {float(k): n for k, n in ticks.items() if k != "none" and n > 0}
        if finite:
            values = np.repeat(np.fromiter(finite, float), list(finite.values()))
            self.writer.add_histogram(self.prefix + tag, values, step)

    def prefixed(self, prefix: str) -> Board:
        """The same writer, ``prefix`` added before every tag."""
        return Board(self.writer, self.prefix + prefix)

    def layout(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        """The custom-scalars layout (:func:`recipe_layout`); once per writer."""
        self.writer.add_custom_scalars(layout)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """The configuration and the figures it gave, in this writer's run (``run_name``
        ``"."``: not a run folder of its own, so the dashboard pairs them with its
        scalars)."""
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self.writer.add_hparams(hparam_values(hparams), finite, run_name=".")


def record_hparams(board: Board, config: Mapping[str, Any],
                   summary: Mapping[str, Any]) -> None:
    """A finished recipe's configuration and figures (:data:`HPARAM_METRICS`) as hparams.

    :param config: the :class:`~policies.training.recipe.RecipeConfig`, as a dict.
    :param summary: what :func:`~policies.training.recipe.run_recipe` returned.
    """
    teacher = [float(g) for g in summary.get("teacher_goodput_rps", ()) if g is not None]
    board.hparams(config, dict(zip(HPARAM_METRICS, (
        max(summary["selection_scores"], default=math.nan),
        float(np.mean(teacher)) if teacher else math.nan,
        float(summary["decisions"]), float(summary["wall_s"])), strict=True)))


def hparam_values(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """A configuration as hparams: numbers, booleans and strings as they are, anything else
    (tuples, lists, ``None``) as text, which the dashboard can show and filter."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, bool | int | float | str):
            out[key] = value
        elif isinstance(value, tuple | list):
            out[key] = ",".join(Path(v).name if key == "traces" else str(v) for v in value)
        else:
            out[key] = str(value)
    return out


def ticks_median(ticks: Mapping[str, int]) -> float:
    """The median over the ticks of the value in force (``inf``: no limit; NaN: no ticks)."""
    values = sorted((math.inf if k == "none" else float(k), n) for k, n in ticks.items())
    total, seen = sum(n for _, n in values), 0
    for value, n in values:
        seen += n
        if 2 * seen >= total > 0:
            return value
    return math.nan


def run_ticks(row: Mapping[str, Any]) -> int:
    """Control ticks of a run (at least 1, so each run moves the global step)."""
    ticks: Mapping[str, int] = row.get("max_num_seqs_ticks", {})
    return max(1, sum(ticks.values()))


def run_scalars(phase: str, row: Mapping[str, Any]) -> dict[str, float]:
    """One run's scalars under ``phase`` (finite values only).

    :param phase: the tag prefix (one of :data:`PHASES`).
    :param row: a run row (``per_bucket``, ``max_num_seqs_ticks``, ``bucket_cap_ticks``, ...).
    """
    values: dict[str, Any] = {f"{phase}/{key}": row.get(key) for key in (
        "goodput_rps", "sla_attainment", "sla_ttft_s", "sla_tpot_s", "kv_cache_usage_peak",
        "guard_overrides")}
    values[f"{phase}/total_median"] = ticks_median(row.get("max_num_seqs_ticks", {}))
    for bucket, per in row.get("per_bucket", {}).items():
        for key in BUCKET_FIELDS:
            values[f"{phase}/{key}/{bucket}"] = per.get(key)
    for bucket, ticks in row.get("bucket_cap_ticks", {}).items():
        values[f"{phase}/batch_cap/{bucket}"] = ticks_median(ticks)
    return {tag: float(v) for tag, v in values.items()
            if isinstance(v, int | float) and math.isfinite(v)}


def run_histograms(phase: str, row: Mapping[str, Any]) -> dict[str, Mapping[str, int]]:
    """One run's histograms under ``phase``: ticks per total and per bucket's cap."""
    out: dict[str, Mapping[str, int]] = {f"{phase}/total_hist": row.get("max_num_seqs_ticks",
                                                                        {})}
    for bucket, ticks in row.get("bucket_cap_ticks", {}).items():
        out[f"{phase}/batch_cap_hist/{bucket}"] = ticks
    return out


def log_run(log: ScalarLog, phase: str, row: Mapping[str, Any], step: int) -> None:
    """One run's scalars at ``step``, and its histograms where ``log`` is a :class:`Board`."""
    for tag, value in run_scalars(phase, row).items():
        log(tag, value, step)
    if isinstance(log, Board):
        for tag, ticks in run_histograms(phase, row).items():
            log.histogram(tag, ticks, step)


def log_runs(log: ScalarLog, phase: str, rows: Sequence[Mapping[str, Any]], step: int) -> int:
    """Runs one after another: each logged at ``step`` plus the ticks of the runs so far,
    its own included. Returns the step after the last."""
    for row in rows:
        step += run_ticks(row)
        log_run(log, phase, row, step)
    return step


def recipe_layout(phases: Sequence[str] = PHASES) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout: per phase, the buckets' caps on one chart, each P99 against
    its SLA limit, goodput and SLA attainment per bucket. Patterns allow a member's prefix
    (``member-0/``), so an ensemble's members share the charts."""
    layout: dict[str, dict[str, list[Any]]] = {}
    for phase in phases:
        p = rf"(.*/)?{phase}/"
        layout[f"recipe: {phase}"] = {
            f"{phase}: batch cap per bucket (no cap of its own: the total)":
                ["Multiline", [p + "batch_cap/.*", p + "total_median$"]],
            f"{phase}: TTFT P99 per bucket vs the SLA":
                ["Multiline", [p + "ttft_p99_s/.*", p + "sla_ttft_s$"]],
            f"{phase}: TPOT P99 per bucket vs the SLA":
                ["Multiline", [p + "tpot_p99_s/.*", p + "sla_tpot_s$"]],
            f"{phase}: goodput per bucket (req/s)": ["Multiline", [p + "goodput_rps/.*"]],
            f"{phase}: SLA attainment per bucket": ["Multiline", [p + "sla_attainment/.*"]],
        }
    return layout
