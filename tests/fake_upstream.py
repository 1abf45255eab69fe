"""A fake vLLM OpenAI server that injects faults, for the sidecar's tests and benchmark.

It covers the faults a real server cannot be made to produce on demand: a 500 answer, a
dropped connection before or in the middle of a response, a failing ``/metrics``, a response
that never comes. Everything else in the sidecar's tests runs against a real
``vllm.entrypoints.openai.api_server``.

The fake speaks just enough of vLLM's protocol: ``/v1/models`` (with ``max_model_len``),
``/metrics`` (the series :mod:`rlbatch.sidecar.vllm_metrics` reads, with the running count it
actually holds), ``/tokenize``, and ``/v1/completions`` / ``/v1/chat/completions`` that
answer ``tokens`` tokens (streamed or not) after ``delay_s``. It also serves as the
zero-cost upstream of the overhead benchmark's ``--upstream stub`` mode
(``benchmarks/bench_sidecar.py`` imports it from here: it is test code, not part of the
``rlbatch`` package).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

CompletionFault = Literal["none", "error500", "drop", "drop_midstream", "hang",
                          "stall_midstream", "bad_json", "garbage_stream"]


@dataclass
class Faults:
    """What the fake does wrong (changeable while it runs).

    :param completion: ``none``, ``error500`` (answer 500), ``drop`` (close the connection
        without an answer), ``drop_midstream`` (stream two chunks, then close), ``hang``
        (never answer), ``stall_midstream`` (stream two chunks, then send nothing more),
        ``bad_json`` (answer 200 with a body that is not JSON), ``garbage_stream`` (a 200
        stream of bytes that are not server-sent events, then close).
    :param metrics_status: HTTP status of ``/metrics`` (200 = healthy).
    :param delay_s: time before the first token.
    :param tokens: tokens per completion.
    :param chunk_interval_s: time between two streamed chunks.
    :param tokenize: ``none`` or ``hang`` (``/tokenize`` never answers).
    """

    completion: CompletionFault = "none"
    metrics_status: int = 200
    delay_s: float = 0.0
    tokens: int = 3
    chunk_interval_s: float = 0.0
    tokenize: Literal["none", "hang"] = "none"


@dataclass
class FakeCounters:
    """What the fake saw.

    :param requests: completion requests received.
    :param running: completion requests being answered now.
    :param peak_running: most at once.
    :param cancelled: requests whose client went away before the answer was complete.
    :param bodies: the completion request bodies received.
    :param tokenize_calls: ``/tokenize`` calls received.
    :param other: other requests received (method and path).
    """

    requests: int = 0
    running: int = 0
    peak_running: int = 0
    cancelled: int = 0
    bodies: list[dict[str, object]] = field(default_factory=list)
    tokenize_calls: int = 0
    other: list[str] = field(default_factory=list)


_CHUNK = ('data: {{"id":"cmpl-fake","object":"text_completion","model":"fake","choices":'
          '[{{"index":0,"text":"t{i}","finish_reason":{reason}}}]}}\n\n')
_USAGE = ('data: {{"id":"cmpl-fake","object":"text_completion","model":"fake","choices":[],'
          '"usage":{{"prompt_tokens":{p},"total_tokens":{t},"completion_tokens":{c}}}}}\n\n')


_RESP_EVENT = 'event: {type}\ndata: {{"type":"{type}"{rest}}}\n\n'


class FakeUpstream:
    """The fake server.

    :param max_model_len: what ``/v1/models`` reports.
    :param faults: initial faults (default: none).
    :param num_gpu_blocks: KV blocks (of 16 tokens) ``/metrics`` reports.
    """

    def __init__(self, max_model_len: int = 4096, faults: Faults | None = None,
                 num_gpu_blocks: int = 1000) -> None:
        self.max_model_len = max_model_len
        self.num_gpu_blocks = num_gpu_blocks
        self.faults = faults or Faults()
        self.counters = FakeCounters()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)  # vLLM has no body cap
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._other)
        app.router.add_get("/version", self._other)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/responses", self._completion)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the base URL.

        :param host: bind address.
        :param port: port.
        """
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "fake", "object": "model", "root": "fake", "max_model_len":
             self.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.faults.metrics_status != 200:
            return web.Response(status=self.faults.metrics_status, text="metrics broken")
        c = self.counters
        text = (
            f'vllm:num_requests_running{{engine="0",model_name="fake"}} {c.running}.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="fake"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} 0.1\n'
            f'vllm:num_preemptions_total{{engine="0",model_name="fake"}} 0.0\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="fake"}} {c.requests * 5}.0\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="fake"}} '
            f'{c.requests * self.faults.tokens}.0\n'
            f'vllm:cache_config_info{{block_size="16",engine="0",'
            f'num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0\n')
        return web.Response(text=text)

    async def _other(self, request: web.Request) -> web.Response:
        self.counters.other.append(f"{request.method} {request.path}")
        return web.json_response({"path": request.path})

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.counters.tokenize_calls += 1
        if self.faults.tokenize == "hang":
            await asyncio.Event().wait()
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        count = max(1, len(str(text).split()))
        return web.json_response({"count": count, "max_model_len": self.max_model_len})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        c = self.counters
        c.requests += 1
        c.bodies.append(body)
        c.running += 1
        c.peak_running = max(c.peak_running, c.running)
        finished = False
        try:
            response = await self._answer(request, body)
            finished = True
            return response
        finally:
            c.running -= 1
            if not finished:
                c.cancelled += 1

    async def _answer(self, request: web.Request, body: dict[str, object]) -> web.StreamResponse:
        f = self.faults
        if f.completion == "hang":
            await asyncio.Event().wait()
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        if f.completion == "error500":
            return web.json_response({"error": {"message": "injected failure", "code": 500}},
                                     status=500)
        if f.completion == "drop":
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        n = f.tokens
        if request.path == "/v1/responses":
            return await self._response(request, body, n)
        if f.completion == "bad_json":
            return web.Response(status=200, body=b"<html>proxy error</html>",
                                content_type="application/json")
        if f.completion == "garbage_stream":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"<html>not an event stream")
            await out.write_eof()
            return out
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-fake", "object": "text_completion", "model": "fake",
                "choices": [{"index": 0, "text": "t" * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(n):
            if i and f.chunk_interval_s:
                await asyncio.sleep(f.chunk_interval_s)
            reason = '"length"' if i == n - 1 else "null"
            await out.write(_CHUNK.format(i=i, reason=reason).encode())
            if f.completion == "stall_midstream" and i == 1:
                await asyncio.Event().wait()
            if f.completion == "drop_midstream" and i == 1:
                assert request.transport is not None
                request.transport.close()
                raise asyncio.CancelledError
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await out.write(_USAGE.format(p=5, t=5 + n, c=n).encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _response(self, request: web.Request, body: dict[str, object],
                        n: int) -> web.StreamResponse:
        """A Responses API answer (``/v1/responses``): JSON, or its event stream, which ends
        with ``response.completed`` (no ``[DONE]``)."""
        usage = f'"usage":{{"input_tokens":5,"output_tokens":{n},"total_tokens":{5 + n}}}'
        if not body.get("stream"):
            return web.Response(body=(
                '{"id":"resp_fake","object":"response","status":"completed","output":[{"type":'
                f'"message","content":[{{"type":"output_text","text":"{"t" * n}"}}]}}],{usage}}}'
            ).encode(), content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_RESP_EVENT.format(type="response.created", rest="").encode())
        for i in range(n):
            await out.write(_RESP_EVENT.format(type="response.output_text.delta",
                                               rest=f',"delta":"t{i}"').encode())
            if self.faults.completion == "drop_midstream" and i == 1:
                assert request.transport is not None
                request.transport.close()
                raise asyncio.CancelledError
        await out.write(_RESP_EVENT.format(type="response.completed",
                                           rest=f',"response":{{{usage}}}').encode())
        await out.write_eof()
        return out
