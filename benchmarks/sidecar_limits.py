"""The sidecar under the adversarial loads of issue 13 (items 1 and 2): memory and descriptors.

    .venv/bin/python benchmarks/sidecar_limits.py memory [--prompts 16] [--prompt-mib 15]
    .venv/bin/python benchmarks/sidecar_limits.py slowloris [--connections 1100] [--nofile 1024]

The sidecar runs in its own process (settings built here, served by ``rlbatch.sidecar.serve``,
uvloop), in front of the fault-injecting fake upstream of :mod:`tests.fake_upstream`, in a
third process (an upstream that never answers is a fault a real vLLM cannot produce on demand;
nothing here measures the upstream). While the attack runs, a prober asks ``/health`` and
sends a short normal completion every 0.25 s; the tables give the sidecar's peak RSS
(sampled every 20 ms) or peak open descriptors, and the prober's worst latencies and
failures.

``memory``: ``--prompts`` concurrent requests with a ``--prompt-mib`` MiB prompt each; the
long bucket's requests hang upstream (the fake hangs on prompts over 1,000 characters), so the
ones admitted stay in the sidecar. Run per over-length policy: ``vllm`` (the default: such a
prompt is certainly over ``max_model_len``, refused by vLLM's character check before it is
tokenised) and ``truncate`` (admitted: counted as over-long without tokenising, queued, held;
the held-bytes budget refuses the rest with 429). "RSS per held request" = (peak - idle RSS)
/ requests held at the peak.

``slowloris``: the sidecar's descriptor limit is set to ``--nofile``; ``--connections``
clients each send a request line and then one header byte per second, never finishing the
head. Reported: peak descriptors, connections the sidecar closed, prober failures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlbatch.sidecar.vllm_server import free_port  # noqa: E402


# ----------------------------------------------------------------------------- child side
def child(args: argparse.Namespace) -> None:
    """Serve the fake upstream and the sidecar in this process' event loop (as the
    deployment does, the fake is in another process: the parent's)."""
    from rlbatch.control.controllers import make_controller
    from rlbatch.sidecar import SidecarSettings, UpstreamSpec, create_app, serve

    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    settings = SidecarSettings(
        upstreams=(UpstreamSpec("fp16", args.upstream_url),), port=args.port,
        tokenizer="approx", cold_start=False, gpu_telemetry=False, tick_s=0.5,
        over_length=args.over_length, max_num_seqs=64)
    app = create_app(settings, make_controller("playbook"))
    import uvloop

    uvloop.run(serve(app, settings))


def serve_fake(port: int) -> None:
    """The fake upstream in its own process (so neither the sidecar's nor the prober's
    event loop pays for it)."""

    async def run() -> None:
        await fake_upstream(port)
        await asyncio.Event().wait()

    asyncio.run(run())


