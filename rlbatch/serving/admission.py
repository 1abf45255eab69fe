"""Admission control: per-bucket queues, caps, queue bounds and pool routing.

A request waits in its bucket's queue (kept in arrival order) until an engine of the bucket's
pool holds fewer of that bucket's requests than the bucket's cap; admission runs at every
engine iteration (as vLLM's scheduler admits at every step), so a finished request frees its
slot at once. How the queues are served for a whole run is admission's discipline
(:class:`~rlbatch.control.discipline.AdmissionDiscipline`, set by :meth:`Admission.configure`
when a run starts): oldest first or in deadline order, with or without a KV budget. Buckets
without a
cap (``None``) pass straight through to the least-loaded engine's own FIFO queue (under
deadline order they wait in their queue too, so that the order and the engines' limit apply
to every request); their queue bound counts the bucket's requests waiting inside the pool's
engines.

Every arrival and every refusal is counted here, including refusals decided by the caller
(:meth:`Admission.refuse`: the sidecar refuses when no upstream of the pool is reachable), so
a tick's arrivals and rejections come from one set of counters.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from rlbatch.buckets import Buckets
from rlbatch.control.discipline import PLAIN, AdmissionDiscipline
from rlbatch.control.types import ANY_POOL, ControlAction
from rlbatch.engine.base import Engine, PrefillTime
from rlbatch.engine.fork import fork_state
from rlbatch.engine.reserve import KvCommitMode
from rlbatch.engine.stats import FinishedRequest
from rlbatch.frozen import quick_init
from rlbatch.request import Request
from rlbatch.serving.arrival_queue import add_by_arrival, first_on_time, turns_late_at
from rlbatch.serving.overload import DrainRate, predicted_wait_s

OverLengthPolicy = Literal["reject", "truncate"]
RejectReason = Literal["too_long", "queue_full", "unavailable", "queue_ttl", "predicted_ttft",
                       "queued_tokens"]
REJECT_REASONS: tuple[RejectReason, ...] = ("too_long", "queue_full", "unavailable", "queue_ttl",
                                           "predicted_ttft", "queued_tokens")
OVERLOAD_REASONS: frozenset[RejectReason] = frozenset(
    ("predicted_ttft", "queued_tokens", "queue_ttl"))
"""The refusals of the overload rules (:attr:`AdmissionConfig.retry_overload`)."""
HTTP_STATUS: dict[RejectReason, int] = {
    "too_long": 400, "queue_full": 429, "predicted_ttft": 429, "queued_tokens": 429,
    "queue_ttl": 503, "unavailable": 503}
"""The HTTP status each refusal is answered with: 400 for a request that can never be served,
429 for overload at arrival (llm-d's and Mooncake's convention), 503 for a request that waited
out the queue TTL or found no engine."""


@dataclass(frozen=True)
class AdmissionConfig:
    """How requests are let in.

    :param over_length: a request whose prompt + output exceeds ``max_model_len``:
        ``reject`` (vLLM's behaviour, counted) or ``truncate`` (keep the prompt's last tokens
        so it fits, counted).
    :param max_queue_len: per-bucket queue bound; a request arriving at a full queue is
        rejected (counted). For a bucket without a cap the bound counts that bucket's
        requests waiting inside its pool's engines. ``None`` = unbounded.
    :param queue_ttl_s: a request that has waited this long in an admission queue without
        starting is expired (answered 503, as llm-d's flow control does); ``None`` = never.
    :param reject_ttft_slack: refuse an arrival (429 with a ``Retry-After``) when its
        predicted wait to start, in the order it will be served, exceeds the SLA's TTFT
        times this, or when that wait plus its own prefill (where the engines know it)
        exceeds the TTFT (times this, if over 1) (:mod:`rlbatch.serving.overload`);
        ``None`` = never.
    :param max_num_queued_tokens: vLLM's ``--max-num-queued-tokens``: refuse an arrival
        while the prompt tokens of the requests still waiting to start reach this bound
        (429 here; vLLM answers 503); ``None`` = no bound.
    :param drain_window_s: the window over which the deployment's completion rate, the
        drain rate the TTFT prediction divides by, is measured.
    :param deadline_prefill: under deadline order, a request is late once its wait plus
        its bucket's predicted prefill (a typical prompt of the bucket on an idle engine)
        passes the SLA's TTFT, not its wait alone: the TTFT it is judged on ends with its
        first token, after its prefill. Engines that cannot predict a prefill (live ones,
        the sidecar's upstreams) keep the wait alone.
    """

    over_length: OverLengthPolicy = "reject"
    max_queue_len: int | None = None
    queue_ttl_s: float | None = None
    reject_ttft_slack: float | None = None
    max_num_queued_tokens: int | None = None
    drain_window_s: float = 30.0
    max_retry_after_s: float | None = None
    retry_overload: bool = True
    deadline_prefill: bool = True

    def __post_init__(self) -> None:
        if self.over_length not in ("reject", "truncate"):
            raise ValueError(f"over_length must be 'reject' or 'truncate', got "
                             f"{self.over_length!r}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1 or None, got {self.max_queue_len}")
        for name in ("queue_ttl_s", "reject_ttft_slack", "max_retry_after_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0 and finite, or None, got {value}")
        if self.max_num_queued_tokens is not None and self.max_num_queued_tokens < 1:
            raise ValueError(f"max_num_queued_tokens must be >= 1 or None, got "
                             f"{self.max_num_queued_tokens}")
        if not (self.drain_window_s > 0 and math.isfinite(self.drain_window_s)):
            raise ValueError(f"drain_window_s must be > 0 and finite, got "
                             f"{self.drain_window_s}")

    @property
    def sheds(self) -> bool:
        """Some overload rule is on (a TTL, the predicted-TTFT rejection or the queued-tokens
        bound)."""
        return (self.queue_ttl_s is not None or self.reject_ttft_slack is not None
                or self.max_num_queued_tokens is not None)


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits in its bucket's admission queue.

    :param bucket: its bucket.
    """

    bucket: int


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request went straight into an engine (its bucket has no cap).

    :param bucket: its bucket.
    :param engine_id: the engine that holds it.
    """

    bucket: int
    engine_id: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request was refused; it left as a ``FinishedRequest(rejected=True)`` record.

    :param bucket: its bucket.
    :param reason: ``too_long`` (over ``max_model_len`` under the ``reject`` policy),
        ``queue_full`` (the bucket's queue bound), ``unavailable`` (refused by the caller),
        ``queue_ttl`` (waited out :attr:`AdmissionConfig.queue_ttl_s`), ``predicted_ttft``
        (:attr:`AdmissionConfig.reject_ttft_slack`), ``queued_tokens``
        (:attr:`AdmissionConfig.max_num_queued_tokens`).
    :param retry_after_s: when the client may come back (the predicted drain time of the
        requests ahead of it); ``None``: no advice.
    :param retry: whether a retry is invited (:attr:`AdmissionConfig.retry_overload`).
    """

    bucket: int
    reason: RejectReason
    retry_after_s: float | None = None
    retry: bool = True

    @property
    def status(self) -> int:
        """The HTTP status the refusal is answered with (:data:`HTTP_STATUS`)."""
        return HTTP_STATUS[self.reason]


Outcome = Queued | Admitted | Rejected


@quick_init  # once per control tick
@dataclass(frozen=True, slots=True)
class TickCounters:
    """What admission counted since the previous :meth:`Admission.take_counters`.

    :param arrived: per bucket, arrivals (refused ones included).
    :param rejected: per bucket, refusals.
    :param cancelled: per bucket, queued requests withdrawn by :meth:`Admission.cancel`.
    :param kv_budget_blocked: the KV budget held a request back.
    """

    arrived: tuple[int, ...]
    rejected: tuple[int, ...]
    cancelled: tuple[int, ...]
    kv_budget_blocked: bool


class Admission:
    """Per-bucket queues, caps and pool routing for a set of engines.

    :param engines: every engine of the deployment.
    :param buckets: bucket definitions.
    :param max_model_len: longest sequence an engine accepts.
    :param config: over-length and queue-bound policy.
    """

    def __init__(self, engines: list[Engine], buckets: Buckets, max_model_len: int,
                 config: AdmissionConfig) -> None:
        self.engines = engines
        self.buckets = buckets
        self._edges = buckets.edges  # Buckets.index's, looked up once per arrival
        self.max_model_len = max_model_len
        self.config = config
        self.pools: dict[str, list[Engine]] = {}
        for eng in engines:
            self.pools.setdefault(eng.pool, []).append(eng)
        n = len(buckets)
        self.queues: list[deque[tuple[Request, int, bool]]] = [deque() for _ in range(n)]
        self.caps: tuple[int | None, ...] = (None,) * n
        self.kv_budget_fraction: float | None = None
        self.kv_commit: KvCommitMode = "final"
        self.budget_blocked_in_tick = False
        self.routes: tuple[str, ...] = (engines[0].pool,) * n
        self.rejected: list[FinishedRequest] = []
        self.arrived_in_tick = [0] * n
        self.rejected_in_tick = [0] * n
        self.cancelled_in_tick = [0] * n
        self._admitted: dict[tuple[int, int], Admitted] = {}
        self.budget_blocked = False
        """The last :meth:`admit` stopped at a request the KV budget held back (not because
        nothing was eligible)."""
        self.discipline = PLAIN
        """The discipline in force (:meth:`configure`)."""
        self.late_after_s: float | None = None
        """The queue order in force: ``None`` FIFO, else deadline order, a request that has
        waited longer than this (the SLA's TTFT) less its bucket's :attr:`late_margins_s`
        being late."""
        self.late_margins_s: tuple[float, ...] = (0.0,) * n
        """Per bucket, what deadline order takes off the SLA's TTFT before a request counts
        as late: its predicted prefill (:meth:`late_margins`; zeros without it)."""
        self._late_after_b: tuple[float, ...] = ()
        self.blocked_late = False
        """Under deadline order, the request the KV budget held back at the last
        :meth:`admit` was late: any on-time arrival would go before it."""
        self.order_change_s = math.inf
        """Under deadline order, when the request the KV budget held back at the last
        :meth:`admit` turns late, after which another may go first without anything
        finishing; ``inf`` otherwise."""
        self.accepted: list[tuple[int, float, int]] | None = None
        """``(request_id, arrival_s, bucket)`` of every request queued or handed to an
        engine since the previous :meth:`take_accepted`, while a list (the control loop's
        TTFT-deadline accounting sets one); ``None``: not recorded."""
        self.departed: list[int] = []
        """Accepted requests that left without finishing, since :meth:`take_departed`."""
        self.sla_ttft_s = math.inf
        """The SLA's TTFT (:meth:`configure`), which the predicted-TTFT rejection reads."""
        self.drain = DrainRate(config.drain_window_s)
        """Completions per second (:meth:`note_finished`): what the TTFT prediction divides
        by."""
        self.queued_prompt_tokens = 0
        """Prompt tokens of the requests in admission's queues (the queued-tokens bound)."""
        self.refusals: dict[RejectReason, list[int]] = {r: [0] * n for r in REJECT_REASONS}
        """Refusals since the start, by reason, per bucket."""
        self._sheds_at_arrival = (config.reject_ttft_slack is not None
                                  or config.max_num_queued_tokens is not None)

    def configure(self, discipline: AdmissionDiscipline, sla_ttft_s: float,
                  capacity_rps: float = 0.0) -> None:
        """Put a discipline in force: the order of the queues and the KV budget, for the run.

        :param discipline: the order and the KV budget.
        :param sla_ttft_s: the SLA's TTFT, after which a queued request is late under
            deadline order (an SLA without a TTFT limit has no late request: FIFO).
        :param capacity_rps: the deployment's reference capacity
            (:attr:`~rlbatch.control.types.DeploymentInfo.capacity_rps`), the drain rate
            predicted with until one is measured (0: unknown, nothing predicted until then).
        """
        self.discipline = discipline
        self.sla_ttft_s = sla_ttft_s
        self.drain.prior_rps = capacity_rps if capacity_rps > 0 else None
        budget = discipline.kv_budget
        self.kv_budget_fraction = None if budget is None else budget.fraction
        self.kv_commit = "final" if budget is None else budget.commit
        self.late_after_s = (sla_ttft_s if discipline.order == "deadline"
                             and math.isfinite(sla_ttft_s) else None)
        self.late_margins_s = (self.late_margins(self.late_after_s)
                               if self.late_after_s is not None and self.config.deadline_prefill
                               else (0.0,) * len(self.queues))
        # one float per bucket, so that admit's test (arrival < now - late_after) and the
        # skipping boundary (turns_late_at) round alike
        self._late_after_b = (() if self.late_after_s is None else
                              tuple([self.late_after_s - m for m in self.late_margins_s]))
        if self.late_after_s is None:  # only deadline order's admit sets them
            self.order_change_s = math.inf
            self.blocked_late = False

    def late_margins(self, late_after_s: float) -> tuple[float, ...]:
        """Per bucket, the prefill deadline order allows for: the least over the engines of
        the predicted prefill, on an idle engine, of the bucket's typical prompt (the middle
        of a bounded bucket, the lower edge of the open top one: a cached prefix only
        shortens it, so a request is never late before it must be), at most
        ``late_after_s``; 0 where no engine predicts one.

        :param late_after_s: the SLA's TTFT.
        """
        lows = (0, *self._edges)
        margins = []
        for b, low in enumerate(lows):
            high = self._edges[b] if b < len(self._edges) else low
            prompt = max(1, min((low + high) // 2, self.max_model_len - 1))
            probe = Request(-1, 0.0, prompt, 1)
            least = math.inf
            for engine in self.engines:
                t = engine.prefill_time_s(probe, prompt)
                if t is not None:
                    least = min(least, t.alone_s)
            margins.append(min(least, late_after_s) if math.isfinite(least) else 0.0)
        return tuple(margins)

    def apply(self, action: ControlAction) -> None:
        """Put a (guarded) action in force.

        :param action: caps, routes, engine-wide cap and its per-pool ceilings.
        :raises ValueError: the action does not fit the deployment's buckets or pools.
        """
        if len(action.caps) != len(self.buckets):
            raise ValueError(f"action has {len(action.caps)} caps, deployment has "
                             f"{len(self.buckets)} buckets")
        ceilings = dict(action.pool_max_num_seqs)
        for what, pool in [("routes to", p) for p in action.pools if p != ANY_POOL] + [
                ("caps", p) for p in ceilings]:
            if pool not in self.pools:
                raise ValueError(f"action {what} pool {pool!r}; deployment pools: "
                                 f"{sorted(self.pools)}")
        self.caps = action.caps
        self.routes = action.pools
        if action.max_num_seqs is not None:
            for eng in self.engines:
                eng.set_max_num_seqs(min(action.max_num_seqs,
                                         ceilings.get(eng.pool, action.max_num_seqs)))

    def fork(self, engines: list[Engine]) -> Admission:
        """A copy of this admission layer over ``engines`` (forks of this one's engines, in
        the same order): queues and counters copied, requests (immutable) shared.

        :param engines: the forked engines, engine ``i`` standing for ``self.engines[i]``.
        """
        if len(engines) != len(self.engines):
            raise ValueError(f"fork needs {len(self.engines)} engines, got {len(engines)}")
        new = fork_state(self, share=("engines", "pools"))
        new.engines = list(engines)
        new.pools = {}
        for eng in engines:
            new.pools.setdefault(eng.pool, []).append(eng)
        new.queues = [deque(q) for q in self.queues]
        new.drain = self.drain.copy()
        new.refusals = {r: list(c) for r, c in self.refusals.items()}
        return new

    def submit(self, request: Request) -> Outcome:
        """A request arrives: bucket it, apply the length policy and the queue bound, then
        queue it (a capped bucket, or any under deadline order) or hand it to the
        least-loaded engine of its pool.

        :param request: the arrival.
        :returns: :class:`Queued`, :class:`Admitted` or :class:`Rejected` (counted and
            recorded in :attr:`rejected`).
        """
        prompt = request.prompt_tokens
        bucket = bisect_right(self._edges, prompt)  # self.buckets.index(prompt), inline
        self.arrived_in_tick[bucket] += 1
        truncated = False
        if prompt + request.max_output_tokens > self.max_model_len:
            room = self.max_model_len - request.max_output_tokens
            if self.config.over_length == "reject" or room < 1:
                return self._reject(request, bucket, "too_long")
            prompt, truncated = room, True
        if self._sheds_at_arrival:
            refused = self._refuse_overload(request, bucket, prompt)
            if refused is not None:
                return refused
        bound = self.config.max_queue_len
        if self.caps[bucket] is None and self.late_after_s is None:
            pool = self.routes[bucket]
            engines = self.engines if pool == ANY_POOL else self.pools[pool]  # engines_of
            if bound is not None and sum(e.num_waiting(bucket) for e in engines) >= bound:
                return self._reject(request, bucket, "queue_full")
            engine = engines[0] if len(engines) == 1 else _least_loaded(engines)
            engine.add_request(request, bucket, prompt, truncated)
            if self.accepted is not None:
                self.accepted.append((request.request_id, request.arrival_s, bucket))
            key = (bucket, engine.engine_id)
            outcome = self._admitted.get(key)
            if outcome is None:  # immutable: one per (bucket, engine) is enough
                outcome = self._admitted[key] = Admitted(bucket, engine.engine_id)
            return outcome
        queue = self.queues[bucket]
        if bound is not None and len(queue) >= bound:
            return self._reject(request, bucket, "queue_full")
        add_by_arrival(queue, (request, prompt, truncated))
        self.queued_prompt_tokens += prompt
        if self.accepted is not None:
            self.accepted.append((request.request_id, request.arrival_s, bucket))
        return Queued(bucket)

    def refuse(self, request: Request, reason: RejectReason = "unavailable") -> Rejected:
        """Count and record a refusal decided outside admission (e.g. no reachable engine
        in the request's pool).

        :param request: the arrival.
        :param reason: why it was refused.
        """
        bucket = self.buckets.index(request.prompt_tokens)
        self.arrived_in_tick[bucket] += 1
        return self._reject(request, bucket, reason)

    def cancel(self, request_id: int) -> bool:
        """Withdraw a queued request (client gone, queue timeout); counted per bucket.

        :param request_id: the request's id.
        :returns: whether it was queued (a request already inside an engine is the engine's
            to release).
        """
        for bucket, queue in enumerate(self.queues):
            for item in queue:
                if item[0].request_id == request_id:
                    queue.remove(item)
                    self.queued_prompt_tokens -= item[1]
                    self.cancelled_in_tick[bucket] += 1
                    return True
        return False

    def admit(self, engine: Engine) -> int:
        """Move queued requests into ``engine`` while their buckets are under cap (oldest
        head first across buckets) and, with a KV budget in force, while the committed KV
        (:meth:`~rlbatch.engine.base.Engine.committed_with`) stays within it. Under the
        budget admission is FIFO across buckets: when the oldest eligible request does not
        fit, nothing younger overtakes it (no bucket starves).

        Under deadline order (:attr:`late_after_s`) the next request is chosen by
        :meth:`_next_in_order` and the KV budget holds it back as above. The engine is then
        given no more requests than it runs at once (its ``max_num_seqs``): the rest wait
        here, where the order applies, not in the engine's own FIFO queue.

        :param engine: an engine of this deployment.
        :returns: the number admitted.
        """
        deadline = self.late_after_s is not None
        if deadline:
            self.order_change_s = math.inf
            self.blocked_late = False
        admitted = 0
        queues = self.queues
        if not any(queues):
            self.budget_blocked = False
            return 0
        budget = (None if self.kv_budget_fraction is None
                  else self.kv_budget_fraction * engine.kv_capacity_tokens)
        while True:
            if deadline and engine.num_unfinished_total() >= engine.max_num_seqs:
                # no more than the engine runs at once: the rest wait here, in this order
                self.budget_blocked = False
                return admitted
            best, best_index, best_late, best_arrival = self._next_in_order(engine)
            if best < 0:
                self.budget_blocked = False
                return admitted
            queue = queues[best]
            request, prompt, truncated = queue[best_index]
            if budget is not None:
                need = engine.kv_tokens_to_admit(request, best, prompt)
                if engine.kv_budget_exceeded(need, self.kv_commit, budget):
                    self.budget_blocked_in_tick = self.budget_blocked = True
                    if deadline:
                        self.blocked_late = best_late
                        if not best_late:
                            self.order_change_s = turns_late_at(best_arrival,
                                                                self._late_after_b[best])
                    return admitted
            if best_index:
                del queue[best_index]
            else:
                queue.popleft()
            self.queued_prompt_tokens -= prompt
            engine.add_request(request, best, prompt, truncated)
            admitted += 1

    def _next_in_order(self, engine: Engine) -> tuple[int, int, bool, float]:
        """The request ``engine`` takes next: ``(bucket, index in its queue, late, arrival)``,
        bucket ``-1`` when no queue routed to its pool has one under its cap.

        Each bucket's candidate is its head under FIFO; under deadline order its oldest
        request that has not waited longer than :attr:`late_after_s` less the bucket's
        :attr:`late_margins_s`, else its head (late). On-time candidates go before late
        ones, the oldest first within each class.

        :param engine: the engine admitting.
        """
        deadline = self.late_after_s is not None
        caps = self.caps
        routes = self.routes
        pool = engine.pool
        now_s = engine.now_s
        late_after_b = self._late_after_b
        best = -1
        best_index = 0
        best_late = False
        best_arrival = 0.0
        for b, queue in enumerate(self.queues):
            if not queue or (routes[b] != pool and routes[b] != ANY_POOL):
                continue
            cap = caps[b]
            if cap is not None and engine.num_unfinished(b) >= cap:
                continue
            index = 0
            late = False
            arrival = queue[0][0].arrival_s
            # late: arrived before cutoff, waited longer than its bucket's late_after
            cutoff = now_s - late_after_b[b] if deadline else -math.inf
            if arrival < cutoff:  # its head is late: its oldest on-time request, if any
                index = first_on_time(queue, cutoff)
                late = index == len(queue)
                if late:
                    index = 0
                else:
                    arrival = queue[index][0].arrival_s
            if best < 0 or (late == best_late and arrival < best_arrival) or (
                    best_late and not late):
                best, best_index, best_late, best_arrival = b, index, late, arrival
        return best, best_index, best_late, best_arrival

    def note_finished(self, finish_times_s: Iterable[float]) -> None:
        """Count completions for the drain rate (:mod:`rlbatch.serving.overload`), which only
        the overload rules read: without one nothing is kept.

        :param finish_times_s: when each request finished.
        """
        if self.config.sheds:
            self.drain.note(finish_times_s)

    def waiting_ahead(self, now_s: float) -> int:
        """Requests still waiting to start that an arrival at ``now_s`` would be served
        after: all of them under FIFO; under deadline order those still on time (the late
        ones go after it). Those in the engines' waiting queues count under both.

        :param now_s: the arrival's time.
        """
        late_after_s = self.late_after_s
        ahead = 0
        for b, queue in enumerate(self.queues):
            if queue:
                ahead += len(queue) if late_after_s is None else (
                    len(queue) - first_on_time(queue, now_s - self._late_after_b[b]))
        buckets = range(len(self.queues))
        for engine in self.engines:
            ahead += sum(engine.num_waiting(b) for b in buckets)
        return ahead

    def predicted_ttft_s(self, now_s: float) -> float | None:
        """An arrival's predicted wait to start at ``now_s``: :meth:`waiting_ahead` over the
        drain rate (the capacity :meth:`configure` was given until :data:`~rlbatch.serving.
        overload.MIN_COMPLETIONS` are measured); ``None`` while the rate is unknown.

        :param now_s: the arrival's time.
        """
        rate = self.drain.rate(now_s)
        if rate is None:
            return None
        return predicted_wait_s(self.waiting_ahead(now_s), rate)

    def next_expiry_s(self) -> float:
        """When the oldest queued request waits out the queue TTL; ``inf`` without a TTL or
        a queued request."""
        ttl = self.config.queue_ttl_s
        if ttl is None or not any(self.queues):
            return math.inf
        return min(q[0][0].arrival_s for q in self.queues if q) + ttl

    def forget(self, request_id: int) -> None:
        """A request that was accepted left without finishing (expired, cancelled or aborted):
        the TTFT-deadline accounting stops waiting for it (:meth:`take_departed`).

        :param request_id: its id.
        """
        if self.accepted is not None:
            self.departed.append(request_id)

    def take_departed(self) -> list[int]:
        """The ids :meth:`forget` was told since the previous call (then forgotten)."""
        out = self.departed
        self.departed = []
        return out

    def expire(self, now_s: float) -> list[tuple[Request, Rejected]]:
        """Refuse (``queue_ttl``, 503) every queued request that has waited
        :attr:`AdmissionConfig.queue_ttl_s` or longer at ``now_s``.

        :param now_s: the time.
        :returns: the expired requests and their refusals (bucket, ``Retry-After``), oldest
            first per bucket.
        """
        ttl = self.config.queue_ttl_s
        if ttl is None or not any(self.queues):
            return []
        cutoff = now_s - ttl
        expired: list[tuple[Request, int]] = []
        for bucket, queue in enumerate(self.queues):
            while queue and queue[0][0].arrival_s <= cutoff:
                request, prompt, _ = queue.popleft()
                self.queued_prompt_tokens -= prompt
                expired.append((request, bucket))
        if not expired:
            return []
        wait = self._advice(self.predicted_ttft_s(now_s))
        return [(request, self._reject(request, bucket, "queue_ttl",
                                       wait, finish_s=now_s))
                for request, bucket in expired]

    def refuse_expired(self, request: Request, bucket: int, now_s: float) -> Rejected:
        """Count and record as ``queue_ttl`` a request that waited out the TTL outside
        admission's queues (the sidecar holds requests an engine-wide cap keeps from an
        upstream, which vLLM would hold in its waiting queue).

        :param request: the request.
        :param bucket: its bucket.
        :param now_s: the time.
        """
        return self._reject(request, bucket, "queue_ttl",
                            self._advice(self.predicted_ttft_s(now_s)), finish_s=now_s)

    def _refuse_overload(self, request: Request, bucket: int, prompt: int) -> Rejected | None:
        """The queued-tokens bound, then the predicted-TTFT rejection, for an arrival whose
        prompt the engines would take as ``prompt`` tokens."""
        config = self.config
        now = request.arrival_s
        bound = config.max_num_queued_tokens
        if bound is not None and self.queued_prompt_tokens >= bound:
            return self._reject(request, bucket, "queued_tokens",
                                self._advice(self.predicted_ttft_s(now)))
        slack = config.reject_ttft_slack
        if slack is not None and math.isfinite(self.sla_ttft_s):
            wait = self.predicted_ttft_s(now)
            ttft = self.sla_ttft_s
            if wait is not None and wait > slack * ttft:
                return self._reject(request, bucket, "predicted_ttft", self._advice(wait))
            # its own prefill is a floor, not an estimate: compared with the TTFT itself, so
            # that a slack under 1 sheds by the wait, not by the prompt's length
            own = self.prefill_time_s(request, bucket, prompt)
            late_s = max(slack, 1.0) * ttft
            if own is not None and (wait or 0.0) + own.now_s > late_s:
                if own.alone_s > late_s:  # late even on an empty deployment: coming back
                    # cannot help
                    return self._reject(request, bucket, "predicted_ttft", None, retry=False)
                return self._reject(request, bucket, "predicted_ttft", self._advice(wait))
        return None

    def prefill_time_s(self, request: Request, bucket: int, prompt: int) -> PrefillTime | None:
        """An arrival's own prefill on the engines its bucket routes to
        (:meth:`~rlbatch.engine.base.Engine.prefill_time_s`), the least of each figure over
        them; ``None`` when none of them knows.

        :param request: the arrival.
        :param bucket: its bucket.
        :param prompt: its prompt as the engines would take it.
        """
        pool = self.routes[bucket]
        engines = self.engines if pool == ANY_POOL else self.pools[pool]
        least: PrefillTime | None = None
        for engine in engines:
            t = engine.prefill_time_s(request, prompt)
            if t is not None:
                least = t if least is None else PrefillTime(min(least.alone_s, t.alone_s),
                                                            min(least.now_s, t.now_s))
        return least

    def _advice(self, wait_s: float | None) -> float | None:
        """A refusal's ``Retry-After``: the predicted wait, at most
        :attr:`AdmissionConfig.max_retry_after_s`."""
        cap = self.config.max_retry_after_s
        if wait_s is None or cap is None:
            return wait_s
        return min(wait_s, cap)

    def leaves_running(self, request: Request, engine: Engine, engine_holds: bool) -> bool:
        """Whether ``request``, submitted at any iteration boundary from now on while the
        deployment is this one engine, nothing in it finishes, and (``engine_holds``) it admits
        no new request from its waiting queue, changes no engine's running requests: it is
        refused, joins that waiting queue, or waits in a queue that stays closed (its bucket
        at its cap, or the oldest eligible request held back by the KV budget, which only
        grows while requests run: with ``kv_commit="final"``, the only way the deployment
        asks; under deadline order also an engine at its ``max_num_seqs``, but not a late
        request held back by the budget, which an on-time arrival goes before). Such
        arrivals can be submitted later in the same tick, in order, with the same result
        (:meth:`~rlbatch.serving.deployment.Deployment.run_until`).

        :param request: a future arrival.
        :param engine: the deployment's one engine, after :meth:`admit` at this boundary.
        :param engine_holds: the engine admits no new request while nothing finishes.
        """
        prompt = request.prompt_tokens
        if prompt + request.max_output_tokens > self.max_model_len and (
                self.config.over_length == "reject"
                or self.max_model_len - request.max_output_tokens < 1):
            return True  # refused whenever it comes
        bucket = bisect_right(self._edges, prompt)  # self.buckets.index(prompt), inline
        cap = self.caps[bucket]
        if self.late_after_s is None:
            if cap is None:
                return engine_holds
            return self.budget_blocked or engine.num_unfinished(bucket) >= cap
        # deadline order (every bucket queues): a full engine stays full until something
        # finishes; an on-time arrival goes before a late request the budget holds back
        if cap is not None and engine.num_unfinished(bucket) >= cap:
            return True
        if engine.num_unfinished_total() >= engine.max_num_seqs:
            return True
        return self.budget_blocked and not self.blocked_late

    def admit_pool(self, pool: str, exclude: Collection[int] = ()) -> int:
        """Admit into every engine of ``pool``, least loaded first.

        :param pool: the pool.
        :param exclude: engine ids to skip (e.g. unreachable ones).
        :returns: the number admitted.
        """
        engines = [e for e in self.engines_of(pool) if e.engine_id not in exclude]
        if len(engines) > 1:
            engines.sort(key=_load)
        return sum(self.admit(e) for e in engines)

    def engines_of(self, pool: str) -> Sequence[Engine]:
        """The engines a bucket routed to ``pool`` may go to (:data:`ANY_POOL`: all).

        :param pool: a pool name or :data:`ANY_POOL`.
        """
        return self.engines if pool == ANY_POOL else self.pools[pool]

    def least_loaded(self, pool: str, *, bucket: int | None = None,
                     exclude: Collection[int] = ()) -> Engine | None:
        """The engine of ``pool`` holding the fewest requests (ties: lowest id).

        :param pool: the pool.
        :param bucket: only engines with room for this bucket under its cap in force.
        :param exclude: engine ids to skip.
        :returns: the engine, or ``None`` when none qualifies.
        """
        cap = None if bucket is None else self.caps[bucket]
        candidates = [e for e in self.engines_of(pool) if e.engine_id not in exclude
                      and (cap is None or bucket is None or e.num_unfinished(bucket) < cap)]
        return _least_loaded(candidates) if candidates else None

    def queued(self) -> tuple[int, ...]:
        """Per bucket, requests in the admission queue."""
        if not any(self.queues):
            return (0,) * len(self.queues)
        return tuple([len(q) for q in self.queues])

    def oldest_wait_s(self, now_s: float) -> tuple[float, ...]:
        """Per bucket, how long the head of the queue has waited at ``now_s``.

        :param now_s: the time.
        """
        if not any(self.queues):
            return (0.0,) * len(self.queues)
        return tuple([max(0.0, now_s - q[0][0].arrival_s) if q else 0.0 for q in self.queues])

    def num_queued(self) -> int:
        """Requests in all admission queues."""
        return sum([len(q) for q in self.queues])

    def take_rejected(self) -> list[FinishedRequest]:
        """The refusal records since the previous call (then forgotten)."""
        out = self.rejected
        self.rejected = []
        return out

    def take_accepted(self) -> list[tuple[int, float, int]]:
        """The requests accepted since the previous call (then forgotten); empty while
        :attr:`accepted` is ``None`` (not recording)."""
        out = self.accepted
        if out is None:
            return []
        self.accepted = []
        return out

    def take_counters(self) -> TickCounters:
        """The counters since the previous call (then reset)."""
        out = TickCounters(tuple(self.arrived_in_tick), tuple(self.rejected_in_tick),
                           tuple(self.cancelled_in_tick), self.budget_blocked_in_tick)
        n = len(self.buckets)
        self.arrived_in_tick = [0] * n
        self.rejected_in_tick = [0] * n
        self.cancelled_in_tick = [0] * n
        self.budget_blocked_in_tick = False
        return out

    def _reject(self, request: Request, bucket: int, reason: RejectReason,
                retry_after_s: float | None = None, finish_s: float | None = None,
                retry: bool | None = None) -> Rejected:
        """Count and record a refusal; ``retry`` (``None``: by
        :attr:`AdmissionConfig.retry_overload` and the reason) says whether the client may
        retry."""
        self.rejected_in_tick[bucket] += 1
        self.refusals[reason][bucket] += 1
        nan = float("nan")
        self.rejected.append(FinishedRequest(
            request_id=request.request_id, bucket=bucket, pool="",
            arrival_s=request.arrival_s, prompt_tokens=request.prompt_tokens, output_tokens=0,
            ttft_s=nan, tpot_s=nan, e2e_s=nan,
            finish_s=request.arrival_s if finish_s is None else finish_s, rejected=True))
        if retry is None:
            retry = self.config.retry_overload or reason not in OVERLOAD_REASONS
        return Rejected(bucket, reason, retry_after_s, retry)


def _load(engine: Engine) -> tuple[int, int]:
    """Least-loaded order: fewest requests inside, then lowest id."""
    return engine.num_unfinished_total(), engine.engine_id


def _least_loaded(engines: Sequence[Engine]) -> Engine:
    # One engine per pool is the common case and this runs for every uncapped arrival.
    return engines[0] if len(engines) == 1 else min(engines, key=_load)
