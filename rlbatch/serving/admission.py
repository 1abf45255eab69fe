"""Admission control: per-bucket FIFO queues in front of the engines.

A request waits in its bucket's queue until an engine of the bucket's pool holds fewer of
that bucket's requests than the bucket's cap; admission runs at every engine iteration (as
vLLM's scheduler admits at every step), so a finished request frees its slot at once.
Buckets without a cap (``None``) pass straight through to the engine's own FIFO queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request

OverLengthPolicy = Literal["reject", "truncate"]


@dataclass(frozen=True)
class AdmissionConfig:
    """How requests are let in.

    :param over_length: a request whose prompt + output exceeds ``max_model_len``:
        ``reject`` (vLLM's behaviour, counted) or ``truncate`` (keep the prompt's last tokens
        so it fits, counted).
    :param max_queue_len: per-bucket queue bound; a request arriving at a full queue is
        rejected (counted). ``None`` = unbounded.
    """

    over_length: OverLengthPolicy = "reject"
    max_queue_len: int | None = None

    def __post_init__(self) -> None:
        if self.over_length not in ("reject", "truncate"):
            raise ValueError(f"over_length must be 'reject' or 'truncate', got "
                             f"{self.over_length!r}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1 or None, got {self.max_queue_len}")


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
        self.max_model_len = max_model_len
        self.config = config
        self.pools: dict[str, list[Engine]] = {}
        for eng in engines:
            self.pools.setdefault(eng.pool, []).append(eng)
        n = len(buckets)
        self.queues: list[deque[tuple[Request, int, bool]]] = [deque() for _ in range(n)]
        self.caps: tuple[int | None, ...] = (None,) * n
        self.kv_budget_fraction: float | None = None
        self.budget_blocked_in_tick = False
        self.routes: tuple[str, ...] = (engines[0].pool,) * n
        self.rejected: list[FinishedRequest] = []
        self.arrived_in_tick = [0] * n
        self.rejected_in_tick = [0] * n

    def apply(self, action: ControlAction) -> None:
        """Put a (guarded) action in force."""
        if len(action.caps) != len(self.buckets):
            raise ValueError(f"action has {len(action.caps)} caps, deployment has "
                             f"{len(self.buckets)} buckets")
        for pool in action.pools:
            if pool not in self.pools:
                raise ValueError(f"action routes to pool {pool!r}; deployment pools: "
                                 f"{sorted(self.pools)}")
        self.caps = action.caps
        self.routes = action.pools
        self.kv_budget_fraction = action.kv_budget_fraction
        if action.max_num_seqs is not None:
            for eng in self.engines:
                eng.set_max_num_seqs(action.max_num_seqs)

    def submit(self, request: Request) -> None:
        """A request arrives: bucket it, apply the length policy, queue it (or pass it on)."""
        bucket = self.buckets.index(request.prompt_tokens)
        self.arrived_in_tick[bucket] += 1
        prompt = request.prompt_tokens
        truncated = False
        if prompt + request.max_output_tokens > self.max_model_len:
            room = self.max_model_len - request.max_output_tokens
            if self.config.over_length == "reject" or room < 1:
                self._reject(request, bucket)
                return
            prompt, truncated = room, True
        queue = self.queues[bucket]
        if self.caps[bucket] is None:
            self._least_loaded(self.routes[bucket]).add_request(request, bucket, prompt,
                                                                truncated)
            return
        if self.config.max_queue_len is not None and len(queue) >= self.config.max_queue_len:
            self._reject(request, bucket)
            return
        queue.append((request, prompt, truncated))

    def admit(self, engine: Engine) -> int:
        """Move queued requests into ``engine`` while their buckets are under cap (oldest
        head first across buckets) and, with a KV budget in force, while the committed KV
        stays within it. Under the budget admission is FIFO across buckets: when the oldest
        eligible request does not fit, nothing younger overtakes it (no bucket starves).
        Returns the number admitted."""
        admitted = 0
        queues = self.queues
        caps = self.caps
        routes = self.routes
        pool = engine.pool
        budget = (None if self.kv_budget_fraction is None
                  else self.kv_budget_fraction * engine.kv_capacity_tokens)
        while True:
            best = -1
            best_arrival = 0.0
            for b, queue in enumerate(queues):
                if not queue or routes[b] != pool:
                    continue
                cap = caps[b]
                if cap is not None and engine.num_unfinished(b) >= cap:
                    continue
                arrival = queue[0][0].arrival_s
                if best < 0 or arrival < best_arrival:
                    best, best_arrival = b, arrival
            if best < 0:
                return admitted
            request, prompt, truncated = queues[best][0]
            if budget is not None:
                committed = engine.committed_tokens()
                if committed > 0 and committed + prompt + request.max_output_tokens > budget:
                    self.budget_blocked_in_tick = True
                    return admitted
            queues[best].popleft()
            engine.add_request(request, best, prompt, truncated)
            admitted += 1

    def queued(self) -> tuple[int, ...]:
        return tuple(len(q) for q in self.queues)

    def oldest_wait_s(self, now_s: float) -> tuple[float, ...]:
        """Per bucket, how long the head of the queue has waited at ``now_s``."""
        return tuple(max(0.0, now_s - q[0][0].arrival_s) if q else 0.0 for q in self.queues)

    def num_queued(self) -> int:
        return sum(len(q) for q in self.queues)

    def take_tick_counters(self) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """Arrivals and rejections per bucket since the last call, and whether the KV budget
        held a request back."""
        out = (tuple(self.arrived_in_tick), tuple(self.rejected_in_tick),
               self.budget_blocked_in_tick)
        n = len(self.buckets)
        self.arrived_in_tick = [0] * n
        self.rejected_in_tick = [0] * n
        self.budget_blocked_in_tick = False
        return out

    def _least_loaded(self, pool: str) -> Engine:
        engines = self.pools[pool]
        if len(engines) == 1:
            return engines[0]
        return min(engines, key=lambda e: (e.num_unfinished_total(), e.engine_id))

    def _reject(self, request: Request, bucket: int) -> None:
        self.rejected_in_tick[bucket] += 1
        nan = float("nan")
        self.rejected.append(FinishedRequest(
            request_id=request.request_id, bucket=bucket, pool="",
            arrival_s=request.arrival_s, prompt_tokens=request.prompt_tokens, output_tokens=0,
            ttft_s=nan, tpot_s=nan, e2e_s=nan, finish_s=request.arrival_s, rejected=True))
