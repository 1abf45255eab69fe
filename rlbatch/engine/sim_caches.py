"""The KV caches' side of the simulated scheduler: prefix lookups, hashes, loads from the host.

:class:`CacheScheduler` is the base of :class:`~rlbatch.engine.sim_exact.ExactScheduler`: it
owns the engine's prefix cache (:mod:`rlbatch.engine.prefix_cache`), its host tier
(:mod:`rlbatch.engine.host_tier`) and the requests waiting for a copy from the host, and does
what happens to a request's blocks as the scheduler admits, runs and releases it:

* admission of a request with prefix information: its longest cached prefix is held and
  counts as computed (vLLM's ``get_computed_blocks``); with the host tier, a prefix that
  continues in the host pool is copied in first, the request waiting in the *loading* list
  (vLLM's ``WAITING_FOR_REMOTE_KVS``: it holds its blocks, takes no running slot and no
  token budget) and joining the running list, ahead of the waiting queue, at the first
  iteration that starts once its copy completed;
* the blocks a request fills get their hashes when scheduled (``cache_blocks``), and with
  the host tier are offered to the host pool (write-through, as vLLM's offloading connector
  stores every computed block);
* a request leaving the running list returns its blocks tail first, the cached ones to the
  LRU queue; a finished one ranks its blocks in the host pool again;
* an aborted request waiting for a copy from the host keeps its blocks until the copy
  completes (vLLM's ``finish_requests`` delays freeing a ``WAITING_FOR_REMOTE_KVS``
  request's blocks until its transfer is reported done; the copy on the link is not
  cancelled): they return at the first iteration that starts once it completed, or when an
  idle engine's clock passes it.
"""

from __future__ import annotations

import math

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.host_tier import HostLink, HostTier, host_capacity_blocks
from rlbatch.engine.prefix_cache import Layout, PrefixCache, prefix_layout
from rlbatch.engine.sim_seq import SimSeq
from rlbatch.request import Request


