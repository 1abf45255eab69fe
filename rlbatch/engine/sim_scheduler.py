"""The simulated engine's scheduler with event skipping: many iterations for the price of few.

:class:`SimScheduler` runs the iterations of :class:`~rlbatch.engine.sim_exact.
ExactScheduler` faster, with the same result to the last bit (tests/test_sim.py holds every
path to event skipping off, which is the request-by-request reference):

* :meth:`SimScheduler._iterate_lane`: the requests in steady decode advance as one
  :class:`~rlbatch.engine.decode_lane.DecodeLane`; only the others (prefills, new
  admissions) and the requests that finish or grow their KV reserve are touched one by one.
  An iteration that would preempt, or that would not schedule the whole lane, runs request
  by request instead;
* :meth:`SimScheduler._skip`: a run of pure-decode iterations costs one float sum each.

:meth:`SimScheduler.step` keeps the Engine protocol's granularity (one iteration, then a
decode run that stops before a completion); :meth:`SimScheduler.advance`, for the deployment,
may also end a run with the iteration that completes a request.
"""

from __future__ import annotations

import heapq
import math

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.decode_lane import NEVER, DecodeLane
from rlbatch.engine.host_tier import HostLink
from rlbatch.engine.sim_exact import ExactScheduler
from rlbatch.engine.sim_seq import SimSeq
from rlbatch.profiles import StepTimeModel


