"""Issue 13: every request bounded in memory and time (no vLLM needed); the options and the
Kubernetes example that set the bounds. The closed control plane and the smaller holes are in
``tests/test_sidecar_protocol.py``.

Each test reproduces one hole of the issue (it fails on the sidecar as it was) and checks
the limit's answer exactly: the status, the OpenAI-style error and the
``rlbatch_limit_trips_total{limit}`` sample that counts it. Faults a real vLLM cannot produce
on demand (a ``/tokenize`` or completion that never answers, a stream that stalls, a 200
that is not JSON) come from :class:`~tests.fake_upstream.FakeUpstream`; the rest needs only
raw sockets. Figures (RSS per held byte, descriptors under slowloris) are measured by
``benchmarks/sidecar_limits.py``, not asserted on time here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import aiohttp
import psutil
import pytest
from aiohttp import web

from rlbatch.sidecar.options import add_production_options, production_settings
from tests.fake_upstream import FakeUpstream, Faults
from tests.sidecar_live_support import child_sidecar
from tests.test_sidecar import (
    REPO,
    fakes,
    make_settings,
    post,
    running_sidecar,
    sample,
    until,
)

TOKEN = "t" * 24
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def trips(sidecar: object, limit: str) -> float:
    return sample(sidecar, "rlbatch_limit_trips_total", limit=limit)  # type: ignore[arg-type]


def error_of(data: bytes) -> dict[str, object]:
    error = json.loads(data)["error"]
    assert isinstance(error, dict)
    return error


async def raw_connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not
    close it within ``within_s``: a bound on the assertion, not a measured time)."""
    data = b""
    async with asyncio.timeout(within_s):
        while chunk := await reader.read(65536):
            data += chunk
    return data


