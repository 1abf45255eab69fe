"""One vLLM server behind the sidecar, as admission sees it: the Engine protocol over HTTP.

:class:`rlbatch.serving.admission.Admission` (the same per-bucket queues, caps, routing and KV
budget the simulator uses) hands requests to engines with ``add_request``; here that hands the
request's :class:`Ticket` its upstream and wakes the handler waiting on it. The upstream
keeps the bookkeeping vLLM does not export per bucket (requests inside it per bucket, the KV
they committed), and builds one :class:`~rlbatch.engine.stats.EngineStats` per control tick
from that bookkeeping and the server's ``/metrics``.

vLLM cannot change ``max_num_seqs`` on a running server, so an engine-wide cap (``static:N``)
is applied here: requests admitted beyond it wait in this upstream's own FIFO, as they would
wait inside a vLLM engine with ``--max-num-seqs N``, and count as the engine's ``waiting``.

An upstream takes new requests while it is **healthy**: reachable (its last scrape
connected), its ``/health`` answered 200 at the last check, and not ejected (after
consecutive failed requests, :meth:`HttpUpstream.eject`). Its reasons for being out name it,
never its URL (they reach clients in 503s and ``/ready``); the logs carry the URL.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rlbatch.engine.base import PrefillTime, kv_budget_exceeded
from rlbatch.engine.reserve import KvCommitMode, KvReserveMode, OutputReserve
from rlbatch.engine.stats import AbortedRequest, EngineStats, FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.admission import Rejected
from rlbatch.sidecar.settings import UpstreamSpec
from rlbatch.sidecar.vllm_metrics import VllmMetrics, counter_delta

QUEUED, WAITING, RUNNING, DONE = 0, 1, 2, 3
"""Ticket states: in an admission queue, in an upstream's own FIFO, forwarded, gone."""

UNHEALTHY_LOAD = 1 << 30
"""Load an unreachable upstream reports to least-loaded routing, so it is never chosen while a
reachable replica of its pool exists."""

_LOG = logging.getLogger("rlbatch.sidecar")


@dataclass(eq=False, slots=True)
class Ticket:
    """One client request on its way through admission.

    :param request: the request as admission sees it (sidecar clock, prompt tokens, max
        output tokens).
    :param bucket: its prompt-length bucket.
    :param future: resolved when an upstream takes it.
    :param state: ``QUEUED`` / ``WAITING`` / ``RUNNING`` / ``DONE``.
    :param upstream: the upstream holding it (``None`` while queued).
    :param prompt_tokens: prompt tokens served (after truncation).
    :param truncated: admission truncated the prompt.
    :param tried: engine ids that failed this request (not retried there).
    :param committed: the KV the budget counts for it while it is in an upstream (tokens).
    :param refusal: why it was refused after it was accepted (expired by the queue TTL), set
        before its future is resolved; ``None`` while it may still be forwarded.
    """

    request: Request
    bucket: int
    future: asyncio.Future[None]
    state: int = QUEUED
    upstream: HttpUpstream | None = None
    prompt_tokens: int = 0
    truncated: bool = False
    tried: set[int] = field(default_factory=set)
    committed: int = 0
    refusal: Rejected | None = None


