"""Client requests through admission to the upstreams: submit, admit, finish, cancel, retry.

The request path of the sidecar, kept lean (no observation is built per request): a handler
submits its :class:`~rlbatch.sidecar.upstream.Ticket` here; :class:`~rlbatch.serving.
admission.Admission` (the simulator's per-bucket queues, caps, pool routing, queue bounds,
over-length policy and KV budget) queues it, hands it to an :class:`~rlbatch.sidecar.upstream.
HttpUpstream` or refuses it. A request leaving an upstream frees its slot at once and the next
queued one is admitted. Every arrival and refusal is counted by admission, including the one
decided here (no reachable upstream in the pool), so the tick's counters come from it alone.
"""

from __future__ import annotations

import asyncio

from rlbatch.control.types import ANY_POOL
from rlbatch.engine.stats import FinishedRequest
from rlbatch.serving.admission import Admission, Queued, Rejected
from rlbatch.sidecar.upstream import DONE, QUEUED, HttpUpstream, Ticket

REFUSALS: dict[str, str] = {"too_long": "rejected_too_long", "queue_full": "rejected_queue_full",
                            "unavailable": "unavailable"}
"""Admission's refusal reasons as the outcomes ``rlbatch:requests_total`` counts."""


class Dispatcher:
    """Tickets between the handlers, admission and the upstreams.

    :param upstreams: every upstream, ids 0..n-1.
    :param pools: the pools present, in canonical order.
    :param admission: the admission layer over them.
    :param tickets: the live tickets by request id (shared with the upstreams, whose
        ``add_request`` looks them up).
    """

    def __init__(self, upstreams: list[HttpUpstream], pools: tuple[str, ...],
                 admission: Admission, tickets: dict[int, Ticket]) -> None:
        self.upstreams = upstreams
        self.admission = admission
        self.tickets = tickets
        self.pools = pools
        self.by_pool = {p: [u for u in upstreams if u.pool == p] for p in self.pools}
        self.by_pool[ANY_POOL] = list(upstreams)

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

    def submit(self, ticket: Ticket) -> str | None:
        """Hand a new request to admission.

        :param ticket: the request (state ``QUEUED``).
        :returns: ``None`` when queued or admitted, else the outcome that refused it
            (``unavailable``, ``rejected_queue_full``, ``rejected_too_long``).
        """
        req = ticket.request
        pool = self.admission.routes[ticket.bucket]
        if not self.pool_available(pool):
            return REFUSALS[self.admission.refuse(req, "unavailable").reason]
        self.tickets[req.request_id] = ticket
        outcome = self.admission.submit(req)
        if isinstance(outcome, Rejected):
            del self.tickets[req.request_id]
            ticket.state = DONE
            return REFUSALS[outcome.reason]
        if isinstance(outcome, Queued):
            self.admit_pool(pool)
        return None

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
        """The request leaves wherever it is (client gone, queue timeout, failure); a queued
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
        """Move a request that failed on its upstream (nothing sent to the client yet) to
        another reachable replica of the same pool that has room for its bucket under the
        cap in force; ``None`` when there is none (the caller answers 503).

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