class FakeReplica(FakeUpstream):
    """:class:`FakeUpstream` with the faults of a replica that answers more than a sidecar
    can hold or never ends an event, and of one whose ``/health`` fails: none of them can be
    had from a real vLLM on demand.

    :param answer_bytes: a non-streamed answer carries this many bytes of text, sent 1 MiB at
        a time (0: the fake's usual answer).
    :param cut_after: the connection is closed after this many bytes of the text (0: never).
    :param stream_tail: a stream's third event never ends: ``unterminated`` (``tail_bytes`` of
        it as fast as they go, then the end) or ``dribble`` (a byte every 50 ms, forever);
        ``none``: the fake's usual stream.
    :param tail_bytes: size of the ``unterminated`` event.
    :param health: ``ok``, ``hang`` (``/health`` never answers) or ``error`` (503).

    Like vLLM it takes request heads of any size (aiohttp's default refuses a header line
    over 8 KB).
    """

    def __init__(self, faults: Faults | None = None, *, answer_bytes: int = 0,
                 cut_after: int = 0,
                 stream_tail: Literal["none", "unterminated", "dribble"] = "none",
                 tail_bytes: int = 0, health: Literal["ok", "hang", "error"] = "ok") -> None:
        super().__init__(faults=faults)
        self.answer_bytes = answer_bytes
        self.cut_after = cut_after
        self.stream_tail = stream_tail
        self.tail_bytes = tail_bytes
        self.health = health
        self.health_calls = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                     max_line_size=2**24, max_field_size=2**24)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        if self.health == "hang":
            await asyncio.Event().wait()
        return web.Response(status=503 if self.health == "error" else 200, text="")

    async def _answer(self, request: web.Request,
                      body: dict[str, object]) -> web.StreamResponse:
        if body.get("stream") and self.stream_tail != "none":
            return await self._endless_event(request)
        if not body.get("stream") and self.answer_bytes:
            return await self._big_answer(request)
        return await super()._answer(request, body)

    async def _big_answer(self, request: web.Request) -> web.StreamResponse:
        head = (b'{"id":"cmpl-fake","object":"text_completion","model":"fake","choices":'
                b'[{"index":0,"text":"')
        tail = (b'","finish_reason":"length"}],"usage":{"prompt_tokens":5,"total_tokens":8,'
                b'"completion_tokens":3}}')
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        out.content_length = len(head) + self.answer_bytes + len(tail)
        await out.prepare(request)
        await out.write(head)
        block = b"t" * 2**20
        left = self.answer_bytes
        while left:
            await out.write(block[:min(left, len(block))])
            left -= min(left, len(block))
            if self.cut_after and self.answer_bytes - left >= self.cut_after:
                assert request.transport is not None
                request.transport.close()
                raise asyncio.CancelledError
        await out.write(tail)
        await out.write_eof()
        return out

    async def _endless_event(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(2):
            await out.write(b'data: {"id":"cmpl-fake","choices":[{"index":0,"text":"t%d",'
                            b'"finish_reason":null}]}\n\n' % i)
        await out.write(b'data: {"id":"cmpl-fake","choices":[{"index":0,"text":"')
        if self.stream_tail == "dribble":
            while True:
                await asyncio.sleep(0.05)
                await out.write(b"t")
        block = b"t" * 2**16
        for _ in range(self.tail_bytes // len(block)):
            await out.write(block)
        await out.write(b'","finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
        await out.write_eof()
        return out


@contextlib.asynccontextmanager
async def fake_replicas(*replicas: FakeReplica) -> AsyncIterator[tuple[FakeReplica, ...]]:
    for r in replicas:
        await r.start()
    try:
        yield replicas
    finally:
        for r in replicas:
            await r.stop()


# ------------------------------------------------------------------ 1. memory per request
def test_body_cap_is_an_option_and_answers_json_413() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), max_body_bytes=4096,
                                     max_held_bytes=8192)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                status, data, _ = await post(s, url, {"prompt": "x" * 5000})
                assert status == 413
                error = error_of(data)
                assert error["code"] == 413 and "4096" in str(error["message"])
                assert trips(sidecar, "body_size") == 1
                assert up.counters.requests == 0

    asyncio.run(scenario())


def test_held_bytes_budget_refuses_before_queueing() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            body_len = 40_000
            settings = make_settings(("fp16", up.url), max_body_bytes=50_000,
                                     max_held_bytes=100_000, approx_bytes_per_token=100.0,
                                     queue_timeout_s=30.0)
            async with running_sidecar(settings, "static:1") as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                words = " ".join(["w"] * (body_len // 2))
                first = asyncio.create_task(post(s, url, {"prompt": words, "max_tokens": 1}))
                await until(lambda: up.counters.running == 1)
                second = asyncio.create_task(post(s, url, {"prompt": words, "max_tokens": 1}))
                await until(lambda: sample(sidecar, "rlbatch_held_body_bytes") > 2 * body_len)
                status, data, headers = await post(s, url, {"prompt": words, "max_tokens": 1})
                assert status == 429 and headers.get("Retry-After") == "1"
                assert "held" in str(error_of(data)["message"])
                assert trips(sidecar, "held_bytes") == 1
                for task in (first, second):
                    task.cancel()
                await asyncio.gather(first, second, return_exceptions=True)
                await until(lambda: sample(sidecar, "rlbatch_held_body_bytes") == 0)

    asyncio.run(scenario())


def test_prompt_certainly_over_length_is_refused_without_tokenising() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            # /v1/models says max_model_len 4096; 4096 * 4 chars is the most 4096 tokens of a
            # vocabulary whose longest token has 4 characters can span (vLLM's own check).
            settings = make_settings(("fp16", up.url), tokenizer="upstream",
                                     max_chars_per_token=4)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                status, data, _ = await post(s, url, {"prompt": "x" * (4096 * 4 + 1)})
                assert status == 400, data
                error = error_of(data)
                assert "maximum context length is 4096 tokens" in str(error["message"])
                assert up.counters.tokenize_calls == 0 and up.counters.requests == 0
                assert sample(sidecar, "rlbatch_rejections_total", bucket="512+") >= 0

    asyncio.run(scenario())


# ------------------------------------------------------------------ 2. client read timeouts
def test_slow_header_slow_body_and_idle_keepalive_connections_are_closed() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), header_timeout_s=0.3,
                                     body_timeout_s=0.3, keepalive_timeout_s=0.3)
            async with running_sidecar(settings) as (url, sidecar):
                # Slow header: a request line and one header, then nothing.
                reader, writer = await raw_connect(url)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                await writer.drain()
                assert await closed_by_server(reader) == b""
                writer.close()
                # Slow body: the head promises 100 bytes, 10 come.
                reader, writer = await raw_connect(url)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
                await writer.drain()
                answer = await closed_by_server(reader)
                assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
                assert b'"code": 408' in answer
                writer.close()
                # Keep-alive: a served connection that stays idle is closed.
                reader, writer = await raw_connect(url)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                answer = await closed_by_server(reader)
                assert answer.startswith(b"HTTP/1.1 200")
                writer.close()
                assert trips(sidecar, "header_timeout") == 1
                assert trips(sidecar, "body_timeout") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # serve.py runs on uvloop
def test_connection_limit_closes_idle_connections_first(loop: str) -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), max_connections=8,
                                     header_timeout_s=60.0, keepalive_timeout_s=60.0)
            async with running_sidecar(settings) as (url, sidecar):
                idle = [await raw_connect(url) for _ in range(20)]
                await until(lambda: trips(sidecar, "connections") >= 12)
                # A client arriving now evicts an idle connection and is served.
                async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                    assert r.status == 200
                assert sample(sidecar, "rlbatch_connections_open") <= 8
                closed = 0
                for reader, writer in idle:
                    try:
                        async with asyncio.timeout(0.5):
                            closed += await reader.read(1) == b""
                    except TimeoutError:
                        pass
                    writer.close()
                assert closed >= 13  # 12 evicted for the idle ones, 1 for the /health client

    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(scenario())
    else:
        asyncio.run(scenario())


