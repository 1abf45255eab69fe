"""Build ``deploy/grafana/rlbatch-sidecar.json``, the Grafana dashboard of the sidecar and its
vLLM upstreams, from the panel list below (plain Python, no library: the JSON is Grafana's
dashboard model, schema 39, one Prometheus data source chosen by the ``datasource`` variable).

    .venv/bin/python deploy/grafana/build_dashboard.py          # rewrite the JSON
    .venv/bin/python deploy/grafana/build_dashboard.py --check  # fail if it is stale

``tests/test_sidecar_prometheus.py`` checks the file is what this script builds, and runs every
query against a real Prometheus scraping the sidecar and a real vLLM server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("rlbatch-sidecar.json")

# (row, title, unit, [(expr, legend)])
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Control", "Batch cap in force per bucket and pool (+Inf: no cap)", "short",
     [("rlbatch:batch_cap > 0", "{{bucket}} @ {{pool}}")]),
    ("Control", "Queue length per bucket", "short",
     [("rlbatch:queue_length", "{{bucket}}")]),
    ("Control", "Queue wait per bucket (P99 over 1 m; oldest waiting)", "s",
     [("histogram_quantile(0.99, sum by (le, bucket) "
       "(rate(rlbatch:request_queue_time_seconds_bucket[1m])))", "P99 {{bucket}}"),
      ("rlbatch:oldest_wait_seconds", "oldest {{bucket}}"),
      ("rlbatch:oldest_unserved_seconds", "oldest not forwarded (any bucket)")]),
    ("Control", "Guard overrides by rule (per second)", "ops",
     [("sum by (rule) (rate(rlbatch:guard_overrides_total[5m]))", "{{rule}}")]),
    ("Control", "Decision time (P50, P99 over 5 m)", "s",
     [("histogram_quantile(0.5, rate(rlbatch:decision_seconds_bucket[5m]))", "P50"),
      ("histogram_quantile(0.99, rate(rlbatch:decision_seconds_bucket[5m]))", "P99")]),
    ("Control", "Shadow mode: buckets where the decision differs from the caps in force",
     "short", [("sum by (bucket) (rlbatch:decided_batch_cap != bool rlbatch:batch_cap)",
                "{{bucket}}"),
               ("rlbatch:shadow_mode", "shadow mode on")]),
    ("SLA", "TTFT P99 per bucket against the SLA", "s",
     [("rlbatch:ttft_p99_seconds", "{{bucket}}"),
      ('rlbatch:sla_target_seconds{metric="ttft"}', "SLA")]),
    ("SLA", "TPOT P99 per bucket against the SLA", "s",
     [("rlbatch:tpot_p99_seconds", "{{bucket}}"),
      ('rlbatch:sla_target_seconds{metric="tpot"}', "SLA")]),
    ("SLA", "Goodput (finished requests meeting the SLA per second) and attainment",
     "reqps", [("rate(rlbatch:finished_total[1m]) * on() rlbatch:sla_attainment", "goodput"),
               ("rlbatch:sla_attainment", "SLA attainment")]),
    ("SLA", "Requests by outcome (per second)", "reqps",
     [("sum by (outcome) (rate(rlbatch:requests_total[1m]))", "{{outcome}}")]),
    ("vLLM", "vLLM running and waiting requests", "short",
     [("sum by (instance) (vllm:num_requests_running)", "running {{instance}}"),
      ("sum by (instance) (vllm:num_requests_waiting)", "waiting {{instance}}")]),
    ("vLLM", "vLLM KV cache usage", "percentunit",
     [("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}")]),
    ("vLLM", "vLLM preemptions (per second)", "ops",
     [("sum by (instance) (rate(vllm:num_preemptions_total[5m]))", "{{instance}}")]),
    ("Limits", "Limit trips (per second)", "ops",
     [("sum by (limit) (rate(rlbatch:limit_trips_total[5m]))", "{{limit}}")]),
    ("Limits", "Request bytes held, connections open, prompts being counted", "short",
     [("rlbatch:held_body_bytes", "held bytes"),
      ("rlbatch:connections_open", "connections"),
      ("rlbatch:requests_counting", "counting")]),
    ("Limits", "Scrapes: targets up, sidecar scrape failures of the upstreams", "short",
     [("up", "{{job}} {{instance}}"),
      ("sum by (upstream) (increase(rlbatch:scrape_failures_total[5m]))", "{{upstream}}")]),
]


def dashboard() -> dict[str, Any]:
    """The dashboard model."""
    panels: list[dict[str, Any]] = []
    y = 0
    row_seen: set[str] = set()
    x = 0
    for pid, (row, title, unit, targets) in enumerate(PANELS, start=1):
        if row not in row_seen:
            if x:
                y += 8
                x = 0
            row_seen.add(row)
            panels.append({"type": "row", "title": row, "collapsed": False, "id": 100 + pid,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y += 1
        panels.append({
            "type": "timeseries", "id": pid, "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for i, (expr, legend) in enumerate(targets)]})
        x = 12 - x
        if x == 0:
            y += 8
    return {
        "title": "rlbatch sidecar", "uid": "rlbatch-sidecar", "schemaVersion": 39,
        "version": 1, "editable": True, "tags": ["rlbatch", "vllm"],
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "annotations": {"list": []}, "panels": panels,
    }


def render() -> str:
    """The JSON text, as written."""
    return json.dumps(dashboard(), indent=2) + "\n"


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
