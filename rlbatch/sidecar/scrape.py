"""Reading the upstreams over HTTP: their ``/metrics`` and ``/health`` every tick,
``/v1/models`` once.

A scrape that cannot connect marks the upstream down (it gets no new requests until a scrape
succeeds); one that connects but fails (timeout, bad page) leaves its health as it was. Either
way the reason comes back, and the control tick applies the guard's fallback caps. A
``/health`` that does not answer 200 in time (vLLM answers 503 once its engine is dead; a
wedged process does not answer) takes the upstream out until it does. The reasons name the
upstream, not its URL: they reach clients.
"""

from __future__ import annotations

import aiohttp

from rlbatch.sidecar.relay import failure_text, read_head
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
        upstream.mark_down(failure_text(exc))
        return upstream.down_reason
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{upstream.name} scrape failed: {failure_text(exc)}"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{upstream.name} scrape failed: {exc or type(exc).__name__}"
    upstream.observe(metrics)
    return ""


async def check_health(session: aiohttp.ClientSession, upstream: HttpUpstream,
                       timeout_s: float) -> None:
    """Ask the upstream's ``/health``; an answer other than 200 in time takes it out.

    :param session: the sidecar's HTTP client.
    :param upstream: the upstream.
    :param timeout_s: time limit.
    """
    try:
        async with session.get(upstream.url + "/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await read_head(resp, 1024)
            failure = "" if resp.status == 200 else f"/health answered {resp.status}"
    except TimeoutError:
        failure = f"/health did not answer within {timeout_s:g} s"
    except DOWN_ERRORS:
        failure = ""  # unreachable: the scrape marks it down, with the reason
    except aiohttp.ClientError as exc:
        failure = f"/health failed: {failure_text(exc)}"
    upstream.health_checked(failure)


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
