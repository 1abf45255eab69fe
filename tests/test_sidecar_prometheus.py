"""The sidecar's ``/metrics`` by Prometheus' rules, and the rule files: names that
``promtool check metrics`` passes (no colon: it is reserved for recording rules), no 0, +Inf
or NaN standing in for a value the sidecar does not know, tokens and goodput as counters, the
docs' rename table complete; the recording and alerting rules pass ``promtool check rules``
and their unit tests (``promtool test rules``, two replicas).

The Prometheus binaries come from the ``prometheus`` Debian package (CI installs it); where
they are missing those tests skip and say so. A live scrape of two real sidecars behind a
real Prometheus is ``tests/test_prometheus_dashboard.py``.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import (
    CollectorRegistry,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from rlbatch.control.stats_metrics import METRICS, MetricContext
from rlbatch.control.types import ControlAction
from rlbatch.sidecar.prom import ControlState, SidecarMetrics, SnapshotMetrics, prom_name
from tests.factories import deployment_stats, engine_stats, record

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = REPO / "deploy" / "prometheus"
RULE_FILES = ("rlbatch-rules.yaml", "rlbatch-alerts.yaml")
DOCS = REPO / "docs" / "sidecar.md"
BUCKETS = ("0-64", "64-128", "128+")
POOLS = ("fp16", "fp8")


@pytest.fixture(autouse=True)
def no_created_series() -> Iterator[None]:
    """The page as ``serve.py`` serves it: without ``*_created`` series."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
    yield
    enable_created_metrics()  # type: ignore[no-untyped-call]


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (Debian package 'prometheus'; CI installs it)")
    return path