# ------------------------------------------------------------------ 3. bounded tokenize
def test_hanging_tokenize_falls_back_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with fakes(Faults(tokenize="hang")) as (up,):
            settings = make_settings(("fp16", up.url), tokenizer="upstream",
                                     tokenize_timeout_s=0.3)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                for _ in range(2):
                    status, data, _ = await post(s, url, {"prompt": "a b c", "max_tokens": 2})
                    assert status == 200, data
                assert up.counters.tokenize_calls == 2
                assert trips(sidecar, "tokenize_timeout") == 2
                assert sample(sidecar, "rlbatch_requests_counting") == 0

    with caplog.at_level(logging.WARNING, logger="rlbatch.sidecar"):
        asyncio.run(scenario())
    assert caplog.text.count("/tokenize") == 1  # logged once per failure run


# ------------------------------------------------------------------ 4. upstream timeouts
def test_upstream_first_byte_and_idle_timeouts_not_a_total() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            settings = make_settings(("fp16", up.url), first_byte_timeout_s=0.3,
                                     idle_timeout_s=0.5)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                status, data, _ = await post(s, url, {"prompt": "x"})
                assert status == 504, data
                message = str(error_of(data)["message"])
                assert message == ("upstream fp16#0: no answer within 0.3 s "
                                   "(--first-byte-timeout-s)")  # named, its URL not shown
                assert trips(sidecar, "upstream_first_byte") == 1
                assert up.counters.requests == 1  # a timed-out request is not sent twice
                # A healthy stream longer than every limit, chunks 0.05 s apart: complete.
                up.faults = Faults(tokens=20, chunk_interval_s=0.05)
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200 and data.count(b'"text":"t') == 20
                assert data.endswith(b"data: [DONE]\n\n") and b"error" not in data
                # A stream that stalls after two chunks ends with an error event.
                up.faults = Faults("stall_midstream", tokens=5)
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200 and b"no data for 0.5 s" in data
                assert data.endswith(b"data: [DONE]\n\n")
                assert trips(sidecar, "upstream_idle") == 1
                assert sidecar.tickets == {}

    asyncio.run(scenario())


