"""The decode lane: running requests in steady decode, advanced together by one counter.

In vLLM V1's scheduler every running request in decode gets one token per iteration. The
simulator keeps such requests in a lane instead of updating each one every iteration: a
request that joins at counter ``epoch`` with ``num_output`` tokens has ``num_output =
out_base + epoch`` later (``out_base = num_output - epoch`` at joining), computed tokens
``prompt + num_output - 1`` and ``ceil(computed / block)`` KV blocks. What an iteration of
the lane needs then costs O(1), not O(requests):

* the context the decodes attend to: ``sum(prompt + out_base) + n * epoch``;
* the KV blocks it allocates: a request needs a new block when its computed tokens are a
  multiple of the block size, so the lane counts its requests by ``(prompt + out_base - 1)
  mod block`` and reads the count at ``-epoch mod block``;
* the requests that finish, and those whose KV reserve starts to grow
  (``rlbatch.engine.reserve``): two heaps keyed by the counter value at which that happens,
  then by running order; a request that outgrew its reserve is counted at ``prompt + 2 x
  num_output`` rounded up to whole blocks, which moves only when ``prompt + 2 x out_base +
  2 x epoch`` passes a block boundary. So such requests are kept in one list per ``(prompt
  + 2 x out_base) mod block``, and the engine, when it reads its committed KV, brings up to
  date only the lists whose counts moved since it last did (:meth:`DecodeLane.moved`).

Only the requests that need something (a finish, a growth) are touched, and only then are
their fields written back (:meth:`DecodeLane.sync`). The engine decides when a request joins
(its prefill is done and every request before it in the running order is in the lane too)
and empties the lane (:meth:`DecodeLane.clear`) before any iteration it schedules request by
request.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from rlbatch.engine.sim_seq import SimSeq

NEVER = 1 << 62
"""A counter value no run reaches (a request whose reserve never grows)."""


class DecodeLane:
    """Running requests in decode, in lockstep (see the module docstring).

    :param block_size: tokens per KV block.
    """

    __slots__ = ("_moved_one", "block_size", "epoch", "finish_heap", "grow_heap", "growing",
                 "kv_base", "max_order", "n", "residues", "synced_epoch")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.epoch = 0
        """Iterations the lane has advanced (its counter)."""
        self.n = 0
        """Requests in the lane."""
        self.kv_base = 0
        """``sum(prompt + out_base)``: the decodes attend to ``kv_base + n * epoch`` tokens."""
        self.residues = [0] * block_size
        """Requests by ``(prompt + out_base - 1) mod block_size``."""
        self.finish_heap: list[tuple[int, int, SimSeq]] = []
        self.grow_heap: list[tuple[int, int, SimSeq]] = []
        """First growths to come: ``(counter value, order, request)``."""
        self.growing: list[list[SimSeq]] = [[] for _ in range(block_size)]
        """Requests that outgrew their reserve (their count follows their output until it
        reaches their limit), by ``(prompt + 2 x out_base) mod block_size``; may hold
        requests that left the lane since."""
        self.synced_epoch = 0
        """The counter when the engine last brought the growing requests' counts up to
        date."""
        # moved() over one counter step, by the counter mod block_size (the common case)
        self._moved_one = [tuple(sorted({(1 - 2 * e) % block_size, (2 - 2 * e) % block_size}))
                           for e in range(block_size)]
        self.max_order = -1
        """Highest running-order key that joined since the lane was last empty."""

    def join(self, seq: SimSeq) -> None:
        """Take a running request whose fields are current (``num_computed = prompt +
        num_output - 1``, its blocks held) and that has not finished."""
        base = seq.num_output - self.epoch
        seq.out_base = base
        seq.in_lane = True
        self.n += 1
        self.kv_base += seq.prompt_len + base
        self.residues[(seq.prompt_len + base - 1) % self.block_size] += 1
        heapq.heappush(self.finish_heap, (seq.max_output - base, seq.order, seq))
        if seq.grow_at < seq.max_output:  # else it finishes before its count would grow
            heapq.heappush(self.grow_heap, (seq.grow_at - base, seq.order, seq))
        if seq.order > self.max_order:
            self.max_order = seq.order

    def grow(self, seq: SimSeq) -> int:
        """A lane request whose count follows its output from now on; its list (residue)."""
        residue = (seq.prompt_len + 2 * seq.out_base) % self.block_size
        self.growing[residue].append(seq)
        return residue

    def moved(self, since: int) -> Sequence[int]:
        """The growing lists (residues) whose counts may have moved from counter ``since`` to
        now: ``ceil(y / block)`` with ``y = prompt + 2 x num_output`` rises from one
        counter value to the next exactly when ``y mod block`` becomes 1 or 2."""
        block = self.block_size
        steps = self.epoch - since
        if steps == 1:
            return self._moved_one[self.epoch % block]
        if steps >= -(-block // 2):
            return range(block)
        out: set[int] = set()
        for epoch in range(since + 1, self.epoch + 1):
            out.add((1 - 2 * epoch) % block)
            out.add((2 - 2 * epoch) % block)
        return sorted(out)

    def sync(self, seq: SimSeq) -> None:
        """Write a lane request's current progress into its fields."""
        out = seq.out_base + self.epoch
        seq.num_output = out
        computed = seq.prompt_len + out - 1
        seq.num_computed = computed
        seq.blocks = -(-computed // self.block_size)

    def blocks_of(self, seq: SimSeq) -> int:
        """KV blocks a lane request holds now."""
        return -(-(seq.prompt_len + seq.out_base + self.epoch - 1) // self.block_size)

    def num_output_of(self, seq: SimSeq) -> int:
        """Tokens a lane request has generated by now."""
        return seq.out_base + self.epoch

    def kv_decode(self) -> int:
        """Context the lane's decodes attend to in the next iteration (``sum(num_computed +
        1)``)."""
        return self.kv_base + self.n * self.epoch

    def blocks_needed(self) -> int:
        """New KV blocks the lane allocates in the next iteration."""
        return self.residues[-self.epoch % self.block_size]

    def pop_finished(self) -> list[SimSeq]:
        """The requests that reached their last token by the counter (in running order),
        synced and out of the lane."""
        heap = self.finish_heap
        epoch = self.epoch
        block = self.block_size
        out: list[SimSeq] = []
        while heap and heap[0][0] <= epoch:
            seq = heapq.heappop(heap)[2]
            self.sync(seq)
            base = seq.prompt_len + seq.out_base  # out of the lane
            seq.in_lane = False
            self.n -= 1
            self.kv_base -= base
            self.residues[(base - 1) % block] -= 1
            out.append(seq)
        if self.n == 0:
            self.max_order = -1
        return out

    def remove(self, seq: SimSeq) -> None:
        """Take a request out of the lane before its last token (an abort), its progress
        written back. O(requests): its heap entries are filtered out (a stale entry would
        end a decode run early, or finish it); the growing lists may keep it (they skip
        requests that left)."""
        self.sync(seq)
        base = seq.prompt_len + seq.out_base
        seq.in_lane = False
        self.n -= 1
        self.kv_base -= base
        self.residues[(base - 1) % self.block_size] -= 1
        self.finish_heap = [e for e in self.finish_heap if e[2] is not seq]
        heapq.heapify(self.finish_heap)
        self.grow_heap = [e for e in self.grow_heap if e[2] is not seq]
        heapq.heapify(self.grow_heap)
        if self.n == 0:
            self.max_order = -1

    def clear(self, running: list[SimSeq]) -> None:
        """Write every lane request's progress back and empty the lane.

        :param running: the engine's running requests (the lane's are among them).
        """
        for seq in running:
            if seq.in_lane:
                self.sync(seq)
                seq.in_lane = False
        self.n = 0
        self.kv_base = 0
        self.residues = [0] * self.block_size
        self.finish_heap = []
        self.grow_heap = []
        self.growing = [[] for _ in range(self.block_size)]
        self.max_order = -1
