"""Build ``deploy/grafana/rlbatch-sidecar.json``, the Grafana dashboard of the sidecar and its
vLLM upstreams, with Grafana's own builder library (``grafana-foundation-sdk``, the dev extra)
from the panel list below.

    .venv/bin/python deploy/grafana/build_dashboard.py          # rewrite the JSON
    .venv/bin/python deploy/grafana/build_dashboard.py --check  # fail if it is stale

Template variables pick the Prometheus data source, the ``namespace``, the sidecar ``job``
and its ``instance`` (replicas), and the ``vllm_job`` whose servers the vLLM panels show.
Job-level figures come from the recording rules of ``deploy/prometheus/rlbatch-rules.yaml``
(``level:metric:operations``), so they add up over replicas; per-replica ones from the raw
series. ``tests/test_prometheus_dashboard.py`` checks the file is what this script builds, and
runs every query, its variables substituted, against a real Prometheus scraping two sidecars.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, prometheus, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from rlbatch.sidecar.prom import REJECTIONS

OUT = Path(__file__).with_name("rlbatch-sidecar.json")

SIDECAR = 'namespace=~"$namespace", job=~"$job", instance=~"$instance"'
"""The sidecar replicas chosen."""
JOB = 'namespace=~"$namespace", job=~"$job"'
"""The sidecar jobs chosen (recording rules aggregate their replicas)."""
VLLM = 'namespace=~"$namespace", job=~"$vllm_job"'
"""The vLLM servers chosen: without it the vLLM panels showed every vLLM Prometheus scrapes."""
RATE = "$__rate_interval"
REJECTED = "|".join(REJECTIONS)

PanelKind = Literal["timeseries", "heatmap", "table"]


@dataclass(frozen=True)
class Panel:
    """One panel: its row, title, unit, ``(expr, legend)`` targets and kind."""

    row: str
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]
    kind: PanelKind = "timeseries"


def _p(row: str, title: str, unit: str, *targets: tuple[str, str],
       kind: PanelKind = "timeseries") -> Panel:
    return Panel(row, title, unit, targets, kind)


PANELS: tuple[Panel, ...] = (
    _p("SLA and goodput", "Goodput: finished requests meeting the SLA per second", "reqps",
       (f"job:rlbatch_goodput_requests:rate5m{{{JOB}}}", "{{job}} (5 m)"),
       (f"sum by (instance) (rate(rlbatch_goodput_requests_total{{{SIDECAR}}}[{RATE}]))",
        "{{instance}}")),
    _p("SLA and goodput", "SLA attainment (share of finished requests meeting the SLA)",
       "percentunit",
       (f"job:rlbatch_sla_attainment:ratio_rate5m{{{JOB}}}", "{{job}} (5 m)"),
       (f"rlbatch_sla_attainment_ratio{{{SIDECAR}}}", "{{instance}} (the controller's window)")),
    _p("SLA and goodput", "TTFT P99 per bucket against the SLA", "s",
       (f"histogram_quantile(0.99, job_bucket_le:rlbatch_time_to_first_token_seconds_bucket"
        f":rate5m{{{JOB}}})", "{{job}} {{bucket}} (streamed, 5 m)"),
       (f"rlbatch_ttft_p99_seconds{{{SIDECAR}}}", "{{instance}} {{bucket}} (window)"),
       (f'max(rlbatch_sla_target_seconds{{{SIDECAR}, metric="ttft"}})', "SLA")),
    _p("SLA and goodput", "TPOT P99 per bucket against the SLA", "s",
       (f"rlbatch_tpot_p99_seconds{{{SIDECAR}}}", "{{instance}} {{bucket}} (window)"),
       (f'max(rlbatch_sla_target_seconds{{{SIDECAR}, metric="tpot"}})', "SLA")),
    _p("SLA and goodput", "Time to first token of streamed requests (distribution)", "s",
       (f"sum by (le) (rate(rlbatch_time_to_first_token_seconds_bucket{{{SIDECAR}}}[{RATE}]))",
        "{{le}}"), kind="heatmap"),
    _p("SLA and goodput", "Requests by outcome (per second)", "reqps",
       (f"sum by (outcome) (rate(rlbatch_requests_total{{{SIDECAR}}}[{RATE}]))",
        "{{outcome}}")),
    _p("SLA and goodput", "Rejections by reason (per second)", "reqps",
       (f'sum by (outcome, bucket) (rate(rlbatch_requests_total{{{SIDECAR}, '
        f'outcome=~"{REJECTED}"}}[{RATE}]))', "{{outcome}} {{bucket}}")),
    _p("SLA and goodput", "Tokens per second of the upstreams, per pool", "short",
       (f"job_pool:rlbatch_generation_tokens:rate5m{{{JOB}}}", "output {{pool}} (5 m)"),
       (f"job_pool:rlbatch_prompt_tokens:rate5m{{{JOB}}}", "prompt {{pool}} (5 m)")),
    _p("Control", "Controller in charge", "short",
       (f"rlbatch_controller_info{{{SIDECAR}}}", "{{instance}} {{controller}}"), kind="table"),
    _p("Control", "Batch cap in force per bucket and pool (none: no cap)", "short",
       (f"rlbatch_batch_cap{{{SIDECAR}}}", "{{instance}} {{bucket}} @ {{pool}}")),
    _p("Control", "Routes: the pools each bucket's requests may go to", "short",
       (f"rlbatch_bucket_routed{{{SIDECAR}}} == 1", "{{instance}} {{bucket}} -> {{pool}}")),
    _p("Control", "Queue length per bucket", "short",
       (f"sum by (bucket) (rlbatch_queue_length{{{SIDECAR}}})", "{{bucket}}")),
    _p("Control", "Queue wait per bucket (P99; oldest waiting)", "s",
       (f"histogram_quantile(0.99, sum by (le, bucket) "
        f"(rate(rlbatch_request_queue_time_seconds_bucket{{{SIDECAR}}}[{RATE}])))",
        "P99 {{bucket}}"),
       (f"max by (bucket) (rlbatch_oldest_wait_seconds{{{SIDECAR}}})", "oldest {{bucket}}"),
       (f"max by (instance) (rlbatch_oldest_unserved_seconds{{{SIDECAR}}})",
        "oldest not forwarded {{instance}}")),
    _p("Control", "KV committed (share of the pool) and KV budget holding requests back",
       "percentunit",
       (f"rlbatch_kv_committed_ratio{{{SIDECAR}}}", "committed {{instance}}"),
       (f"rlbatch_kv_budget_blocked{{{SIDECAR}}}", "budget blocked {{instance}}")),
    _p("Control", "Guard overrides by rule (per second)", "ops",
       (f"sum by (rule) (rate(rlbatch_guard_overrides_total{{{SIDECAR}}}[{RATE}]))",
        "{{rule}}")),
    _p("Control", "TPOT rule: its ceiling on the total, and the requests running", "short",
       (f"sum by (instance) (rlbatch_requests_running{{{SIDECAR}}})", "running {{instance}}"),
       (f"rlbatch_tpot_fit_ceiling{{{SIDECAR}}}", "ceiling {{instance}}")),
    _p("Control", "TPOT rule: observed over predicted iteration time (x spread allowance)",
       "short", (f"rlbatch_tpot_fit_slowdown{{{SIDECAR}}}", "{{instance}}")),
    _p("Control", "Fallback ticks (share of control ticks; ticks in the interval)", "short",
       (f"instance:rlbatch_fallback_ticks:ratio_rate5m{{{SIDECAR}}}", "share {{instance}}"),
       (f"sum by (instance) (increase(rlbatch_fallback_ticks_total{{{SIDECAR}}}[{RATE}]))",
        "ticks {{instance}}")),
    _p("Control", "Decision time (P50, P99)", "s",
       (f"histogram_quantile(0.5, sum by (le) "
        f"(rate(rlbatch_decision_seconds_bucket{{{SIDECAR}}}[{RATE}])))", "P50"),
       (f"histogram_quantile(0.99, sum by (le) "
        f"(rate(rlbatch_decision_seconds_bucket{{{SIDECAR}}}[{RATE}])))", "P99")),
    _p("Control", "Shadow mode: buckets whose decision is not in force", "short",
       (f"rlbatch_decision_differs{{{SIDECAR}}}", "{{instance}} {{bucket}}"),
       (f"rlbatch_shadow_mode{{{SIDECAR}}}", "shadow mode {{instance}}")),
    _p("Upstreams", "Upstream health: reachable, ejections, scrape failures, retries", "short",
       (f"rlbatch_upstream_up{{{SIDECAR}}}", "up {{instance}} {{upstream}}"),
       (f"sum by (upstream) (increase(rlbatch_upstream_ejections_total{{{SIDECAR}}}[{RATE}]))",
        "ejections {{upstream}}"),
       (f"sum by (upstream) (increase(rlbatch_scrape_failures_total{{{SIDECAR}}}[{RATE}]))",
        "scrape failures {{upstream}}"),
       (f"sum by (pool) (increase(rlbatch_upstream_retries_total{{{SIDECAR}}}[{RATE}]))",
        "retries {{pool}}")),
    _p("Upstreams", "KV cache usage per pool, as the sidecar reads it", "percentunit",
       (f"rlbatch_kv_cache_usage_ratio{{{SIDECAR}}}", "{{instance}} {{pool}}")),
    _p("Upstreams", "vLLM running and waiting requests", "short",
       (f"sum by (instance) (vllm:num_requests_running{{{VLLM}}})", "running {{instance}}"),
       (f"sum by (instance) (vllm:num_requests_waiting{{{VLLM}}})", "waiting {{instance}}")),
    _p("Upstreams", "vLLM KV cache usage", "percentunit",
       (f"max by (instance) (vllm:kv_cache_usage_perc{{{VLLM}}})", "{{instance}}")),
    _p("Upstreams", "vLLM preemptions (per second)", "ops",
       (f"sum by (instance) (rate(vllm:num_preemptions_total{{{VLLM}}}[{RATE}]))",
        "{{instance}}")),
    _p("Limits", "Limit trips (per second)", "ops",
       (f"sum by (limit) (rate(rlbatch_limit_trips_total{{{SIDECAR}}}[{RATE}]))", "{{limit}}")),
    _p("Limits", "Request bytes held, connections open, prompts being counted", "short",
       (f"rlbatch_held_body_bytes{{{SIDECAR}}}", "held bytes {{instance}}"),
       (f"rlbatch_connections_open{{{SIDECAR}}}", "connections {{instance}}"),
       (f"rlbatch_requests_counting{{{SIDECAR}}}", "counting {{instance}}")),
    _p("Limits", "Scrape targets up (sidecars, vLLM servers)", "short",
       (f"up{{{SIDECAR}}}", "{{job}} {{instance}}"),
       (f"up{{{VLLM}}}", "{{job}} {{instance}}")),
)
"""Every panel, in display order."""

VARIABLES: tuple[tuple[str, str, str, str | None], ...] = (
    # Outside Kubernetes there is no namespace label: "All" must match its absence.
    ("namespace", "Namespace", "label_values(rlbatch_controller_info, namespace)", ".*"),
    ("job", "Sidecar job", 'label_values(rlbatch_controller_info{namespace=~"$namespace"}, job)',
     None),
    ("instance", "Sidecar replica",
     f"label_values(rlbatch_controller_info{{{JOB}}}, instance)", None),
    ("vllm_job", "vLLM job",
     'label_values(vllm:num_requests_running{namespace=~"$namespace"}, job)', None),
)
"""``(name, label, query, value of "All")``: each a multi-value query variable (``None``: "All"
is every value the query finds)."""


def _datasource() -> model.DataSourceRef:
    return model.DataSourceRef(type_val="prometheus", uid="${datasource}")


def _query(expr: str, legend: str, ref: int, kind: PanelKind) -> prometheus.Dataquery:
    query = (prometheus.Dataquery().expr(expr).legend_format(legend)
             .ref_id(chr(ord("A") + ref)).datasource(_datasource()))
    if kind == "heatmap":
        return query.format(PromQueryFormat.HEATMAP)
    if kind == "table":
        return query.instant().format(PromQueryFormat.TABLE)
    return query.range()


def _panel(spec: Panel, pid: int) -> Any:
    builder: Any
    if spec.kind == "heatmap":
        builder = heatmap.Panel().calculate(False).y_axis(heatmap.YAxisConfig().unit(spec.unit))
    elif spec.kind == "table":
        builder = table.Panel()
    else:
        builder = timeseries.Panel().unit(spec.unit).legend(
            common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM).show_legend(True))
    builder = builder.id(pid).title(spec.title).datasource(_datasource()).height(8).span(12)
    for i, (expr, legend) in enumerate(spec.targets):
        builder = builder.with_target(_query(expr, legend, i, spec.kind))
    return builder


def _variable(name: str, label: str, query: str, all_value: str | None) -> dash.QueryVariable:
    var = (dash.QueryVariable(name).label(label).query(query).datasource(_datasource())
           .multi(True).include_all(True).refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
           .sort(model.VariableSort.ALPHABETICAL_ASC)
           .current(model.VariableOption(selected=True, text="All", value="$__all")))
    return var.all_value(all_value) if all_value is not None else var


def dashboard() -> dict[str, Any]:
    """The dashboard model, as Grafana's JSON."""
    board = (dash.Dashboard("rlbatch sidecar").uid("rlbatch-sidecar").tags(["rlbatch", "vllm"])
             .editable().time("now-1h", "now").refresh("10s").version(1)
             .with_variable(dash.DatasourceVariable("datasource").label("Prometheus")
                            .type("prometheus")))
    for name, label, query, all_value in VARIABLES:
        board = board.with_variable(_variable(name, label, query, all_value))
    row = ""
    for pid, spec in enumerate(PANELS, start=1):
        if spec.row != row:  # an open row: its panels follow it on the dashboard
            row = spec.row
            board = board.with_row(dash.Row(row).id(100 + pid))
        board = board.with_panel(_panel(spec, pid))
    encoded: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return encoded


def render() -> str:
    """The JSON text, as written."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
