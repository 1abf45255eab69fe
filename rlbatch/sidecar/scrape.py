"""Reading the upstreams over HTTP: their ``/metrics`` every tick, ``/v1/models`` once.

A scrape that cannot connect marks the upstream down (it gets no new requests until a scrape
succeeds); one that connects but fails (timeout, bad page) leaves its health as it was. Either
way the reason comes back, and the control tick applies the guard's fallback caps.
"""

from __future__ import annotations

import aiohttp

from rlbatch.sidecar.upstream import HttpUpstream
from rlbatch.sidecar.vllm_metrics import MetricsParseError, parse_vllm_metrics

NO_LIMIT = 1 << 30
"""``max_model_len`` of an upstream that does not tell its own (and before any did)."""

DOWN_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
    aiohttp.ConnectionTimeoutError, ConnectionRefusedError, ConnectionResetError)
"""Errors that mean the upstream is not there (as opposed to slow or answering badly)."""


async def scrape(session: aiohttp.ClientSession, upstream: HttpUpstream,
                 timeout_s: float) -> str:
    """Read one upstream's ``/metrics`` (and, the first time, its ``/v1/models``).

    :param session: the sidecar's HTTP client.
    :param upstream: the upstream.
    :param timeout_s: time limit of each request.
    :returns: ``""``, or why it failed.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(upstream.url + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                raise MetricsParseError(f"/metrics answered {resp.status}")
            text = await resp.text()
        metrics = parse_vllm_metrics(text)
        if upstream.max_model_len is None:
            await discover(session, upstream, timeout)
    except DOWN_ERRORS as exc:
        reason = f"{upstream.name} ({upstream.url}) unreachable: {exc or type(exc).__name__}"
        upstream.mark_down(reason)
        return reason
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError,
            TypeError) as exc:
        return f"{upstream.name} ({upstream.url}) scrape failed: {exc or type(exc).__name__}"
    upstream.observe(metrics)
    return ""


async def discover(session: aiohttp.ClientSession, upstream: HttpUpstream,
                   timeout: aiohttp.ClientTimeout) -> None:
    """Learn the upstream's model, its ``max_model_len`` and its model folder.

    :param session: the sidecar's HTTP client.
    :param upstream: the upstream.
    :param timeout: time limit.
    :raises MetricsParseError: ``/v1/models`` did not answer 200.
    """
    async with session.get(upstream.url + "/v1/models", timeout=timeout) as resp:
        if resp.status != 200:
            raise MetricsParseError(f"/v1/models answered {resp.status}")
        data = await resp.json()
    model = data["data"][0]
    upstream.max_model_len = int(model.get("max_model_len") or NO_LIMIT)
    upstream.served_model = str(model.get("id"))
    upstream.model_root = model.get("root")