class HttpUpstream:
    """A vLLM OpenAI server: bookkeeping, health, metrics, the Engine protocol.

    :param engine_id: index in the deployment.
    :param spec: pool and URL.
    :param num_buckets: prompt-length buckets.
    :param tickets: the sidecar's live tickets by request id (``add_request`` looks them up).
    :param clock: the sidecar clock (seconds since start).
    :param configured_max_num_seqs: the server's ``--max-num-seqs``.
    :param kv_reserve: ``observed`` or ``declared`` (see :class:`SidecarSettings`).
    :param kv_reserve_quantile: output quantile ``observed`` reserves.
    """

    def __init__(self, engine_id: int, spec: UpstreamSpec, num_buckets: int,
                 tickets: dict[int, Ticket], clock: Callable[[], float],
                 configured_max_num_seqs: int, *, kv_reserve: KvReserveMode = "observed",
                 kv_reserve_quantile: float = 0.9) -> None:
        self.engine_id = engine_id
        self.pool = spec.pool
        self.url = spec.url
        self.name = f"{spec.pool}#{engine_id}"
        self._tickets = tickets
        self._clock = clock
        self._configured = configured_max_num_seqs
        self._limit: int | None = None
        self.unfinished = [0] * num_buckets
        self.running = [0] * num_buckets
        self._total = 0
        self._running_total = 0
        self._committed = 0
        # Plain tokens (block size 1), see kv_block_size; the context bound is the request's.
        self._reserve = OutputReserve(kv_reserve, num_buckets, 1, UNHEALTHY_LOAD,
                                      quantile=kv_reserve_quantile)
        self._waiting: deque[Ticket] = deque()
        self.finished: list[FinishedRequest] = []
        self.reachable = False
        self._unreachable = "not contacted yet"
        self.health_failure = ""
        self.failures = 0
        """Requests failed in a row (a success clears it)."""
        self._ejected_until = -math.inf
        self._eject_reason = ""
        self.peers: tuple[HttpUpstream, ...] = ()
        """The other replicas of its pool (set by the dispatcher)."""
        self.last_chosen = 0
        """When it last took a request, as a count of the requests its pool took."""
        self.metrics: VllmMetrics | None = None
        self._at_snapshot: VllmMetrics | None = None
        self._snapshot_s = 0.0
        self.itl_mean_s = math.nan
        self.max_model_len: int | None = None
        self.served_model: str | None = None
        self.model_root: str | None = None

    # ------------------------------------------------------------ Engine protocol
    @property
    def now_s(self) -> float:
        return self._clock()

    @property
    def max_num_seqs(self) -> int:
        return self._configured if self._limit is None else min(self._limit, self._configured)

    def set_max_num_seqs(self, value: int) -> None:
        """Engine-wide cap (``static:N``): applied by this upstream's own FIFO.

        :param value: the cap (>= 1).
        """
        if value < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {value}")
        self._limit = value
        self._start_waiting()

    def clear_max_num_seqs(self) -> None:
        """Back to the server's configured ``--max-num-seqs``."""
        self._limit = None
        self._start_waiting()

    def num_unfinished(self, bucket: int) -> int:
        return self.unfinished[bucket]

    def num_waiting(self, bucket: int) -> int:
        """Requests of ``bucket`` admitted here but waiting for the engine-wide cap.

        :param bucket: bucket index.
        """
        return self.unfinished[bucket] - self.running[bucket]

    def num_unfinished_total(self) -> int:
        if not self.healthy:
            return self._total + UNHEALTHY_LOAD
        return self._total + self._tie_break()

    def _tie_break(self) -> int:
        # Admission picks the least loaded engine and breaks ties by the lowest id, which
        # sent every request of a lightly loaded pool to its first replica. One more is
        # reported by a replica that took a request more recently than an equally loaded
        # peer, so among equals the least recently chosen wins (round-robin); never where one
        # more would read as full (deadline order compares this count with max_num_seqs).
        total = self._total
        if total + 1 >= self.max_num_seqs:
            return 0
        chosen = self.last_chosen
        return int(any(p._total == total and p.last_chosen < chosen and p.healthy
                       for p in self.peers))

    def committed_tokens(self) -> int:
        return self._committed

    def committed_with(self, need: int, commit: KvCommitMode) -> int:
        # A proxy sees no request's progress inside the server, so it cannot project a peak:
        # every admitted request holds its count until its response ends, whatever commit.
        return self._committed + need

    def kv_budget_exceeded(self, need: int, commit: KvCommitMode, limit: float) -> bool:
        return kv_budget_exceeded(self, need, commit, limit)

    def kv_tokens_to_admit(self, request: Request, bucket: int, prompt_tokens: int) -> int:
        # max_output_tokens is the limit the request runs under (its max_tokens, fitted).
        return self._reserve.within(prompt_tokens + request.max_output_tokens, bucket,
                                    prompt_tokens)

    @property
    def kv_block_size(self) -> int:
        # Committed in plain tokens: the server's block size may arrive (first scrape) after
        # requests were admitted, and add/release must round alike; clients' max_tokens
        # overestimate the KV far more than block rounding underestimates it.
        return 1

    @property
    def kv_capacity_tokens(self) -> int:
        capacity = self.metrics.kv_capacity_tokens if self.metrics is not None else None
        # Unknown capacity must not make the KV budget serialise admission.
        return capacity if capacity else UNHEALTHY_LOAD * 1024

    def add_request(self, request: Request, bucket: int, prompt_tokens: int,
                    truncated: bool) -> None:
        ticket = self._tickets[request.request_id]
        ticket.upstream = self
        self.last_chosen = 1 + max([self.last_chosen, *(p.last_chosen for p in self.peers)])
        ticket.prompt_tokens = prompt_tokens
        ticket.truncated = truncated
        self.unfinished[bucket] += 1
        self._total += 1
        ticket.committed = self.kv_tokens_to_admit(request, bucket, prompt_tokens)
        self._committed += ticket.committed
        if self._running_total < self.max_num_seqs and not self._waiting:
            self._run(ticket)
        else:
            ticket.state = WAITING
            self._waiting.append(ticket)

    def prefill_time_s(self, request: Request, prompt_tokens: int) -> PrefillTime | None:
        """The sidecar sees neither the server's step times nor its prefix cache: ``None``
        (admission predicts the wait only)."""
        return None

    def abort(self, request_id: int, *,
              before_first_token: bool = False) -> AbortedRequest | None:
        """Nothing is removed here: a request's handler owns it (a client that leaves closes
        the upstream connection and vLLM aborts the request; the queue TTL is
        :meth:`~rlbatch.sidecar.dispatch.Dispatcher.expire`, which answers the handler), so a
        removal here would leave its handler waiting. Always ``None``.

        :param request_id: the request's id.
        :param before_first_token: only one without its first token (unused).
        """
        return None

    def is_idle(self) -> bool:
        return self._total == 0

    def advance_idle(self, to_s: float) -> None:
        """Nothing to do: the server runs on its own."""

    def step(self, bound_s: float) -> None:
        """Nothing to do: the server runs on its own."""

    def snapshot(self) -> EngineStats:
        """This tick's stats: bookkeeping plus the latest scrape (counter deltas since the
        previous snapshot)."""
        return self.snapshot_with_memory(0, 0)

    # ------------------------------------------------------------ sidecar side
    def snapshot_with_memory(self, gpu_used_bytes: int, gpu_total_bytes: int) -> EngineStats:
        """:meth:`snapshot` with a GPU memory reading.

        :param gpu_used_bytes: memory in use on the upstream's GPU (0 = unknown).
        :param gpu_total_bytes: the GPU's memory (0 = unknown).
        """
        now = self._clock()
        m = self.metrics
        before = self._at_snapshot
        if m is not None:
            def delta(counter: str) -> float:
                return counter_delta(getattr(m, counter),
                                     None if before is None else getattr(before, counter))

            prefill = delta("prompt_tokens_total")
            decode = delta("generation_tokens_total")
            preempted = delta("preemptions_total")
            iterations = delta("iterations_total")
            prefix_queries = delta("prefix_cache_queries_total")
            prefix_hits = delta("prefix_cache_hits_total")
            itl_n = delta("itl_count")
            # the count and the sum restart together: judge the restart once, on the count
            itl_s = (m.itl_sum_s if before is not None and m.itl_count < before.itl_count
                     else delta("itl_sum_s"))
            busy = 0.0
            if itl_n > 0:
                self.itl_mean_s = itl_s / itl_n
                # vLLM exports no step time. The interval's mean inter-token latency is the
                # mean step a decoding request waited, so iterations x that mean is the busy
                # time whose ratio to iterations the guard's P99 rule and the tpot_fit
                # rule's calibration read (0 without a decoded token: they then leave this
                # upstream's iterations out rather than read them as fast steps).
                busy = iterations * self.itl_mean_s
            kv = m.kv_cache_usage
            capacity = m.kv_capacity_tokens or 0
            blocks = m.num_gpu_blocks or 0
        else:
            prefill = decode = preempted = iterations = busy = 0.0
            prefix_queries = prefix_hits = 0.0
            kv = math.nan
            capacity = blocks = 0
        self._at_snapshot = m
        finished = tuple(self.finished)
        self.finished.clear()
        waiting = tuple(u - r for u, r in zip(self.unfinished, self.running, strict=True))
        stats = EngineStats(
            engine_id=self.engine_id, pool=self.pool, start_s=self._snapshot_s, time_s=now,
            running=tuple(self.running), waiting=waiting, kv_cache_usage=kv,
            kv_cache_usage_peak=kv, committed_tokens=self._committed,
            kv_capacity_tokens=capacity, num_kv_blocks=blocks,
            gpu_memory_used_bytes=gpu_used_bytes, gpu_memory_total_bytes=gpu_total_bytes,
            iterations=int(iterations), busy_s=busy, prefill_tokens=int(prefill),
            decode_tokens=int(decode), preemptions=int(preempted), recomputed_tokens=0,
            kv_overflows=int(preempted), max_num_seqs=self.max_num_seqs, finished=finished,
            prefix_cache_queries=int(prefix_queries), prefix_cache_hits=int(prefix_hits))
        self._snapshot_s = now
        return stats

    @property
    def running_total(self) -> int:
        return self._running_total

    @property
    def waiting_total(self) -> int:
        return len(self._waiting)

    def oldest_waiting_s(self, now_s: float) -> float:
        """How long the oldest request held here by the engine-wide cap (not forwarded yet)
        has waited since its arrival; 0 when none waits.

        :param now_s: the sidecar clock.
        """
        # a retry from another replica joins the back with an older arrival: not FIFO by age
        return max((now_s - t.request.arrival_s for t in self._waiting), default=0.0)

    @property
    def healthy(self) -> bool:
        """Takes new requests: reachable, its ``/health`` fine, not ejected."""
        return (self.reachable and not self.health_failure
                and time.monotonic() >= self._ejected_until)

    @property
    def down_reason(self) -> str:
        """Why it takes no new requests (``""`` while healthy); names it, not its URL."""
        if not self.reachable:
            return f"{self.name} unreachable: {self._unreachable}"
        if self.health_failure:
            return f"{self.name}: {self.health_failure}"
        left = self._ejected_until - time.monotonic()
        if left > 0:
            return f"{self.name} {self._eject_reason} ({left:.0f} s left)"
        return ""

    def observe(self, metrics: VllmMetrics) -> None:
        """A scrape succeeded: keep its readings; the server is reachable.

        :param metrics: the parsed page.
        """
        self.metrics = metrics
        if not self.reachable and self._unreachable != "not contacted yet":
            _LOG.info("upstream %s (%s) reachable again", self.name, self.url)
        self.reachable = True
        self._unreachable = ""

    def mark_down(self, reason: str) -> None:
        """The server could not be reached (connect error, scrape failure).

        :param reason: why, for ``/ready`` and 503s (no URL).
        """
        if self.reachable:
            _LOG.warning("upstream %s (%s) unreachable: %s", self.name, self.url, reason)
        self.reachable = False
        self._unreachable = reason

    def health_checked(self, failure: str) -> None:
        """The result of a ``/health`` check.

        :param failure: why it failed (no URL), ``""`` when it answered 200.
        """
        if failure and not self.health_failure:
            _LOG.warning("upstream %s (%s) out: %s", self.name, self.url, failure)
        elif self.health_failure and not failure:
            _LOG.info("upstream %s (%s) healthy again", self.name, self.url)
        self.health_failure = failure

    def eject(self, duration_s: float, last_failure: str) -> None:
        """No new requests for ``duration_s`` after :attr:`failures` failures in a row.

        :param duration_s: how long.
        :param last_failure: the last failure (no URL).
        """
        self._ejected_until = time.monotonic() + duration_s
        self._eject_reason = (f"ejected after {self.failures} consecutive failures for "
                              f"{duration_s:g} s (last: {last_failure})")
        _LOG.warning("upstream %s (%s) %s", self.name, self.url, self._eject_reason)

    def waiting_tickets(self) -> tuple[Ticket, ...]:
        """The requests held here by the engine-wide cap, not sent yet (oldest first)."""
        return tuple(self._waiting)

    def release(self, ticket: Ticket, record: FinishedRequest | None = None) -> None:
        """A request leaves this upstream (finished, failed or cancelled); a waiting one
        takes its place.

        :param ticket: the request.
        :param record: its timings when it finished (kept for the tick's stats).
        """
        b = ticket.bucket
        if ticket.state == RUNNING:
            self.running[b] -= 1
            self._running_total -= 1
        elif ticket.state == WAITING:
            self._waiting.remove(ticket)
        else:
            raise AssertionError(f"release of a ticket in state {ticket.state}")
        self.unfinished[b] -= 1
        self._total -= 1
        self._committed -= ticket.committed
        if record is not None and not record.rejected:
            self._reserve.observe(b, record.output_tokens)
        ticket.state = DONE
        ticket.upstream = None
        if record is not None:
            self.finished.append(record)
        self._start_waiting()

    def _run(self, ticket: Ticket) -> None:
        ticket.state = RUNNING
        self.running[ticket.bucket] += 1
        self._running_total += 1
        if not ticket.future.done():
            ticket.future.set_result(None)

    def _start_waiting(self) -> None:
        limit = self.max_num_seqs
        while self._waiting and self._running_total < limit:
            self._run(self._waiting.popleft())