def test_total_request_timeout_is_opt_in_and_says_why() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            settings = make_settings(("fp16", up.url), request_timeout_s=0.4)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                status, data, _ = await post(s, url, {"prompt": "x"})
                assert status == 504, data
                message = str(error_of(data)["message"])
                assert message.endswith("did not finish within 0.4 s (--request-timeout-s)")
                assert trips(sidecar, "upstream_total") == 1
                up.faults = Faults(tokens=40, chunk_interval_s=0.05)  # a 2 s stream: cut
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200 and b"--request-timeout-s" in data
                assert data.endswith(b"data: [DONE]\n\n")
                assert trips(sidecar, "upstream_total") == 2

    asyncio.run(scenario())


# ------------------------------------------------------------------ options
def test_cli_limits_and_dev_zero_policy(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_production_options(parser)
    args = parser.parse_args(["--max-body-bytes", "1024", "--max-held-bytes", "4096",
                              "--header-timeout-s", "2", "--policy-dir", str(tmp_path),
                              "--max-connections", "100", "--idle-timeout-s", "7"])
    fields = production_settings(args)
    settings = make_settings(("fp16", "http://127.0.0.1:9"), **fields)
    assert (settings.max_body_bytes, settings.max_held_bytes, settings.max_connections) == (
        1024, 4096, 100)
    assert settings.header_timeout_s == 2.0 and settings.idle_timeout_s == 7.0
    assert settings.policy_dirs == (tmp_path.resolve(),)
    assert settings.first_byte_timeout_s == 600.0 and settings.keepalive_timeout_s == 5.0
    with pytest.raises(ValueError, match="max_held_bytes"):
        make_settings(("fp16", "http://127.0.0.1:9"), max_body_bytes=10, max_held_bytes=5)
    with pytest.raises(ValueError, match="16 characters"):
        make_settings(("fp16", "http://127.0.0.1:9"), admin_token="short")
    # serve.py --policy /dev/zero: refused before anything reads it (it read until
    # MemoryError; the address-space limit makes that quick instead of eating the machine).
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run(
        [sys.executable, str(REPO / "serve.py"), "--upstream", "fp16=http://127.0.0.1:9",
         "--policy", "/dev/zero"], capture_output=True, text=True, timeout=60,
        preexec_fn=limit_memory)
    assert done.returncode == 2 and "not a folder" in done.stderr, done.stderr[-500:]


def test_kubernetes_manifest_args_are_valid_sidecar_settings() -> None:
    import argparse

    import yaml

    from rlbatch.commands.serve import add_arguments, settings_from_args

    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "rlbatch-sidecar.yaml")
                                   .read_text()))
    pod = docs[0]["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "rlbatch-sidecar")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"])
    args.admin_token = "s" * 32  # from the Secret in the pod
    settings = settings_from_args(args)
    assert settings.metrics_port == 9090 and settings.policy_dirs == (Path("/policies"),)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port, "metrics": settings.metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
    assert container["resources"]["limits"]["memory"] == "512Mi"
    service = docs[1]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


# ------------------------------------------------------------------ slow uploads
def test_slow_uploads_that_announce_the_body_cap_leave_other_requests_served() -> None:
    """Four connections announce a body at the cap (4 x 16 MiB is the whole held-bytes
    budget) and send a byte every 0.2 s: other requests are still served, and the bytes
    held are the bytes received, not the bytes announced."""
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url))  # 16 MiB body cap, 64 MiB budget
            async with running_sidecar(settings) as (url, sidecar):
                assert settings.max_held_bytes == 4 * settings.max_body_bytes
                slow = [await raw_connect(url) for _ in range(4)]
                for _, writer in slow:
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n{"
                                 % settings.max_body_bytes)
                await until(lambda: sample(sidecar, "rlbatch_held_body_bytes") >= 4)

                async def trickle() -> None:
                    while True:
                        for _, writer in slow:
                            writer.write(b" ")
                        await asyncio.sleep(0.2)

                dribble = asyncio.create_task(trickle())
                started = time.monotonic()
                async with aiohttp.ClientSession() as s:
                    for _ in range(3):
                        status, data, _ = await post(s, url, {"prompt": "x", "max_tokens": 2})
                        assert status == 200, data
                elapsed_ms = 1000 * (time.monotonic() - started)
                print(f"3 requests beside 4 slow uploads: {elapsed_ms:.0f} ms")
                assert trips(sidecar, "held_bytes") == 0
                assert sample(sidecar, "rlbatch_held_body_bytes") < 1024
                dribble.cancel()
                for _, writer in slow:
                    writer.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ upstream answers bounded
