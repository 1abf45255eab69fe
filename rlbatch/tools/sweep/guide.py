"""The tuning guide's two production configurations, judged against measured points.

The guide (../shared/guide/) recommends:

* latency-sensitive: batch=8, max_seq_len=4096, FP16;
* throughput-first: batch=16 with PagedAttention + FP8.

A configuration holds on a GPU/model when, at every swept sequence length it admits, its
point passes the guide's own test: P99 within the SLA and no preemption (no KV overflow).
PagedAttention is always on: vLLM's KV manager (and the simulator's) is paged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from rlbatch.engine.config import Precision
from rlbatch.tools.sweep.point import SweepPoint
from rlbatch.tools.sweep.recommend import SeqLenRecommendation
from rlbatch.tools.sweep.spec import SweepSLA, SweepSpec

Verdict = Literal["holds", "fails", "not checked"]
PointKey = tuple[str, int, int]
"""(precision, batch, seq_len)"""


@dataclass(frozen=True)
class GuideConfig:
    """One of the guide's recommended configurations.

    :param name: short name.
    :param text: the guide's own words.
    :param batch: batch size.
    :param precision: ``fp16`` or ``fp8``.
    :param max_seq_len: prompt + output limit the configuration sets (``None``: the model's).
    """

    name: str
    text: str
    batch: int
    precision: Precision
    max_seq_len: int | None = None


GUIDE_CONFIGS: tuple[GuideConfig, ...] = (
    GuideConfig("latency-sensitive", "batch=8, max_seq_len=4096, FP16", 8, "fp16", 4096),
    GuideConfig("throughput-first", "batch=16, PagedAttention + FP8", 16, "fp8", None),
)


def admitted_seq_lens(config: GuideConfig, seq_lens: Sequence[int], output_len: int,
                      max_model_len: int) -> tuple[list[int], list[dict[str, Any]]]:
    """Split the swept sequence lengths into those the configuration serves and the rest.

    :param config: the configuration.
    :param seq_lens: swept prompt lengths.
    :param output_len: output tokens per request.
    :param max_model_len: the model's context limit.
    :returns: ``(served, excluded)``, each excluded one as ``{"seq_len", "reason"}``.
    """
    served: list[int] = []
    excluded: list[dict[str, Any]] = []
    for seq_len in seq_lens:
        total = seq_len + output_len
        if config.max_seq_len is not None and total > config.max_seq_len:
            excluded.append({"seq_len": seq_len, "reason": (
                f"prompt {seq_len} + output {output_len} exceeds the configuration's "
                f"max_seq_len {config.max_seq_len}")})
        elif total > max_model_len:
            excluded.append({"seq_len": seq_len, "reason": (
                f"prompt {seq_len} + output {output_len} exceeds the model's context "
                f"{max_model_len}")})
        else:
            served.append(seq_len)
    return served, excluded


@dataclass
class GuideCheck:
    """The verdict on one configuration.

    :param name: configuration name.
    :param guide_text: the guide's words.
    :param config: batch, precision, max_seq_len, paged_attention.
    :param verdict: ``holds``, ``fails`` or ``not checked`` (no swept length it serves).
    :param holds: the verdict as a boolean (``None`` when not checked).
    :param points: per served sequence length, the measured point: source (``sweep``, or
        ``extra run`` when the grid lacked it), pass/fail, failures in words, key figures.
    :param excluded: sequence lengths the configuration does not serve, with the reason.
    :param instead: the sweep's recommendation per sequence length.
    :param summary: one paragraph in words.
    """

    name: str
    guide_text: str
    config: dict[str, Any]
    verdict: Verdict
    holds: bool | None
    points: list[dict[str, Any]] = field(default_factory=list)
    excluded: list[dict[str, Any]] = field(default_factory=list)
    instead: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object."""
        return asdict(self)


def guide_point_keys(spec: SweepSpec, max_model_len: int) -> list[PointKey]:
    """Every point the guide's checks read (each configuration at each length it serves),
    in order, each once; empty when the sweep does not check the guide.

    :param spec: the sweep.
    :param max_model_len: the model's context limit.
    """
    keys: dict[PointKey, None] = {}
    if spec.check_guide:
        for config in GUIDE_CONFIGS:
            served, _ = admitted_seq_lens(config, spec.seq_lens, spec.output_len,
                                          max_model_len)
            keys.update(((config.precision, config.batch, seq_len), None) for seq_len in served)
    return list(keys)


def _check_point(point: SweepPoint, source: str, sla: SweepSLA) -> dict[str, Any]:
    failures = point.sla_failures(sla)
    return {
        "seq_len": point.seq_len, "batch": point.batch, "precision": point.precision,
        "source": source, "ok": not failures, "failures": failures,
        "ttft_p99_s": point.ttft_p99_s, "tpot_p99_s": point.tpot_p99_s,
        "e2e_p99_s": point.e2e_p99_s, "throughput_output_tok_s": point.throughput_output_tok_s,
        "kv_cache_usage_peak": point.kv_cache_usage_peak, "max_running": point.max_running,
        "preemptions": point.preemptions, "kv_overflows": point.kv_overflows,
    }


def _instead_text(recs: Sequence[SeqLenRecommendation], precision: str) -> str:
    parts = []
    for rec in recs:
        if not rec.runnable:
            continue
        if rec.largest_batch_meeting_sla is None:
            parts.append(f"seq {rec.seq_len}: no swept batch passes")
            continue
        text = f"seq {rec.seq_len}: batch {rec.largest_batch_meeting_sla}"
        if rec.max_throughput_batch != rec.largest_batch_meeting_sla:
            text += f" (max tokens/s at batch {rec.max_throughput_batch})"
        text += f", {rec.max_throughput_output_tok_s:.0f} output tok/s"
        parts.append(text)
    if not parts:
        return "The sweep has no runnable point to recommend from."
    return f"The sweep ({precision}) recommends " + "; ".join(parts) + "."


def check_config(config: GuideConfig, points: Mapping[PointKey, SweepPoint],
                 source: Callable[[PointKey], str], seq_lens: Sequence[int], output_len: int,
                 max_model_len: int, sla: SweepSLA, recs: Sequence[SeqLenRecommendation],
                 sweep_precision: str, where: str) -> GuideCheck:
    """Judge one configuration.

    :param config: the configuration.
    :param points: measured points by ``(precision, batch, seq_len)``; must hold the
        configuration's point at every sequence length it serves.
    :param source: where a point came from (``sweep`` / ``extra run``).
    :param seq_lens: swept prompt lengths.
    :param output_len: output tokens per request.
    :param max_model_len: the model's context limit.
    :param sla: the SLA.
    :param recs: the sweep's recommendations.
    :param sweep_precision: the grid's precision (the recommendations are for it).
    :param where: ``gpu / model`` for the summary.
    """
    served, excluded = admitted_seq_lens(config, seq_lens, output_len, max_model_len)
    checked = []
    for seq_len in served:
        key: PointKey = (config.precision, config.batch, seq_len)
        checked.append(_check_point(points[key], source(key), sla))
    verdict: Verdict
    if not checked:
        verdict, holds = "not checked", None
    else:
        holds = all(p["ok"] for p in checked)
        verdict = "holds" if holds else "fails"
    head = f"{config.name} ({config.text}) {verdict} on {where}"
    if checked:
        passed = [str(p["seq_len"]) for p in checked if p["ok"]]
        failed = [f"seq {p['seq_len']}: " + ", ".join(p["failures"])
                  for p in checked if not p["ok"]]
        head += f" ({sla.describe()}, no preemption)"
        details = []
        if passed:
            details.append("passes at seq " + ", ".join(passed))
        if failed:
            details.append("fails at " + "; ".join(failed))
        head += ": " + "; ".join(details)
    head += "."
    if excluded:
        head += " Not served: " + "; ".join(f"seq {e['seq_len']} ({e['reason']})"
                                            for e in excluded) + "."
    return GuideCheck(
        name=config.name, guide_text=config.text,
        config={"batch": config.batch, "precision": config.precision,
                "max_seq_len": config.max_seq_len, "paged_attention": True},
        verdict=verdict, holds=holds, points=checked, excluded=excluded,
        instead=[r.to_dict() for r in recs],
        summary=head + " " + _instead_text(recs, sweep_precision))


def guide_checks(spec: SweepSpec, measured: Mapping[PointKey, SweepPoint],
                 grid_keys: Collection[PointKey], max_model_len: int,
                 recs: Sequence[SeqLenRecommendation], where: str) -> list[GuideCheck]:
    """:func:`check_config` for every guide configuration of a finished sweep.

    :param spec: the sweep.
    :param measured: every measured point (grid and extra runs).
    :param grid_keys: the points of the sweep's own grid (the rest are extra runs).
    :param max_model_len: the engine's context.
    :param recs: the sweep's recommendations.
    :param where: GPU / model in words.
    """
    return [check_config(config, measured,
                         lambda k: "sweep" if k in grid_keys else "extra run",
                         spec.seq_lens, spec.output_len, max_model_len, spec.sla, recs,
                         spec.precision, where)
            for config in GUIDE_CONFIGS]
