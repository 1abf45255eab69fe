"""Several replicas of a pool behind the sidecar: a bad one loses its traffic, a good one is
not starved by ties (no vLLM needed; a few seconds in all).

A replica that drops every connection, one whose process is wedged (``/health`` never
answers) and one whose answers fail while requests wait for it are faults a real vLLM cannot
be made to show on demand: they come from :class:`~tests.fake_upstream.FakeUpstream` (and its
:class:`~tests.test_sidecar_limits.FakeReplica`), as in the other fault tests. Each test
checks the routing exactly: which replica got how many requests, and what ``/ready`` says.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.fake_upstream import Faults
from tests.test_sidecar import fakes, make_settings, post, running_sidecar, sample, until
from tests.test_sidecar_limits import FakeReplica, fake_replicas


async def ready(s: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with s.get(url + "/ready") as r:
        return r.status, await r.json()


def test_ties_between_equally_loaded_replicas_take_turns() -> None:
    async def scenario() -> None:
        async with fakes(Faults(), Faults(), Faults()) as ups:
            settings = make_settings(*(("fp16", u.url) for u in ups))
            async with running_sidecar(settings) as (url, _), aiohttp.ClientSession() as s:
                for _ in range(9):  # one at a time: every replica is idle at each arrival
                    status, data, _ = await post(s, url, {"prompt": "x", "max_tokens": 2})
                    assert status == 200, data
                assert [u.counters.requests for u in ups] == [3, 3, 3]

    asyncio.run(scenario())


def test_replica_that_drops_every_connection_is_ejected_and_the_other_serves() -> None:
    async def scenario() -> None:
        async with fakes(Faults("drop"), Faults()) as (bad, good):
            settings = make_settings(("fp16", bad.url), ("fp16", good.url),
                                     eject_after_failures=3, eject_s=60.0)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                statuses = []
                for _ in range(24):
                    status, _, _ = await post(s, url, {"prompt": "x", "max_tokens": 2})
                    statuses.append(status)
                # the dropped requests may have reached the replica: not sent twice (502)
                assert statuses.count(502) == 3 and statuses.count(200) == 21
                assert (bad.counters.requests, good.counters.requests) == (3, 21)
                status, body = await ready(s, url)
                assert status == 200 and list(body["out"]) == ["fp16#0"]
                assert "ejected after 3 consecutive failures" in body["out"]["fp16#0"]
                assert bad.url not in json.dumps(body)
                assert sample(sidecar, "rlbatch_upstream_ejections_total",
                              upstream="fp16#0") == 1
                assert sidecar.tickets == {}

    asyncio.run(scenario())


def test_wedged_replica_is_taken_out_by_its_health_check() -> None:
    async def scenario() -> None:
        async with fake_replicas(FakeReplica(Faults("hang"), health="hang"),
                                 FakeReplica()) as (wedged, good):
            settings = make_settings(("fp16", wedged.url), ("fp16", good.url),
                                     scrape_timeout_s=0.3)
            async with running_sidecar(settings) as (url, _), aiohttp.ClientSession() as s:
                async def out_until(wanted: bool) -> dict[str, str]:
                    """``/ready``'s ``out`` once it lists fp16#0 (or, not ``wanted``, no
                    longer does)."""
                    deadline = asyncio.get_running_loop().time() + 10
                    while True:
                        out: dict[str, str] = (await ready(s, url))[1].get("out", {})
                        if ("fp16#0" in out) == wanted:
                            return out
                        assert asyncio.get_running_loop().time() < deadline, out
                        await asyncio.sleep(0.05)

                out = await out_until(True)
                assert out["fp16#0"] == "fp16#0: /health did not answer within 0.3 s"
                for _ in range(6):
                    status, data, _ = await post(s, url, {"prompt": "x", "max_tokens": 2})
                    assert status == 200, data
                assert (wedged.counters.requests, good.counters.requests) == (0, 6)
                wedged.health = "ok"  # it answers again: back in
                assert await out_until(False) == {}

    asyncio.run(scenario())


def test_single_wedged_replica_makes_the_sidecar_not_ready() -> None:
    async def scenario() -> None:
        async with fake_replicas(FakeReplica(health="error")) as (up,):
            settings = make_settings(("fp16", up.url), scrape_timeout_s=0.3)
            async with running_sidecar(settings, ready=False) as (url, _), \
                    aiohttp.ClientSession() as s:
                await until(lambda: up.health_calls >= 2)
                status, body = await ready(s, url)
                assert status == 503 and "fp16#0" in body["reason"]
                assert "/health answered 503" in body["reason"]
                assert up.url not in body["reason"]

    asyncio.run(scenario())


def test_requests_waiting_for_an_ejected_replica_move_to_another() -> None:
    """Each replica runs one request at a time (static:1): of eight sent together four wait
    behind the bad replica's first. After its third failure it is ejected and the one still
    waiting for it (never sent) goes to the other replica."""
    async def scenario() -> None:
        async with fakes(Faults("drop", delay_s=0.2), Faults(delay_s=0.2)) as (bad, good):
            settings = make_settings(("fp16", bad.url), ("fp16", good.url),
                                     eject_after_failures=3, eject_s=60.0)
            async with running_sidecar(settings, "static:1") as (url, _), \
                    aiohttp.ClientSession() as s:
                answers = await asyncio.gather(*(post(s, url, {"prompt": "x", "max_tokens": 2})
                                                 for _ in range(8)))
                statuses = sorted(a[0] for a in answers)
                assert statuses == [200] * 5 + [502] * 3
                assert (bad.counters.requests, good.counters.requests) == (3, 5)

    asyncio.run(scenario())