def test_four_150_mib_answers_pass_through_in_bounded_memory(tmp_path: Path) -> None:
    """Four concurrent non-streamed answers of 150 MiB each: the sidecar (a child process,
    as deployed) stays under the 512 MiB the Kubernetes manifest gives it."""
    size = 150 * 2**20

    async def scenario() -> None:
        async with fake_replicas(FakeReplica(answer_bytes=size)) as (up,), \
                child_sidecar([f"fp16={up.url}"], tmp_path, "--controller", "static:8") as (
                    url, pid):
            proc = psutil.Process(pid)
            base = proc.memory_info().rss
            peak = base
            done = False

            async def watch() -> None:
                nonlocal peak
                while not done:
                    peak = max(peak, proc.memory_info().rss)
                    await asyncio.sleep(0.02)

            async def one(s: aiohttp.ClientSession) -> tuple[int, int, bytes]:
                async with s.post(url + "/v1/completions",
                                  json={"prompt": "x", "max_tokens": 3}) as r:
                    received, tail = 0, b""
                    async for chunk in r.content.iter_any():
                        received += len(chunk)
                        tail = (tail + chunk)[-200:]
                    return r.status, received, tail

            watcher = asyncio.create_task(watch())
            started = time.monotonic()
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                answers = await asyncio.gather(*(one(s) for _ in range(4)))
            elapsed = time.monotonic() - started
            done = True
            await watcher
            print(f"4 x 150 MiB answers in {elapsed:.1f} s; sidecar RSS "
                  f"{base / 2**20:.0f} MiB -> peak {peak / 2**20:.0f} MiB")
            for status, received, tail in answers:
                assert status == 200
                assert received > size and tail.endswith(b'"completion_tokens":3}}')
            assert peak < 512 * 2**20

    asyncio.run(scenario())


def test_answer_cut_mid_body_reaches_the_client_broken_not_short(
        caplog: pytest.LogCaptureFixture) -> None:
    """An answer too long to hold whole is relayed as it arrives, so when the upstream cuts
    it (after 2 MiB of 8) it cannot become a 502 any more: the client's connection is
    closed, so it sees a broken answer (not a short one that looks whole), and the request
    counts as an upstream error. (A short answer cut is still a 502.)"""
    async def scenario() -> None:
        replica = FakeReplica(answer_bytes=8 * 2**20, cut_after=2 * 2**20)
        async with fake_replicas(replica) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
            await until(lambda: sample(sidecar, "rlbatch_requests_total", bucket="0-128",
                                       outcome="upstream_error") == 1)
            assert sidecar.upstreams[0].failures == 1 and sidecar.tickets == {}

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_stream_event_without_end_is_bounded() -> None:
    """An upstream stream whose third event never ends (20 MiB without a blank line): the
    sidecar stops reading at --max-event-bytes and ends the stream with an error event,
    instead of holding (and re-scanning) all of it."""
    async def scenario() -> None:
        async with fake_replicas(FakeReplica(stream_tail="unterminated",
                                             tail_bytes=20 * 2**20)) as (up,):
            settings = make_settings(("fp16", up.url), max_event_bytes=2**20)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200
                events = data.split(b"\n\n")
                assert [e.count(b'"text":"t') for e in events[:2]] == [1, 1]
                assert events[2].startswith(b'data: {"error"')
                assert b"event longer than 1048576 bytes" in events[2]
                assert events[3:] == [b"data: [DONE]", b""]
                assert trips(sidecar, "event_size") == 1
                await until(lambda: up.counters.cancelled == 1)  # not read to its end
                assert sidecar.tickets == {}

    asyncio.run(scenario())


