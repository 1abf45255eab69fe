"""Clients that give up and retry: profiles, the simulator's cancellations and retries, and
what the users got."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rlbatch.control.controllers import make_controller
from rlbatch.control.types import SLA
from rlbatch.paths import traces_dir
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig, Rejected
from rlbatch.serving.clients import PROFILES, ClientMix, ClientSession
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import load_trace
from rlbatch.workload.spec import resolve_workload

SURGE = "surge:rate=3.4,duration=240,mix=chat,start=60,length=60"


def _run(controller: str, clients: str, *, skipping: bool = True, seed: int = 0,
         **admission: float) -> dict[str, object]:
    spec = DeploymentSpec(clients=clients, clients_seed=seed, event_skipping=skipping,
                          admission=AdmissionConfig(**admission),  # type: ignore[arg-type]
                          sla=SLA(2.0, 0.1))
    return run(resolve_workload(SURGE, seed=1), make_controller(controller), spec).row


def test_mixes_parse_normalise_and_refuse_bad_ones() -> None:
    mix = ClientMix.parse("interactive:1,sdk:3")
    assert [(p.name, s) for p, s in mix.profiles] == [("interactive", 0.25), ("sdk", 0.75)]
    assert mix.name == "interactive:0.25,sdk:0.75"
    assert ClientMix.parse("patient").patient and not ClientMix.parse("sdk").patient
    for bad, match in (("nobody", "unknown client profile"), ("sdk:0", "shares"),
                       ("sdk:x", "bad share"), ("sdk,sdk", "twice")):
        with pytest.raises(ValueError, match=match):
            ClientMix.parse(bad)
    with pytest.raises(ValueError, match="unknown client profile"):
        DeploymentSpec(clients="browser")


def test_the_sdk_profile_retries_as_the_openai_client_does() -> None:
    sdk = PROFILES["sdk"]
    rng = np.random.default_rng(0)
    assert sdk.retries_status(429, None) and sdk.retries_status(503, 3.0)
    assert sdk.retries_status(408, None) and not sdk.retries_status(400, None)
    assert not sdk.retries_status(429, 121.0)  # a Retry-After over 120 s is not retried
    assert not sdk.retries_status(503, 1.0, should_retry=False)  # x-should-retry: false
    assert sdk.retry_delay_s(0, 7.0, rng) == 7.0
    first = [sdk.retry_delay_s(0, None, rng) for _ in range(200)]
    second = [sdk.retry_delay_s(1, None, rng) for _ in range(200)]
    assert min(first) >= 0.375 and max(first) <= 0.5
    assert min(second) >= 0.75 and max(second) <= 1.0
    assert sdk.retry_delay_s(9, None, rng) <= 8.0
    interactive = PROFILES["interactive"]
    assert interactive.max_retries == 0 and not interactive.retries_status(429, None)
    assert interactive.first_token_patience_s == 20.0 and interactive.attempt_timeout_s is None


def test_a_refused_sdk_request_comes_back_as_a_linked_retry() -> None:
    session = ClientSession(ClientMix.parse("sdk"), seed=0, first_retry_id=100)
    first = Request(7, 1.0, 50, 10)
    session.arrive(first)
    session.refused(first, Rejected(0, "predicted_ttft", 3.0), 1.0)
    assert session.next_event_s() == 4.0
    (retry,) = session.due_retries(4.0)
    assert (retry.request_id, retry.arrival_s, retry.prompt_tokens) == (100, 4.0, 50)
    session.arrive(retry)
    session.refused(retry, Rejected(0, "queue_ttl", 2.0), 9.0)
    (again,) = session.due_retries(11.0)
    session.arrive(again)
    session.refused(again, Rejected(0, "queue_full", 1.0), 12.0)  # no retry left
    entry = session.originals[7]
    assert (entry.outcome, entry.reason, entry.retries, entry.end_s) == (
        "rejected", "queue_full", 2, 12.0)
    assert session.due_retries(math.inf) == []


def test_interactive_clients_give_up_and_their_work_is_counted_as_wasted() -> None:
    """FIFO static:256 past the knee: requests without a first token after 20 s are
    cancelled (in the engine's waiting queue or mid-prefill), counted as abandoned, against
    attainment, with the tokens spent on them as wasted."""
    patient = _run("static:256", "patient")
    row = _run("static:256", "interactive")
    assert patient["abandoned"] == 0 and patient["ttft_p99_s"] > 20.0  # type: ignore[operator]
    assert row["abandoned"] > 0 and row["retries"] == 0  # type: ignore[operator]
    assert row["ttft_p99_s"] <= 20.0 + 0.5  # type: ignore[operator]
    assert row["any_answer_p99_s"] <= 20.0 + 0.5  # type: ignore[operator]
    assert row["completed"] + row["abandoned"] == row["submitted"]  # type: ignore[operator]
    decided = row["submitted"]
    met = round(row["sla_attainment"] * decided)  # type: ignore[operator]
    assert met <= row["completed"]  # type: ignore[operator]
    per_bucket = row["per_bucket"]
    assert sum(b["abandoned"] for b in per_bucket.values()) == row["abandoned"]  # type: ignore[attr-defined]
    assert sum(b["wasted_tokens"] for b in per_bucket.values()) == row["wasted_tokens"]  # type: ignore[attr-defined]
    assert 0 < row["wasted_token_share"] < 1  # type: ignore[operator]


def test_sdk_clients_retry_refusals_and_users_are_counted_once() -> None:
    row = _run("fixed:256[order=deadline]", "sdk", reject_ttft_slack=1.0, queue_ttl_s=6.0)
    assert row["retries"] > 0  # type: ignore[operator]
    users = row["completed"] + row["rejected"] + row["abandoned"] + row["unfinished"]  # type: ignore[operator]
    assert users == row["submitted"]
    assert row["rejected"] == row["rejected_at_arrival"] + row["rejected_by_ttl"]
    assert row["abandoned"] == 0 and row["wasted_tokens"] == 0


@pytest.mark.parametrize("clients", ["interactive", "sdk", "interactive:0.5,sdk:0.5"])
def test_clients_give_the_same_run_stepping_or_skipping(clients: str) -> None:
    kwargs = {"reject_ttft_slack": 1.5, "queue_ttl_s": 6.0}
    for controller in ("static:64", "fixed:256[order=deadline]"):
        a = _run(controller, clients, **kwargs)
        b = _run(controller, clients, skipping=False, **kwargs)
        for key in ("wall_seconds", "speedup_x"):
            a.pop(key), b.pop(key)
        assert a == b


def test_long_prompts_with_prefixes_give_the_same_run_stepping_or_skipping() -> None:
    """Mooncake's long prompts with shared prefixes on a long-context deployment: the
    predicted TTFT reads each engine's prefix cache and running prefills at every arrival,
    and refuses; reading must not change the run."""
    rows = []
    for skipping in (True, False):
        workload = load_trace(str(traces_dir() / "mooncake_synthetic.jsonl"), max_requests=300)
        spec = DeploymentSpec(gpu="a100-80g", model="llama-3.1-8b",
                              clients="interactive:0.5,sdk:0.5", event_skipping=skipping,
                              sla=SLA(2.0, 0.1),
                              admission=AdmissionConfig(over_length="truncate",
                                                        reject_ttft_slack=0.5, queue_ttl_s=5.0))
        row = run(workload, make_controller("fixed:256[order=deadline]"), spec).row
        for key in ("wall_seconds", "speedup_x"):
            row.pop(key)
        rows.append(row)
    assert rows[0] == rows[1]
    assert rows[0]["rejected_at_arrival"] > 0 and rows[0]["prefix_cache_hits"] > 0


def test_the_clients_seed_draws_the_mix() -> None:
    a = _run("static:256", "interactive:0.5,sdk:0.5", seed=0)
    b = _run("static:256", "interactive:0.5,sdk:0.5", seed=0)
    c = _run("static:256", "interactive:0.5,sdk:0.5", seed=1)
    assert a["abandoned"] == b["abandoned"] and a["goodput_rps"] == b["goodput_rps"]
    assert (a["abandoned"], a["goodput_rps"]) != (c["abandoned"], c["goodput_rps"])
    assert replace(DeploymentSpec(), clients="sdk").clients == "sdk"


def test_refusals_that_say_not_to_retry_end_sdk_requests() -> None:
    row = _run("fixed:256[order=deadline]", "sdk", reject_ttft_slack=1.0, queue_ttl_s=6.0,
               retry_overload=False)
    assert row["retries"] == 0 and row["rejected"] > 0  # type: ignore[operator]
    assert row["any_answer_p99_s"] <= 6.0 + 0.5  # type: ignore[operator]