class SimScheduler(ExactScheduler):
    """A simulated engine's scheduler with event skipping (see the module docstring).

    :param pool: pool name (``fp16`` / ``fp8``), for the finished records.
    :param config: scheduler and cache settings.
    :param step_model: step-time model for this engine's GPU, model and precision.
    :param num_kv_blocks: KV blocks in the pool.
    :param num_buckets: number of prompt-length buckets.
    :param max_model_len: longest sequence (the KV reserve's ceiling).
    :param event_skipping: use the lane and skip decode runs; ``False``: every iteration
        request by request (the reference).
    :param start_s: initial clock.
    :param host_link: the host tier's block bytes and copy time, needed when
        ``config.kv_offload_gib > 0``.
    """

    def __init__(self, pool: str, config: EngineConfig, step_model: StepTimeModel,
                 num_kv_blocks: int, num_buckets: int, max_model_len: int, *,
                 event_skipping: bool, start_s: float,
                 host_link: HostLink | None = None) -> None:
        super().__init__(pool, config, step_model, num_kv_blocks, num_buckets, max_model_len,
                         event_skipping=event_skipping, start_s=start_s, host_link=host_link)
        # running requests outside the lane, in running order (event skipping only; all of
        # them come after every lane request in the running order)
        self._explicit: list[SimSeq] = []
        self._lane = DecodeLane(config.block_size)
        # The last iteration finished and preempted nothing and scheduled every running
        # request (_prefilled: it had prefill): pure-decode runs may be skipped after it.
        self._decode_run = False
        self._prefilled = False

    # ----------------------------------------------------------------- one call
    def step(self, bound_s: float, skip_before_s: float = math.inf) -> None:
        """Run one iteration; with event skipping, if it was pure decode, also the pure-decode
        iterations that follow and start before ``bound_s``, up to (not including) the next
        one in which a request finishes (the Engine protocol's contract: a caller that reads
        the engine after every step sees each completion's iteration on its own).

        :param bound_s: no skipped iteration starts at or after this time; a wait for copies
            from the host tier ends there at the latest.
        :param skip_before_s: no skipped iteration starts at or after this time either (a
            caller with something to do then that does not end a wait: another engine's
            boundary).
        """
        self._run(bound_s, False, bound_s if bound_s < skip_before_s else skip_before_s)

    def advance(self, bound_s: float, then_s: float = -math.inf) -> None:
        """As :meth:`step`, for a caller that only needs the engine exact at the boundaries
        it is called at (the deployment): pure-decode iterations are also skipped after an
        iteration with prefill, and a skipped run ends with the iteration in which a request
        finishes. Same result, fewer calls.

        :param bound_s: no skipped iteration starts at or after this time.
        :param then_s: the caller has nothing to do at the boundaries before this time (no
            arrival due, nothing queued outside the engine): the engine goes on, iteration
            after iteration, until one would start at or after it (or it is idle).
        """
        self._run(bound_s, True, bound_s)
        while self._now < then_s and (self._running or self._waiting or self._loading):
            before = self._now
            self._run(then_s, True, then_s)
            if self._now == before:
                return  # nothing could run (the exact path's empty iteration)

    def _run(self, bound_s: float, greedy: bool, skip_to: float) -> None:
        """One iteration (a wait ends at ``bound_s`` at the latest), and with event skipping
        the pure-decode iterations that start before ``skip_to`` (<= ``bound_s``)."""
        if not self.event_skipping:
            self._iterate_exact(bound_s)
            return
        if self._decode_run and (greedy or not self._prefilled) and self._skip(skip_to, greedy):
            return
        if self._aborted_loads:  # their blocks return as an iteration starts
            self._free_aborted_loads()
        if not self._iterate_lane(bound_s):
            self._leave_lane()
            self._iterate_exact(bound_s)
            self._explicit = list(self._running)
            self._decode_run = False
        if self._decode_run and (greedy or not self._prefilled) and self._now < skip_to:
            self._skip(skip_to, greedy)

    def _leave_lane(self) -> None:
        """Every running request back to its own fields (the lane's reserve growths
        applied first), for an iteration request by request or a fork."""
        self._kv_version += 1
        lane = self._lane
        if lane.n:
            self._sync_growth()
            next_growth_at = self._reserve.next_growth_at
            for group in lane.growing:
                for seq in group:
                    if seq.in_lane:
                        seq.grow_at = next_growth_at(seq.committed, seq.kv_limit,
                                                     seq.prompt_len)
            lane.clear(self._running)
        self._explicit = list(self._running)

    # ----------------------------------------------------------------- the decode lane
    def _iterate_lane(self, bound_s: float) -> bool:
        """One iteration with the lane's requests advanced together; ``False`` (nothing
        changed) when it needs the request-by-request path: the lane would not all be
        scheduled, or an allocation would fail (preemption). With nothing to run but copies
        from the host tier, a wait for the first one (at most to ``bound_s``), as the exact
        path's."""
        lane = self._lane
        explicit = self._explicit
        block = self._block_size
        in_lane = lane.n
        budget = self._budget - in_lane
        if budget < 0:
            return False
        free = self._free_blocks
        epoch = lane.epoch
        if in_lane:
            free -= lane.residues[-epoch % block]
            if free < 0 or (explicit and explicit[0].order <= lane.max_order):
                return False
        sched: list[tuple[SimSeq, int]] = []
        prefill_tokens = 0
        attn_work = 0.0
        num_decode = in_lane
        kv_decode = lane.kv_base + in_lane * epoch
        if explicit:
            if not _fits(explicit, budget, free, block):
                return False
            for seq in explicit:
                if budget <= 0:
                    break
                remaining = seq.prompt_len + seq.num_output - seq.num_computed
                n = remaining if remaining < budget else budget
                need = -(-(seq.num_computed + n) // block) - seq.blocks
                free -= need
                seq.blocks += need
                sched.append((seq, n))
                if seq.uncached:
                    self._register(seq, seq.num_computed + n, free)
                if remaining == 1 and seq.num_computed > 0:
                    num_decode += 1
                    kv_decode += seq.num_computed + 1
                else:
                    prefill_tokens += n
                    attn_work += n * (seq.num_computed + (n + 1) / 2)
                budget -= n
        all_scheduled = len(sched) == len(explicit)
        running = self._running
        admitted: list[SimSeq] = []
        budget, free, prefill_tokens, attn_work = self._admit_waiting(
            sched, admitted, budget, free, prefill_tokens, attn_work)

        self._free_blocks = free
        if prefill_tokens == 0 and not sched and not in_lane:
            self._kv_version += 1
            self._decode_run = False
            if self._loading or self._aborted_loads:
                self._wait_for_loads(bound_s)
            return True  # nothing to run (as the exact path)
        now = self._advance(prefill_tokens, attn_work, num_decode, kv_decode, len(admitted))
        before = len(running)
        lane.epoch = epoch = epoch + 1
        if in_lane and lane.finish_heap[0][0] <= epoch:
            for seq in lane.pop_finished():
                self._finish(seq, now)
        if sched:
            for seq, n in sched:
                self._account(seq, n, now)
            # the requests now in steady decode join the lane, up to the first that is not
            if admitted:
                explicit = explicit + admitted if explicit else admitted
            kept = 0
            for seq in explicit:
                if seq.num_output >= seq.max_output:
                    continue  # finished
                if kept == 0 and seq.num_output > 0 \
                        and seq.num_computed == seq.prompt_len + seq.num_output - 1:
                    lane.join(seq)
                else:
                    kept += 1
            self._explicit = [s for s in explicit if not s.in_lane
                              and s.num_output < s.max_output] if kept else []
        self._decode_run = all_scheduled and len(running) == before
        self._prefilled = prefill_tokens > 0
        if not self._decode_run or self._prefilled:
            self._kv_version += 1
        used = self.num_kv_blocks - self._free_blocks
        if used > self._peak_used_blocks:
            self._peak_used_blocks = used
        return True

    def _skip(self, bound_s: float, greedy: bool) -> bool:
        """Advance the pure-decode iterations that follow (every running request in the
        lane, none can be admitted) that start before ``bound_s``, up to the first one in
        which a request finishes (``greedy``: included, the run stops after it) or a block
        allocation could fail (not included); whether any was advanced."""
        lane = self._lane
        n = lane.n
        if n == 0 or self._explicit or n > self._budget or self._wake_left \
                or (self._shapes is not None and n not in self._shapes) \
                or (self._waiting and not self._admission_blocked()):
            return False
        if self._loading or self._aborted_loads:
            # the first iteration after a copy completed may admit its request (or reclaim)
            ready = self._next_copy_s()
            if ready < bound_s:
                bound_s = ready
        to_finish = lane.finish_heap[0][0] - lane.epoch - (not greedy)
        coeffs = self._decode_coeffs.get(n)  # self._coefficients(n), its lookup inline
        base, per_kv = coeffs if coeffs is not None else self._coefficients(n)
        kv = lane.kv_base + n * lane.epoch
        residues = lane.residues
        block = self._block_size
        j = -lane.epoch % block
        free = self._free_blocks
        now = self._now
        busy = self._busy_s
        k = 0
        start = now
        if n * -(-to_finish // block) <= free:
            # no allocation can fail on the way: the clock alone, the blocks summed after
            k = to_finish
            for context in range(kv, kv + n * to_finish, n):  # the decodes' context, step n
                if now >= bound_s:
                    k = (context - kv) // n
                    break
                dt = base + per_kv * context
                start = now
                now += dt
                busy += dt
            if k == 0:
                return False
            need = residues[(j - k + 1) % block]  # the last iteration's
            # whole turns of the residues take a block each; then residues j, j-1, ... (mod)
            part = k % block
            taken = k // block * n + (sum(residues[j - part + 1:j + 1]) if part <= j + 1 else
                                      sum(residues[:j + 1]) + sum(residues[block + j + 1 - part:]))
            free -= taken
        else:
            while k < to_finish and now < bound_s:
                need = residues[j]
                if need > free:
                    break
                free -= need
                dt = base + per_kv * kv
                start = now
                now += dt
                busy += dt
                kv += n
                k += 1
                j = j - 1 if j else block - 1
            if k == 0:
                return False
        self._last_start = start
        self._now = now
        self._busy_s = busy
        self._iterations += k
        self._decode_tokens += n * k
        lane.epoch += k
        if self._shapes is not None:
            self._shapes.move_to_end(n)  # the run's size is the most recent
        # the peak usage (_note_usage, inline: once or twice per call)
        total = self.num_kv_blocks
        if greedy and k == to_finish:
            # the last iteration finished requests: the peak is before their blocks return
            if total - free - need > self._peak_used_blocks:
                self._peak_used_blocks = total - free - need
            self._free_blocks = free
            for seq in lane.pop_finished():
                self._finish(seq, now)
            self._decode_run = False
        else:
            self._free_blocks = free
        used = total - self._free_blocks
        if used > self._peak_used_blocks:
            self._peak_used_blocks = used
        return True

    def _drop_running(self, seq: SimSeq) -> None:
        """An aborted running request leaves the decode lane or the requests outside it,
        then the running list. The next call runs an iteration before any decode run (the
        run's composition changed)."""
        if seq.in_lane:
            self._lane.remove(seq)
        elif seq in self._explicit:
            self._explicit.remove(seq)
        self._decode_run = False
        super()._drop_running(seq)

    def _sync_growth(self) -> None:
        """Bring the lane's counted KV up to date (before the committed KV is read): the
        requests that reached their first growth join the growing lists, and the requests
        on the lists whose counts moved since the last time (:meth:`DecodeLane.moved`), or
        that one joined, are counted at their output now (the growth is a pure function of
        it, so a request whose count did not move is counted the same again)."""
        lane = self._lane
        heap = lane.grow_heap
        epoch = lane.epoch
        visit = lane.moved(lane.synced_epoch) if epoch != lane.synced_epoch else ()
        lane.synced_epoch = epoch
        if heap and heap[0][0] <= epoch:
            joined: list[int] = []
            while heap and heap[0][0] <= epoch:
                seq = heapq.heappop(heap)[2]
                if seq.in_lane:
                    residue = lane.grow(seq)
                    if residue not in visit and residue not in joined:
                        joined.append(residue)
            if joined:
                visit = [*visit, *joined]
        if not visit:
            return
        grown = self._reserve.grown
        total = self._committed_tokens
        growing = lane.growing
        for residue in visit:
            group = growing[residue]
            if not group:
                continue
            keep = []
            for seq in group:
                if not seq.in_lane:
                    continue  # finished since
                committed = grown(seq.committed, seq.kv_limit, seq.prompt_len,
                                  seq.out_base + epoch)
                total += committed - seq.committed
                seq.committed = committed
                if committed < seq.kv_limit:
                    keep.append(seq)
                else:
                    seq.grow_at = NEVER
            growing[residue] = keep
        self._committed_tokens = total


def _fits(explicit: list[SimSeq], budget: int, free: int, block: int) -> bool:
    """Whether the requests outside the lane get their chunks, in order, within the token
    budget left, without an allocation failing (the lane path never preempts)."""
    for seq in explicit:
        if budget <= 0:
            break
        remaining = seq.prompt_len + seq.num_output - seq.num_computed
        n = remaining if remaining < budget else budget
        need = -(-(seq.num_computed + n) // block) - seq.blocks
        if need > free:
            return False
        free -= need
        budget -= n
    return True