def test_stream_that_dribbles_bytes_without_an_event_ends_at_the_idle_limit() -> None:
    """An upstream stream that sends a byte every 50 ms and never ends its event sends the
    client nothing: the idle limit counts from the last event passed on, not the last byte."""
    async def scenario() -> None:
        async with fake_replicas(FakeReplica(stream_tail="dribble")) as (up,):
            settings = make_settings(("fp16", up.url), idle_timeout_s=0.5)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200
                events = data.split(b"\n\n")
                assert events[2].startswith(b'data: {"error"') and b"no data for 0.5 s" in data
                assert events[3:] == [b"data: [DONE]", b""]
                assert trips(sidecar, "upstream_idle") == 1
                await until(lambda: up.counters.cancelled == 1)

    asyncio.run(scenario())


# ------------------------------------------------------------------ degraded paths
def test_tokenize_breaker_stops_calling_a_hung_tokenize_and_tries_it_again() -> None:
    async def scenario() -> None:
        async with fakes(Faults(tokenize="hang")) as (up,):
            settings = make_settings(("fp16", up.url), tokenizer="upstream",
                                     tokenize_timeout_s=0.3, tokenize_breaker_failures=3,
                                     tokenize_breaker_s=1.0)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                for _ in range(8):
                    status, data, _ = await post(s, url, {"prompt": "a b c", "max_tokens": 2})
                    assert status == 200, data
                # three timed out; the breaker then counts approximately without calling
                assert up.counters.tokenize_calls == 3
                assert trips(sidecar, "tokenize_timeout") == 3
                assert trips(sidecar, "tokenize_breaker") == 5
                up.faults.tokenize = "none"  # it answers again
                await asyncio.sleep(1.1)  # the breaker's wait
                for _ in range(2):
                    status, data, _ = await post(s, url, {"prompt": "a b c", "max_tokens": 2})
                    assert status == 200, data
                assert up.counters.tokenize_calls == 5  # one try, which closed the breaker

    asyncio.run(scenario())


def test_requests_refused_at_admission_are_not_tokenised() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            settings = make_settings(("fp16", up.url), tokenizer="upstream", max_queue_len=1)
            async with running_sidecar(settings, "static:1") as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                first = asyncio.create_task(post(s, url, {"prompt": "x"}))  # runs (hangs)
                await until(lambda: up.counters.running == 1)
                second = asyncio.create_task(post(s, url, {"prompt": "x"}))  # waits
                await until(lambda: sidecar.upstreams[0].waiting_total == 1)
                assert up.counters.tokenize_calls == 2
                for _ in range(3):  # the queue is full whatever their length
                    status, data, _ = await post(s, url, {"prompt": "x " * 50})
                    assert status == 429 and "is full" in str(error_of(data)["message"])
                assert up.counters.tokenize_calls == 2
                assert sample(sidecar, "rlbatch_requests_total", bucket="0-128",
                              outcome="rejected_queue_full") == 3
                for task in (first, second):
                    task.cancel()
                await asyncio.gather(first, second, return_exceptions=True)

    asyncio.run(scenario())


def test_request_head_trickled_after_a_keep_alive_gets_the_header_timeout() -> None:
    """The keep-alive limit applies to an idle connection; once a request's head starts,
    the head's own limit applies (it used to be closed at the keep-alive limit)."""
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), keepalive_timeout_s=0.3,
                                     header_timeout_s=3.0)
            async with running_sidecar(settings) as (url, sidecar):
                reader, writer = await raw_connect(url)
                head = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                writer.write(head)
                assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
                await asyncio.sleep(0.1)  # idle less than the keep-alive limit
                for i in range(0, len(head), 2):  # 1.5 s for the next head
                    writer.write(head[i:i + 2])
                    await asyncio.sleep(0.1)
                answer = await reader.readuntil(b"}")
                assert answer.startswith(b"HTTP/1.1 200"), answer
                assert await closed_by_server(reader) == b""  # then idle: closed
                writer.close()
                assert trips(sidecar, "header_timeout") == 0

    asyncio.run(scenario())
