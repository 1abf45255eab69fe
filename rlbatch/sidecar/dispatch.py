"""Client requests through admission to the upstreams: submit, admit, finish, cancel, retry.

The request path of the sidecar, kept lean (no observation is built per request): a handler
submits its :class:`~rlbatch.sidecar.upstream.Ticket` here; :class:`~rlbatch.serving.
admission.Admission` (the simulator's per-bucket queues, caps, pool routing, queue bounds,
over-length policy and KV budget) queues it, hands it to an :class:`~rlbatch.sidecar.upstream.
HttpUpstream` or refuses it. A request leaving an upstream frees its slot at once and the next
queued one is admitted. Every arrival and refusal is counted by admission, including the ones
decided here (no reachable upstream in the pool; a full queue known before the prompt is
counted), so the tick's counters come from it alone.

The handlers report how each request went on its upstream: ``eject_after_failures`` failures
in a row eject it (:meth:`Dispatcher.upstream_failed`), and the requests waiting for it that
were not sent yet move to another replica of the pool.

Overload (admission's rules, :mod:`rlbatch.serving.overload`): an arrival may be refused at
once (``predicted_ttft``, ``queued_tokens``: 429), and a request that waits out the queue TTL
is expired (``queue_ttl``: 503). :meth:`Dispatcher.expire` runs at the next expiry
(:meth:`~rlbatch.serving.admission.Admission.next_expiry_s`, one timer for all) and at every
control tick: admission expires its queued requests, and each expired ticket's handler is
woken with the refusal (:attr:`~rlbatch.sidecar.upstream.Ticket.refusal`). A request held at
an upstream by an engine-wide cap is, for admission, inside that engine (vLLM's waiting queue,
where the simulator expires nothing); here it has not been sent anywhere yet, so it expires
after the same TTL since its arrival (never one that was sent once and is being retried on
another replica), answered and counted the same way.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from rlbatch.control.types import ANY_POOL
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.admission import Admission, Queued, Rejected, RejectReason
from rlbatch.sidecar.upstream import DONE, QUEUED, RUNNING, HttpUpstream, Ticket

REFUSALS: dict[RejectReason, str] = {
    "too_long": "rejected_too_long", "queue_full": "rejected_queue_full",
    "unavailable": "unavailable", "predicted_ttft": "rejected_predicted_ttft",
    "queued_tokens": "rejected_queued_tokens", "queue_ttl": "expired_queue_ttl"}
"""Admission's refusal reasons as the outcomes ``rlbatch_requests_total`` counts."""

TIMER_SLACK_S = 1e-3
"""The expiry timer fires this much after the expiry it waits for (an event loop's clock may
round a delay down; firing early would only re-arm it)."""