class CacheScheduler:
    """The prefix cache, the host tier and the loading list of one simulated engine.

    :param config: scheduler and cache settings.
    :param host_link: the host tier's block bytes and copy time, needed when
        ``config.kv_offload_gib > 0``.
    """

    # the scheduler's state these methods read and change (ExactScheduler sets it)
    _block_size: int
    _budget: int
    _max_num_seqs: int
    _now: float
    _last_start: float
    _free_blocks: int
    _order: int
    _running: list[SimSeq]
    _in_running: list[int]

    def __init__(self, config: EngineConfig, host_link: HostLink | None) -> None:
        self._cache = PrefixCache() if config.enable_prefix_caching else None
        self._host: HostTier | None = None
        if config.kv_offload_gib > 0:
            if host_link is None:
                raise ValueError(f"kv_offload_gib={config.kv_offload_gib} needs the host link "
                                 f"(block bytes and copy time): pass host_link")
            self._host = HostTier(host_capacity_blocks(config.kv_offload_gib, host_link),
                                  host_link)
        # requests whose prefix is being copied from the host tier, in the order issued
        self._loading: list[SimSeq] = []
        # aborted requests whose copy from the host is still in flight: their blocks held
        self._aborted_loads: list[SimSeq] = []

    # ----------------------------------------------------------------- prefix caching
    def _take_cached_prefix(self, seq: SimSeq, budget: int, free: int) -> tuple[int, int]:
        """Admit a waiting request with prefix information if its first chunk fits: its
        cached prefix (at most ``num_tokens - 1`` tokens, whole blocks) is held and counts as
        computed, the chunk after it gets new blocks (vLLM's ``get_computed_blocks`` then
        ``allocate_slots``: a free cached block taken costs a free block as well).

        With the host tier, a prefix that continues there is copied in first
        (:meth:`_start_load`).

        :returns: the chunk's tokens (0: it does not fit, nothing changed; -1: it waits for
            a copy from the host tier) and the free blocks after.
        """
        cache = self._cache
        assert cache is not None
        layout = self._layout(seq)
        block = self._block_size
        num_tokens = seq.prompt_len + seq.num_output
        max_blocks = min(seq.uncached, (num_tokens - 1) // block)
        least = num_tokens - max_blocks * block  # the chunk after the longest possible hit
        if -(-(least if least < budget else budget) // block) > free:
            return 0, free  # hopeless whatever is cached: no lookup
        hit = cache.lookup(layout, max_blocks, free)
        host = self._host
        if host is not None and hit < max_blocks:
            loaded = host.lookup(layout, hit, max_blocks)
            if loaded:
                return self._start_load(seq, layout, hit, loaded, free)
        cached_tokens = hit * block
        remaining = num_tokens - cached_tokens
        n = remaining if remaining < budget else budget
        taken = cache.evictable(layout, hit) if hit else 0
        need = -(-n // block) + taken
        if need > free:
            return 0, free
        seq.extents = [0] * len(layout[0])  # its own list (a fork shares a waiting one's)
        if hit:
            cache.touch(layout, hit, seq.extents)
            seq.num_computed = cached_tokens
        seq.cached = hit
        seq.uncached -= hit
        seq.blocks = hit + need - taken
        if not seq.preemptions:
            cache.hits += cached_tokens
        if host is not None and seq.host_done < hit:
            self._offer(seq, layout, seq.host_done, hit)  # its GPU hit, where the host lacks it
        return n, free - need

    def cached_prompt_tokens(self, request: Request, prompt_tokens: int) -> int:
        """Prompt tokens of an arrival this engine would find computed if it were scheduled
        now: its prefix in the GPU cache, then in the host tier (copied in, not computed).
        Reads, changes nothing (:meth:`~rlbatch.engine.prefix_cache.PrefixCache.peek`: the
        evictions the allocations since the cache's last update will make are counted).

        :param request: the arrival (with prefix information, else nothing is cached).
        :param prompt_tokens: its prompt as the engine would take it.
        """
        cache = self._cache
        ids = request.prefix_ids
        if cache is None or not ids or prompt_tokens < 2:
            return 0
        block = self._block_size
        layout = prefix_layout(ids, request.prompt_tokens, prompt_tokens, block)
        max_blocks = (prompt_tokens - 1) // block
        hit = cache.peek(layout, max_blocks, self._free_blocks)
        host = self._host
        if host is not None and hit < max_blocks:
            hit += host.lookup(layout, hit, max_blocks)
        return hit * block

    # ----------------------------------------------------------------- host tier
    def _start_load(self, seq: SimSeq, layout: Layout, hit: int, loaded: int,
                    free: int) -> tuple[int, int]:
        """Admit a waiting request to the loading list: its GPU hit held, ``loaded`` more
        blocks allocated and copied from the host tier. vLLM admits such a load only if it
        fits beside the blocks the loads in flight still need (``reserved_blocks``): here the
        first chunk after each load's prefix, at the full token budget, so a loaded request
        can always start once nothing else runs.

        :returns: -1 and the free blocks after, or 0 and ``free`` (it does not fit).
        """
        cache = self._cache
        host = self._host
        assert cache is not None and host is not None
        block = self._block_size
        computed = (hit + loaded) * block
        taken = cache.evictable(layout, hit) if hit else 0
        need = taken + loaded
        if need + self._chunk_blocks(seq, computed) + self._load_reserved() > free:
            return 0, free
        seq.extents = [0] * len(layout[0])
        if hit:
            cache.touch(layout, hit, seq.extents)
        seq.num_computed = computed
        seq.cached = hit
        seq.uncached -= hit
        seq.blocks = hit + loaded
        if not seq.preemptions:
            cache.hits += hit * block
            host.hits += loaded * block
        if seq.host_low < 0 or hit < seq.host_low:
            seq.host_low = hit
        if seq.host_done < hit + loaded:
            seq.host_done = hit + loaded
        seq.ready_s = host.load(loaded, self._now)
        return -1, free - need

    def _chunk_blocks(self, seq: SimSeq, computed: int) -> int:
        """Blocks the first chunk after a request's first ``computed`` tokens (whole blocks)
        takes at the full token budget."""
        rest = seq.prompt_len + seq.num_output - computed
        return -(-(rest if rest < self._budget else self._budget) // self._block_size)

    def _load_reserved(self) -> int:
        """Free blocks the loads in flight still need for their first chunks."""
        return sum(self._chunk_blocks(s, s.num_computed) for s in self._loading)

    def _promote_loaded(self, sched: list[tuple[SimSeq, int]], admitted: list[SimSeq] | None,
                        budget: int, free: int, prefill_tokens: int,
                        attn_work: float) -> tuple[int, int, int, float, bool]:
        """The loading requests whose copy completed by the iteration's start join the
        running list first, in the order their loads were issued (vLLM drains its KV-holding
        queue before the waiting one); their loaded blocks get their hashes. Returns the
        budget, free blocks, prefill tokens and attention work after them, and whether one
        did not get its first chunk's blocks (admission stops there, as vLLM's does)."""
        loading = self._loading
        running = self._running
        block = self._block_size
        now = self._now
        i = 0
        while i < len(loading) and budget > 0 and len(running) < self._max_num_seqs:
            seq = loading[i]
            if seq.ready_s > now:
                i += 1
                continue
            remaining = seq.prompt_len + seq.num_output - seq.num_computed
            n = remaining if remaining < budget else budget
            need = -(-(seq.num_computed + n) // block) - seq.blocks
            if need > free:
                return budget, free, prefill_tokens, attn_work, True
            free -= need
            seq.blocks += need
            del loading[i]
            self._start(seq, n, sched, admitted, free)
            prefill_tokens += n
            attn_work += n * (seq.num_computed + (n + 1) / 2)
            budget -= n
        return budget, free, prefill_tokens, attn_work, False

    def _start(self, seq: SimSeq, n: int, sched: list[tuple[SimSeq, int]],
               admitted: list[SimSeq] | None, free: int) -> None:
        """``seq`` joins the running list with ``n`` tokens scheduled this iteration (once
        per admission, from the waiting queue or the loading list); the blocks those tokens
        fill get their hashes."""
        seq.order = self._order
        self._order += 1
        self._running.append(seq)
        self._in_running[seq.bucket] += 1
        sched.append((seq, n))
        if admitted is not None:
            admitted.append(seq)
        if seq.uncached:
            self._register(seq, seq.num_computed + n, free)

    def _next_copy_s(self) -> float:
        """When the first copy from the host in flight completes (loads of aborted requests
        included: their blocks return then)."""
        ready = min(s.ready_s for s in self._loading) if self._loading else math.inf
        if self._aborted_loads:
            aborted = min(s.ready_s for s in self._aborted_loads)
            if aborted < ready:
                ready = aborted
        return ready

    def _drop_loading(self, seq: SimSeq) -> None:
        """An aborted request leaves the loading list: its blocks return now if its copy
        completed, else when it completes (:meth:`_free_aborted_loads`)."""
        self._loading.remove(seq)
        if seq.ready_s > self._now:
            self._aborted_loads.append(seq)
        else:
            self._free_blocks = self._release(seq, self._free_blocks)
            seq.blocks = 0

    def _free_aborted_loads(self) -> None:
        """The blocks of the aborted requests whose copy completed by now return (at an
        iteration's start, or as an idle engine's clock moves)."""
        now = self._now
        free = self._free_blocks
        kept: list[SimSeq] = []
        for seq in self._aborted_loads:
            if seq.ready_s <= now:
                free = self._release(seq, free)
                seq.blocks = 0
            else:
                kept.append(seq)
        self._aborted_loads = kept
        self._free_blocks = free

    def _wait_for_loads(self, bound_s: float) -> None:
        """Nothing can run: the clock goes to the first copy's completion (or ``bound_s``,
        where the caller has something to do)."""
        ready = self._next_copy_s()
        to_s = ready if ready < bound_s else bound_s
        if to_s > self._now:
            self._now = to_s
        # Stepping ends a wait at every arrival: those the caller let this one run past (one
        # skipping engine) were due at a boundary before its end (at ``bound_s``: after).
        end = to_s if to_s < bound_s else math.nextafter(bound_s, -math.inf)
        if end > self._last_start:
            self._last_start = end

    def _offer(self, seq: SimSeq, layout: Layout, low: int, high: int) -> None:
        """A request's blocks ``[low, high)`` are offered to the host tier."""
        assert self._host is not None
        self._host.store(layout, low, high)
        if seq.host_low < 0 or low < seq.host_low:
            seq.host_low = low
        seq.host_done = high

    def _layout(self, seq: SimSeq) -> Layout:
        """A request's block groups, derived at its first lookup (the waiting queue can hold
        thousands of long prompts); ``uncached`` set to its hashed blocks."""
        layout = seq.layout
        if layout is None:
            assert seq.prefix is not None
            ids, start = seq.prefix
            layout = seq.layout = prefix_layout(ids, start + seq.prompt_len, seq.prompt_len,
                                                self._block_size)
            seq.uncached = layout[2][-1] if layout[2] else 0
        return layout

    def _register(self, seq: SimSeq, tokens: int, free: int) -> None:
        """The blocks a request's first ``tokens`` fill get their hashes (when scheduled, as
        vLLM's ``cache_blocks``); the engine has ``free`` free blocks now."""
        cache = self._cache
        layout = seq.layout
        assert cache is not None and layout is not None
        total = layout[2][-1]
        done = total - seq.uncached
        end = tokens // self._block_size
        if end > done:
            if end > total:
                end = total
            seq.cached += cache.register(layout, seq.extents, done, end, free)
            seq.uncached = total - end
            if self._host is not None and seq.host_done < end:
                self._offer(seq, layout, seq.host_done, end)

    def _release(self, seq: SimSeq, free: int) -> int:
        """Free blocks after a running request returned its blocks (its ``blocks`` field is
        left for the caller); its registration starts over when it is admitted again."""
        cache = self._cache
        layout = seq.layout
        if layout is None:
            if cache is None or not cache.free_cached:
                return free + seq.blocks
            return cache.release(None, seq.extents, 0, seq.blocks, free)
        assert cache is not None
        total = layout[2][-1] if layout[2] else 0
        done = total - seq.uncached
        seq.uncached = total
        if not seq.cached and not cache.free_cached:
            return free + seq.blocks
        seq.cached = 0
        return cache.release(layout, seq.extents, done, seq.blocks, free)
