"""Helpers of the live sidecar tests (``tests/test_sidecar_live.py``): the sidecar as a child
process (against real vLLM servers, or any upstream URLs from an event loop that also serves a
fake), metric readers, a poller of each upstream's running requests, and a client call that
classifies the answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from rlbatch.sidecar.vllm_server import ApiServer, free_port
from tests.factories import stop_child

REPO = Path(__file__).resolve().parents[1]
EDGES = "128,256,512"
# Prompt sizes (words of the tiny model's training vocabulary) landing in every bucket.
PROMPT_WORDS = (40, 180, 400, 700)
WORDS = ("the", "request", "token", "batch", "queue", "engine", "model", "serve", "cache",
         "prefill", "decode", "latency")


@dataclass
class Servers:
    fp16: ApiServer
    fp8: ApiServer

    def upstream_args(self, pools: tuple[str, ...] = ("fp16", "fp8")) -> list[str]:
        args: list[str] = []
        for pool in pools:
            args += ["--upstream", f"{pool}={getattr(self, pool).url}"]
        return args


@contextlib.contextmanager
def sidecar(servers: Servers, tmp_path: Path, *args: str,
            pools: tuple[str, ...] = ("fp16", "fp8")) -> Iterator[tuple[str, int]]:
    """``serve.py`` in a child process; yields its URL and pid once ``/ready`` says so."""
    port = free_port()
    log = (tmp_path / f"sidecar-{port}.log").open("wb")
    cmd = [sys.executable, str(REPO / "serve.py"), *servers.upstream_args(pools),
           "--port", str(port), "--buckets", EDGES, "--no-cold-start", "--tick-s",
           "0.25", "--no-gpu-telemetry", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / f"sidecar-{port}.log").read_text()
            with contextlib.suppress(OSError, aiohttp.ClientError):
                if asyncio.run(_get_status(url + "/ready")) == 200:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("sidecar not ready: "
                                 + (tmp_path / f"sidecar-{port}.log").read_text())
        yield url, proc.pid
    finally:
        stop_child(proc)
        log.close()


@contextlib.asynccontextmanager
async def child_sidecar(upstreams: list[str], tmp_path: Path,
                        *args: str) -> AsyncIterator[tuple[str, int]]:
    """``serve.py`` in a child process in front of ``upstreams`` (``POOL=URL`` each), waited
    for without blocking the event loop (a fake upstream in this loop keeps answering its
    scrapes); yields its URL and pid once ``/ready`` says so."""
    port = free_port()
    path = tmp_path / f"sidecar-{port}.log"
    log = path.open("wb")
    cmd = [sys.executable, str(REPO / "serve.py"), "--port", str(port), "--buckets", EDGES,
           "--no-cold-start", "--tick-s", "0.25", "--no-gpu-telemetry", "--tokenizer",
           "approx"]
    for upstream in upstreams:
        cmd += ["--upstream", upstream]
    proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, path.read_text()
            with contextlib.suppress(OSError, aiohttp.ClientError):
                if await _get_status(url + "/ready") == 200:
                    break
            assert time.monotonic() < deadline, "sidecar not ready: " + path.read_text()
            await asyncio.sleep(0.1)
        yield url, proc.pid
    finally:
        await asyncio.to_thread(stop_child, proc)
        log.close()


async def _get_status(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status


async def vllm_metric(s: aiohttp.ClientSession, base: str, name: str) -> float:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


async def sidecar_metric(s: aiohttp.ClientSession, base: str, line_start: str) -> float | None:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


@dataclass
class PeakRunning:
    """Polls every upstream's ``vllm:num_requests_running`` while a load runs."""

    servers: Servers
    peak: dict[str, float] = field(default_factory=lambda: {"fp16": 0.0, "fp8": 0.0})
    samples: int = 0
    _stop: bool = False

    async def start(self) -> asyncio.Task[None]:
        """Start polling; returns once the first sample is in."""
        task = asyncio.create_task(self.run())
        while not self.samples:
            await asyncio.sleep(0.005)
        return task

    async def run(self) -> None:
        async with aiohttp.ClientSession() as s:
            while not self._stop:
                for pool in ("fp16", "fp8"):
                    value = await vllm_metric(s, getattr(self.servers, pool).url,
                                              "vllm:num_requests_running")
                    self.peak[pool] = max(self.peak[pool], value)
                self.samples += 1
                await asyncio.sleep(0.01)

    def stop(self) -> None:
        self._stop = True


def prompt(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i) % len(WORDS)] for i in range(words))


@dataclass
class Outcome:
    status: int
    complete: bool
    error: bool
    tokens: int | None
    usage_chunk: bool


async def call(s: aiohttp.ClientSession, url: str, *, words: int, max_tokens: int,
               stream: bool, chat: bool, seed: int = 0, usage: bool = False,
               timeout_s: float = 120.0) -> Outcome:
    """One client request; classifies the answer (raises on anything unexplained)."""
    body: dict[str, object] = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True,
                               "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(words, seed)}]
    else:
        body["prompt"] = prompt(words, seed)
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with s.post(url + path, json=body,
                      timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        data = await r.read()
    if r.status != 200:
        error = json.loads(data)["error"]
        assert error["message"], data
        return Outcome(r.status, False, True, None, False)
    if not stream:
        answer = json.loads(data)
        assert answer["choices"], data
        return Outcome(200, True, False, answer["usage"]["completion_tokens"], False)
    events = [e for e in data.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", data[-300:]
    error = any(e.startswith(b'data: {"error"') for e in events)
    usage_events = [json.loads(e[6:]) for e in events[:-1] if b'"usage"' in e
                    and b'"choices":[]' in e]
    tokens = usage_events[0]["usage"]["completion_tokens"] if usage_events else None
    return Outcome(200, not error, error, tokens, bool(usage_events))


# --------------------------------------------------------------------------- tests