class Dispatcher:
    """Tickets between the handlers, admission and the upstreams.

    :param upstreams: every upstream, ids 0..n-1.
    :param pools: the pools present, in canonical order.
    :param admission: the admission layer over them.
    :param tickets: the live tickets by request id (shared with the upstreams, whose
        ``add_request`` looks them up).
    :param eject_after_failures: failures in a row that eject an upstream.
    :param eject_s: how long an ejected upstream gets no new requests.
    :param on_eject: told the upstream each time one is ejected.
    :param clock: the sidecar clock (admission's time: ``Request.arrival_s``).
    """

    def __init__(self, upstreams: list[HttpUpstream], pools: tuple[str, ...],
                 admission: Admission, tickets: dict[int, Ticket], *,
                 eject_after_failures: int = 3, eject_s: float = 30.0,
                 on_eject: Callable[[HttpUpstream], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.upstreams = upstreams
        self.admission = admission
        self.tickets = tickets
        self.pools = pools
        self.by_pool = {p: [u for u in upstreams if u.pool == p] for p in self.pools}
        self.by_pool[ANY_POOL] = list(upstreams)
        for u in upstreams:
            u.peers = tuple(p for p in self.by_pool[u.pool] if p is not u)
        self.eject_after_failures = eject_after_failures
        self.eject_s = eject_s
        self._on_eject = on_eject
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None
        self._armed_s = math.inf  # when the expiry timer fires (inf: not armed)

    def pool_available(self, pool: str) -> bool:
        """Some upstream of ``pool`` is reachable.

        :param pool: the pool.
        """
        return any(u.healthy for u in self.by_pool[pool])

    def route(self, bucket: int) -> str:
        """The pool ``bucket`` is routed to now.

        :param bucket: bucket index.
        """
        return self.admission.routes[bucket]

    def refused_in_buckets(self, first_bucket: int, last_bucket: int) -> RejectReason | None:
        """Whether a request would be refused in every bucket its prompt can fall in (its
        pool unreachable or its queue full there), so counting its prompt would be wasted.

        :param first_bucket: the lowest bucket its prompt can fall in.
        :param last_bucket: the highest.
        :returns: the reason ``first_bucket`` refuses it (``unavailable`` or ``queue_full``),
            or ``None`` when some bucket may take it.
        """
        adm = self.admission
        bound = adm.config.max_queue_len
        first: RejectReason | None = None
        for bucket in range(first_bucket, last_bucket + 1):
            pool = adm.routes[bucket]
            reason: RejectReason | None = None
            if not self.pool_available(pool):
                reason = "unavailable"
            elif bound is not None:
                if adm.caps[bucket] is None and adm.late_after_s is None:  # straight in
                    queued = sum(e.num_waiting(bucket) for e in adm.engines_of(pool))
                else:
                    queued = len(adm.queues[bucket])
                reason = "queue_full" if queued >= bound else None
            if reason is None:
                return None
            first = first or reason
        return first

    def refuse(self, request: Request, reason: RejectReason) -> Rejected:
        """Count a request refused before it was submitted; the refusal.

        :param request: the request.
        :param reason: why.
        """
        return self.admission.refuse(request, reason)

    def upstream_ok(self, upstream: HttpUpstream) -> None:
        """A request went through ``upstream`` (answered, errors of the client included).

        :param upstream: the upstream.
        """
        upstream.failures = 0

    def upstream_failed(self, upstream: HttpUpstream, reason: str) -> None:
        """A request failed on ``upstream`` (before the ticket leaves it): after
        ``eject_after_failures`` in a row it is ejected, unless it is the last available
        replica of its pool (ejecting that one would answer every request 503), and the
        requests waiting for it move to another replica.

        :param upstream: the upstream.
        :param reason: what failed (no URL).
        """
        upstream.failures += 1
        if upstream.failures < self.eject_after_failures or not upstream.healthy:
            return
        if not any(p.healthy for p in upstream.peers):
            return
        upstream.eject(self.eject_s, reason)
        if self._on_eject is not None:
            self._on_eject(upstream)
        for ticket in upstream.waiting_tickets():
            if not self._move(ticket):
                break

    def _move(self, ticket: Ticket) -> bool:
        """Move a request not sent yet from its upstream's FIFO to another replica with room
        for its bucket; ``False`` when there is none. Its handler keeps waiting on the same
        future, which the new upstream resolves when it runs it."""
        held = ticket.upstream
        assert held is not None, "moving a request no upstream holds"
        engine = self.admission.least_loaded(held.pool, bucket=ticket.bucket,
                                             exclude=ticket.tried | self._unreachable()
                                             | {held.engine_id})
        if engine is None:
            return False
        prompt, truncated = ticket.prompt_tokens, ticket.truncated
        held.release(ticket)
        self.upstreams[engine.engine_id].add_request(ticket.request, ticket.bucket, prompt,
                                                      truncated)
        self._arm_for(ticket)
        return True

    def submit(self, ticket: Ticket) -> Rejected | None:
        """Hand a new request to admission.

        :param ticket: the request (state ``QUEUED``).
        :returns: ``None`` when queued or admitted, else the refusal (its ``reason`` is one
            of :data:`REFUSALS`).
        """
        req = ticket.request
        pool = self.admission.routes[ticket.bucket]
        if not self.pool_available(pool):
            return self.admission.refuse(req, "unavailable")
        self.tickets[req.request_id] = ticket
        outcome = self.admission.submit(req)
        if isinstance(outcome, Rejected):
            del self.tickets[req.request_id]
            ticket.state = DONE
            return outcome
        if isinstance(outcome, Queued):
            self.admit_pool(pool)
        self._arm_for(ticket)
        return None

    # ------------------------------------------------------------------ queue TTL
    def expire(self, now_s: float) -> int:
        """Refuse every request that waited out the queue TTL at ``now_s`` (admission's
        :meth:`~rlbatch.serving.admission.Admission.expire` for its queues; the same TTL since
        arrival for the tickets an engine-wide cap holds at an upstream, never sent) and wake
        their handlers with the refusal (503, ``queue_ttl``).

        :param now_s: the sidecar clock.
        :returns: how many expired.
        """
        adm = self.admission
        ttl = adm.config.queue_ttl_s
        if ttl is None:
            return 0
        expired: list[tuple[Ticket, Rejected]] = []
        for request, refusal in adm.expire(now_s):
            adm.forget(request.request_id)
            ticket = self.tickets.pop(request.request_id, None)
            if ticket is not None:
                expired.append((ticket, refusal))
        cutoff = now_s - ttl
        for upstream in self.upstreams:
            for ticket in upstream.waiting_tickets():
                if not ticket.tried and ticket.request.arrival_s <= cutoff:
                    upstream.release(ticket)
                    adm.forget(ticket.request.request_id)
                    self.tickets.pop(ticket.request.request_id, None)
                    expired.append((ticket, adm.refuse_expired(ticket.request, ticket.bucket,
                                                               now_s)))
        if not expired:
            return 0
        for ticket, refusal in expired:
            ticket.state = DONE
            ticket.refusal = refusal
            if not ticket.future.done():
                ticket.future.set_result(None)
        self.admit_all()  # a ticket leaving an upstream's FIFO frees room under its caps
        return len(expired)

    def next_expiry_s(self) -> float:
        """When the next request waits out the queue TTL (``inf``: none waits, or no TTL)."""
        ttl = self.admission.config.queue_ttl_s
        t = self.admission.next_expiry_s()
        if ttl is None:
            return t
        for upstream in self.upstreams:
            for ticket in upstream.waiting_tickets():
                if not ticket.tried:
                    t = min(t, ticket.request.arrival_s + ttl)
        return t

    def close(self) -> None:
        """Stop the expiry timer (the sidecar stops)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._armed_s = math.inf

    def _arm_for(self, ticket: Ticket) -> None:
        """A ticket starts waiting (queued, or held by an engine-wide cap): make the timer
        fire by its expiry. Later arrivals expire later, so this re-arms only when nothing was
        waiting or a moved ticket is older than every other."""
        ttl = self.admission.config.queue_ttl_s
        if ttl is None or ticket.state in (RUNNING, DONE) or ticket.tried:
            return
        self._arm(ticket.request.arrival_s + ttl)

    def _arm(self, at_s: float) -> None:
        if at_s >= self._armed_s or self._clock is None or not math.isfinite(at_s):
            return
        if self._timer is not None:
            self._timer.cancel()
        delay_s = max(0.0, at_s - self._clock()) + TIMER_SLACK_S
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._on_timer)
        self._armed_s = at_s

    def expire_due(self) -> int:
        """:meth:`expire` now (the sidecar clock), then arm the timer for the next expiry.

        :returns: how many expired.
        """
        if self._clock is None:
            return 0
        expired = self.expire(self._clock())
        self._arm(self.next_expiry_s())
        return expired

    def _on_timer(self) -> None:
        self._timer = None
        self._armed_s = math.inf
        self.expire_due()

    def admit_pool(self, pool: str) -> None:
        """Let queued requests routed to ``pool`` into its reachable upstreams, least loaded
        first.

        :param pool: the pool.
        """
        self.admission.admit_pool(pool, exclude=self._unreachable())

    def admit_all(self) -> None:
        """:meth:`admit_pool` for every pool."""
        for pool in self.pools:
            self.admit_pool(pool)

    def finish(self, ticket: Ticket, record: FinishedRequest | None) -> None:
        """A forwarded request is done (``record`` when it completed); its slot goes to the
        next queued request.

        :param ticket: the request.
        :param record: its timings, or ``None`` when it failed.
        """
        upstream = ticket.upstream
        self.tickets.pop(ticket.request.request_id, None)
        if upstream is None:
            ticket.state = DONE
            return
        upstream.release(ticket, record)
        if upstream.healthy:
            self.admission.admit(upstream)

    def abandon(self, ticket: Ticket) -> None:
        """The request leaves wherever it is (client gone, failure); a queued
        one is cancelled in admission.

        :param ticket: the request.
        """
        if ticket.state == DONE:
            return
        if ticket.state == QUEUED:
            self.admission.cancel(ticket.request.request_id)
            self.tickets.pop(ticket.request.request_id, None)
            ticket.state = DONE
            return
        self.finish(ticket, None)

    def retry_target(self, ticket: Ticket) -> HttpUpstream | None:
        """Move a request that failed on its upstream, or was not sent to it yet and the
        upstream is out now (nothing sent to the client yet), to another reachable replica of
        the same pool that has room for its bucket under the cap in force; ``None`` when
        there is none (the caller answers 503).

        :param ticket: the failed request (still held by its upstream).
        """
        failed = ticket.upstream
        if failed is None:
            return None
        ticket.tried.add(failed.engine_id)
        engine = self.admission.least_loaded(failed.pool, bucket=ticket.bucket,
                                             exclude=ticket.tried | self._unreachable())
        if engine is None:
            return None
        target = self.upstreams[engine.engine_id]
        prompt, truncated = ticket.prompt_tokens, ticket.truncated
        self.finish(ticket, None)
        self.tickets[ticket.request.request_id] = ticket
        ticket.future = asyncio.get_running_loop().create_future()
        target.add_request(ticket.request, ticket.bucket, prompt, truncated)
        return target

    def _unreachable(self) -> set[int]:
        return {u.engine_id for u in self.upstreams if not u.healthy}