def promtool_check_metrics(text: str) -> str:
    """What ``promtool check metrics`` says about an exposition (empty: clean)."""
    done = subprocess.run([need("promtool"), "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=60)
    report = (done.stdout + done.stderr).strip()
    assert (done.returncode == 0) == (report == ""), report
    return report


def sidecar_page(state: ControlState, *ticks: object, ctx: MetricContext | None = None) -> str:
    """A sidecar's ``/metrics`` after ``ticks`` (DeploymentStats) were recorded."""
    metrics = SidecarMetrics(BUCKETS, POOLS, ("fp16#0", "fp8#0"), lambda: state)
    ctx = ctx or MetricContext(BUCKETS, POOLS)
    for stats in ticks:
        metrics.snapshot.record(stats, ctx)  # type: ignore[arg-type]
    return generate_latest(metrics.registry).decode()


def state(in_force: ControlAction, decided: ControlAction | None = None) -> ControlState:
    return ControlState(in_force=in_force, decided=decided or in_force, bucket_names=BUCKETS,
                        pools=POOLS, upstreams=(("fp16#0", "fp16", True),
                                                ("fp8#0", "fp8", False)),
                        shadow=False, controller="playbook")


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``{sample name: {sorted labels: value}}`` of an exposition."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def exposed_names(text: str) -> set[str]:
    """Family names as a query spells them (counters with ``_total``)."""
    return {f.name + "_total" if f.type == "counter" else f.name
            for f in text_string_to_metric_families(text)}


FULL_TICK = deployment_stats(
    (engine_stats(0, "fp16", kv=0.5, prefill=100, decode=40, committed=256, capacity=1024,
                  memory=(1 << 29, 1 << 30),
                  finished=(record(1, 0, ttft=0.2, tpot=0.01), record(2, 1, ttft=3.0))),
     engine_stats(1, "fp8", kv=0.25, prefill=10, decode=6, capacity=1024)),
    caps=(8, None, 4), pools=("fp16", "any", "fp8"))
"""A tick where everything is known: one request met the SLA, one missed its TTFT."""


def test_live_page_passes_promtool_check_metrics() -> None:
    page = sidecar_page(state(ControlAction((8, None, 4), ("fp16", "any", "fp8"))),
                        FULL_TICK)
    assert promtool_check_metrics(page) == ""
    names = exposed_names(page)
    assert all(n.startswith("rlbatch_") and ":" not in n for n in names), names


def test_fractions_end_in_ratio_and_tokens_are_counters() -> None:
    page = sidecar_page(state(ControlAction((8, None, 4), ("fp16", "any", "fp8"))),
                        FULL_TICK, FULL_TICK)
    kinds = {f.name: f.type for f in text_string_to_metric_families(page)}
    for name in ("sla_attainment", "kv_cache_usage", "kv_committed", "gpu_memory_used",
                 "kv_offload_usage", "batch_efficiency"):
        assert kinds[f"rlbatch_{name}_ratio"] == "gauge"
        assert f"rlbatch_{name}" not in kinds
    assert "rlbatch_throughput_tok_s" not in kinds
    got = samples(page)
    # Two ticks: the counters add each tick's tokens and its requests meeting the SLA.
    assert got["rlbatch_generation_tokens_total"] == {(("pool", "fp16"),): 80.0,
                                                      (("pool", "fp8"),): 12.0}
    assert got["rlbatch_prompt_tokens_total"] == {(("pool", "fp16"),): 200.0,
                                                  (("pool", "fp8"),): 20.0}
    assert got["rlbatch_goodput_requests_total"] == {(): 2.0}
    assert got["rlbatch_finished_total"] == {(): 4.0}
    assert got["rlbatch_gpu_memory_used_ratio"] == {(): 0.5}
    assert got["rlbatch_kv_committed_ratio"] == {(): 0.25}


def test_tpot_fit_gauges_show_the_rules_readings_and_are_absent_with_it_off() -> None:
    in_force = state(ControlAction((8, None, 4), ("fp16", "any", "fp8")))
    on = MetricContext(BUCKETS, POOLS, tpot_fit_ceiling=48.0, tpot_fit_slowdown=1.25)
    got = samples(sidecar_page(in_force, FULL_TICK, ctx=on))
    assert got["rlbatch_tpot_fit_ceiling"] == {(): 48.0}
    assert got["rlbatch_tpot_fit_slowdown"] == {(): 1.25}
    off = samples(sidecar_page(in_force, FULL_TICK))
    assert "rlbatch_tpot_fit_ceiling" not in off and "rlbatch_tpot_fit_slowdown" not in off


def test_every_table_fraction_is_named_ratio() -> None:
    # A metric added to the snapshot table as a fraction must get its _ratio name here.
    for m in METRICS:
        if "fraction" in m.help:
            assert prom_name(m).endswith("_ratio"), m.name


def test_unknown_values_are_left_out_not_zero_inf_or_nan() -> None:
    # No GPU reading, no KV capacity, no host tier, an empty latency window, engines
    # that read nothing: every such value is absent, none is 0, +Inf or NaN.
    blind = deployment_stats((engine_stats(0, "fp16", kv=math.nan, capacity=0, memory=(0, 0)),),
                             caps=(8, None, 4), pools=("fp16", "any", "fp8"))
    in_force = ControlAction((8, None, 4), ("fp16", "any", "fp8"))
    decided = ControlAction((2, None, 4), ("fp8", "any", "fp8"))
    page = sidecar_page(state(in_force, decided), blind)
    got = samples(page)
    for name in ("rlbatch_gpu_memory_used_ratio", "rlbatch_kv_committed_ratio",
                 "rlbatch_kv_offload_usage_ratio", "rlbatch_kv_cache_usage_ratio",
                 "rlbatch_sla_attainment_ratio", "rlbatch_ttft_p99_seconds",
                 "rlbatch_batch_efficiency_ratio"):
        assert name not in got, (name, got.get(name))
    for family in text_string_to_metric_families(page):
        if family.type == "gauge":
            for s in family.samples:
                assert math.isfinite(s.value), s
    # Caps only where a bucket is routed and capped; routes for every bucket and pool.
    assert got["rlbatch_batch_cap"] == {
        (("bucket", "0-64"), ("pool", "fp16")): 8.0, (("bucket", "128+"), ("pool", "fp8")): 4.0}
    assert got["rlbatch_bucket_routed"] == {
        (("bucket", b), ("pool", p)): float(on) for b, row in zip(
            BUCKETS, ((1, 0), (1, 1), (0, 1)), strict=True)
        for p, on in zip(POOLS, row, strict=True)}
    assert got["rlbatch_decided_batch_cap"] == {
        (("bucket", "0-64"), ("pool", "fp8")): 2.0, (("bucket", "128+"), ("pool", "fp8")): 4.0}
    assert got["rlbatch_decision_differs"] == {
        (("bucket", "0-64"),): 1.0, (("bucket", "64-128"),): 0.0, (("bucket", "128+"),): 0.0}


def rename_table() -> list[tuple[str, str]]:
    """``(old, new)`` rows of the docs' rename table (old ``""`` for a new name)."""
    text = DOCS.read_text()
    start = text.index("### Metric names: old and new")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[1].startswith("`"):
            continue
        new = re.match(r"`([a-z0-9_:]+)", cells[1])
        old = re.match(r"`([a-z0-9_:]+)", cells[0])
        assert new, line
        rows.append((old.group(1) if old else "", new.group(1)))
    return rows


def test_docs_rename_table_names_every_metric_once() -> None:
    page = sidecar_page(state(ControlAction((8, None, 4), ("fp16", "any", "fp8"))),
                        FULL_TICK)
    rows = rename_table()
    news = [new for _, new in rows]
    assert len(news) == len(set(news))
    assert set(news) == exposed_names(page)
    olds = {old for old, _ in rows if old}
    assert all(old.startswith("rlbatch:") for old in olds), olds
    # every name the snapshot table gave before (pool_index never left; the tpot_fit gauges
    # came after the rename)
    for m in METRICS:
        if m.name not in ("pool_index", "tpot_fit_ceiling", "tpot_fit_slowdown"):
            assert f"rlbatch:{m.name}{'_total' if m.kind == 'counter' else ''}" in olds, m.name


def test_snapshot_metrics_alone_need_no_sla() -> None:
    # The snapshot's own registry judges goodput by the default SLA when given none.
    reg = CollectorRegistry(auto_describe=False)
    snap = SnapshotMetrics(reg, MetricContext(BUCKETS, POOLS))
    snap.record(FULL_TICK, MetricContext(BUCKETS, POOLS))
    assert samples(generate_latest(reg).decode())["rlbatch_goodput_requests_total"] == {(): 1.0}


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = need("promtool")
    done = subprocess.run([promtool, "check", "rules", *RULE_FILES], capture_output=True,
                          text=True, timeout=60, cwd=PROMETHEUS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout and "SUCCESS: 6 rules found" in done.stdout
    tested = subprocess.run([promtool, "test", "rules", "rlbatch-rules.test.yaml"],
                            capture_output=True, text=True, timeout=60, cwd=PROMETHEUS)
    assert tested.returncode == 0, tested.stdout + tested.stderr