class FakeProcess:
    """:func:`serve_fake` in a child process."""

    def __init__(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-fake", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=REPO)

    async def start(self) -> FakeProcess:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return self
                await asyncio.sleep(0.1)
        raise RuntimeError("fake upstream did not start")

    async def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def fake_upstream(port: int) -> Any:
    from tests.fake_upstream import FakeUpstream

    class HangLong(FakeUpstream):
        async def _answer(self, request: Any, body: dict[str, object]) -> Any:
            prompt = body.get("prompt")
            if isinstance(prompt, str) and len(prompt) > 1000:
                await asyncio.Event().wait()
            return await super()._answer(request, body)

    up = HangLong(max_model_len=4096, num_gpu_blocks=1 << 20)  # KV budget never binds
    await up.start(port=port)
    return up


# ----------------------------------------------------------------------------- parent side
class Sampler:
    """Peak RSS and descriptors of the sidecar (every 20 ms), and with ``url`` its peak
    ``rlbatch_held_body_bytes`` (every 100 ms)."""

    def __init__(self, pid: int, url: str | None = None) -> None:
        self.proc = psutil.Process(pid)
        self.url = url
        self.peak_rss = 0
        self.peak_fds = 0
        self.peak_held = 0.0
        self._stop = False

    async def run(self) -> None:
        if self.url is not None:
            held = asyncio.create_task(self._held())
        while not self._stop:
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.peak_fds = max(self.peak_fds, self.proc.num_fds())
            await asyncio.sleep(0.02)
        if self.url is not None:
            await held

    async def _held(self) -> None:
        assert self.url is not None
        while not self._stop:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                self.peak_held = max(self.peak_held,
                                     await metric(self.url, "rlbatch_held_body_bytes"))
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self._stop = True


class Prober:
    """``/health`` and a short completion every 0.25 s; worst latency and failures."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.health: list[float] = []
        self.completion: list[float] = []
        self.failures: list[str] = []
        self._stop = False

    async def _one(self, s: aiohttp.ClientSession, kind: str) -> None:
        t0 = time.perf_counter()
        try:
            if kind == "health":
                async with s.get(self.url + "/health") as r:
                    await r.read()
                    ok = r.status == 200
            else:
                async with s.post(self.url + "/v1/completions",
                                  json={"prompt": "hello there", "max_tokens": 3}) as r:
                    await r.read()
                    ok = r.status == 200
            if not ok:
                self.failures.append(f"{kind}: {r.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.failures.append(f"{kind}: {type(exc).__name__}")
            return
        (self.health if kind == "health" else self.completion).append(
            time.perf_counter() - t0)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        while not self._stop:
            # a fresh connection each time: a new client, as a load balancer's probe is
            async with aiohttp.ClientSession(timeout=timeout) as s:
                await asyncio.gather(self._one(s, "health"), self._one(s, "completion"))
            await asyncio.sleep(0.25)

    def stop(self) -> None:
        self._stop = True

    def summary(self) -> dict[str, Any]:
        return {"probes": len(self.health) + len(self.completion),
                "health_max_s": round(max(self.health, default=float("nan")), 3),
                "completion_max_s": round(max(self.completion, default=float("nan")), 3),
                "failures": len(self.failures), "failure_kinds": sorted(set(self.failures))}


async def start_child(extra: list[str], upstream_url: str) -> tuple[subprocess.Popen[bytes],
                                                                    str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--port", str(port),
                             "--upstream-url", upstream_url, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return proc, url
            await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError("sidecar did not become ready")


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


async def send(s: aiohttp.ClientSession, url: str, body: bytes,
               statuses: dict[str, int]) -> None:
    """POST one completion body; count its answer's status (or error) in ``statuses``."""
    try:
        async with s.post(url + "/v1/completions", data=body,
                          headers={"Content-Type": "application/json"}) as r:
            await r.read()
            key = str(r.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        key = type(exc).__name__
    statuses[key] = statuses.get(key, 0) + 1


async def memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    up = await FakeProcess().start()
    rows = []
    try:
        for policy in ("vllm", "truncate"):
            proc, url = await start_child(["--over-length", policy], up.url)
            try:
                await asyncio.sleep(1.0)
                idle = psutil.Process(proc.pid).memory_info().rss
                sampler, prober = Sampler(proc.pid, url), Prober(url)
                tasks = [asyncio.create_task(sampler.run()), asyncio.create_task(prober.run())]
                prompt = "x" * (args.prompt_mib * 2**20 - 64)
                body = json.dumps({"prompt": prompt, "max_tokens": 16}).encode()
                statuses: dict[str, int] = {}
                async with aiohttp.ClientSession(
                        timeout=aiohttp.ClientTimeout(total=args.hold_s)) as s:
                    await asyncio.gather(*(send(s, url, body, statuses)
                                           for _ in range(args.prompts)))
                held = await metric(url, "rlbatch_held_body_bytes")
                sampler.stop()
                prober.stop()
                await asyncio.gather(*tasks)
                trips = await metric(url, 'rlbatch_limit_trips_total{limit="held_bytes"}')
                rows.append({
                    "over_length": policy, "prompts": args.prompts,
                    "prompt_mib": args.prompt_mib, "answers": statuses,
                    "budget_mib": 64, "idle_rss_mib": round(idle / 2**20, 1),
                    "peak_rss_mib": round(sampler.peak_rss / 2**20, 1),
                    "peak_held_mib": round(sampler.peak_held / 2**20, 1),
                    "held_at_end_mib": round(held / 2**20, 1),
                    "rss_per_held_byte": round(
                        (sampler.peak_rss - idle) / max(sampler.peak_held, 1.0), 2),
                    "held_bytes_trips": trips, **prober.summary()})
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        await up.stop()
    return rows


async def slowloris(args: argparse.Namespace) -> list[dict[str, Any]]:
    up = await FakeProcess().start()
    rows = []
    try:
        proc, url = await start_child(["--nofile", str(args.nofile)], up.url)
        try:
            sampler, prober = Sampler(proc.pid), Prober(url)
            tasks = [asyncio.create_task(sampler.run()), asyncio.create_task(prober.run())]
            host, port = url.removeprefix("http://").split(":")
            closed = opened = failed = 0
            stop = time.monotonic() + args.duration_s

            async def attacker(i: int) -> None:
                nonlocal closed, opened, failed
                while time.monotonic() < stop:
                    try:
                        reader, writer = await asyncio.open_connection(host, int(port))
                    except OSError:
                        failed += 1
                        await asyncio.sleep(0.5)
                        continue
                    opened += 1
                    try:
                        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: ")
                        while time.monotonic() < stop:
                            writer.write(b"a")
                            await writer.drain()
                            try:
                                async with asyncio.timeout(1.0):
                                    if await reader.read(1) == b"":
                                        closed += 1
                                        break
                            except TimeoutError:
                                pass
                    except OSError:
                        closed += 1
                    finally:
                        writer.close()

            await asyncio.gather(*(attacker(i) for i in range(args.connections)))
            sampler.stop()
            prober.stop()
            await asyncio.gather(*tasks)
            rows.append({
                "connections": args.connections, "nofile": args.nofile,
                "duration_s": args.duration_s, "opened": opened,
                "closed_by_sidecar": closed, "connect_failed": failed,
                "peak_fds": sampler.peak_fds,
                "peak_rss_mib": round(sampler.peak_rss / 2**20, 1),
                "header_timeouts": await metric(
                    url, 'rlbatch_limit_trips_total{limit="header_timeout"}'),
                "connection_limit_trips": await metric(
                    url, 'rlbatch_limit_trips_total{limit="connections"}'),
                **prober.summary()})
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        await up.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("memory", "slowloris"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-mib", type=int, default=15)
    parser.add_argument("--hold-s", type=float, default=20.0,
                        help="how long the memory attack's clients wait for an answer")
    parser.add_argument("--connections", type=int, default=1100)
    parser.add_argument("--nofile", type=int, default=0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-fake", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--upstream-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--over-length", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.serve_fake:
        serve_fake(args.serve_fake)
        return
    if args.mode == "slowloris" and not args.nofile:
        args.nofile = 1024
    run = memory if args.mode == "memory" else slowloris
    for row in asyncio.run(run(args)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
