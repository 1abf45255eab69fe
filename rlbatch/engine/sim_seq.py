"""The simulator's mutable scheduler state of one request (``SimSeq``)."""

from __future__ import annotations

from rlbatch.engine.prefix_cache import Layout
from rlbatch.request import Request

_NO_EXTENTS: list[int] = []
"""The extents of every request before its first prefix lookup, shared: never written (a
request gets its own list at that lookup, :mod:`rlbatch.engine.sim_caches`), and one list
fewer per request for the allocator and the garbage collector (the waiting queue can hold
thousands)."""


class SimSeq:
    """Mutable scheduler state of one request inside a simulated engine.

    While a request is in its engine's :class:`~rlbatch.engine.decode_lane.DecodeLane`
    (``in_lane``), ``num_output``, ``num_computed`` and ``blocks`` hold the values of when it
    joined; the lane derives the current ones from its counter (``DecodeLane.sync`` writes
    them back).

    With prefix caching (:mod:`rlbatch.engine.prefix_cache`), ``prefix`` is its prefix
    information ``(Mooncake ids, first kept token)``, ``None`` when it has none (nothing to
    look up: the check on the hot path); ``layout`` the groups of its hashed blocks (derived
    at its first lookup); ``extents`` its blocks held in each group; ``cached`` how many
    cached blocks it holds; ``uncached`` how many of its hashed blocks were not registered
    yet (0 when there is nothing to register: the other check on the hot path).

    With the host tier (:mod:`rlbatch.engine.host_tier`), ``host_low`` and ``host_done`` are
    the first and the end of its blocks the host pool saw (offered or loaded; ``host_low``
    -1 before any), and ``ready_s`` when the copy of its blocks from the host completes
    while it waits in the engine's loading list.

    ``prefilled`` counts the prompt tokens (and, after a preemption, the output tokens so far)
    its admissions are to prefill, hits and host copies excluded; ``prefill_end`` is where
    the current admission's prefill ends (0 while it waits). Both change only at an admission
    or a preemption, never per iteration: the part of ``prefill_end`` not computed yet is
    taken back when it is preempted or aborted (``AbortedRequest.prefill_tokens_computed``).
    """

    __slots__ = (
        "arrival_s",
        "blocks",
        "bucket",
        "cached",
        "committed",
        "extents",
        "first_token_s",
        "grow_at",
        "host_done",
        "host_low",
        "in_lane",
        "kv_limit",
        "layout",
        "max_output",
        "num_computed",
        "num_output",
        "order",
        "out_base",
        "preemptions",
        "prefill_end",
        "prefilled",
        "prefix",
        "prompt_len",
        "ready_s",
        "request_id",
        "truncated",
        "uncached",
    )

    def __init__(self, request: Request, bucket: int, prompt_len: int, truncated: bool,
                 prefix: tuple[tuple[int, ...], int] | None = None) -> None:
        self.request_id = request.request_id
        self.arrival_s = request.arrival_s
        self.bucket = bucket
        self.prompt_len = prompt_len
        self.max_output = request.max_output_tokens
        self.truncated = truncated
        self.num_output = 0
        self.num_computed = 0
        self.blocks = 0
        self.first_token_s = -1.0
        self.preemptions = 0
        self.prefilled = 0
        self.prefill_end = 0
        # KV the admission budget counts (rlbatch.engine.reserve), its ceiling, and the
        # output count at which the count grows next.
        self.committed = 0
        self.kv_limit = 0
        self.grow_at = 0
        # position in the running order (a counter taken when it enters the running list)
        self.order = -1
        # decode lane: in it, and num_output = out_base + the lane's counter
        self.in_lane = False
        self.out_base = 0
        self.prefix = prefix
        self.layout: Layout | None = None
        self.extents: list[int] = _NO_EXTENTS
        self.cached = 0
        self.uncached = 0
        self.host_low = -1
        self.host_done = 0
        self.ready_s = 0.0
