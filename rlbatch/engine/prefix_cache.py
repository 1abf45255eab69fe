"""Prefix caching with vLLM V1's semantics: chained block hashes, shared blocks, LRU eviction.

vLLM V1 (``v1/core/kv_cache_manager.py``, ``v1/core/block_pool.py``) names every *full*
``block_size``-token block by a hash chained to its prefix, so two requests share a block iff
they share every token up to its end:

* **lookup** at scheduling (``get_computed_blocks``): a waiting request takes the longest run
  of its leading blocks that the pool holds, at most ``num_tokens - 1`` tokens (the last
  token is always computed, for its logits); those tokens skip prefill;
* **registration** (``cache_blocks``): a block gets its hash when the scheduler allocates the
  tokens that fill it, so a request admitted later in the same iteration can hit it already;
* **reference counts**: a cached block held by several running requests is one block of the
  pool; a block nobody holds goes to the tail of the free queue *with its hash* (a request
  frees its blocks tail first), stays hittable, and loses its hash only when an allocation
  pops it from the queue's head (LRU eviction). KV usage counts held blocks only.

The simulator has no token ids. Mooncake traces name each 512-token prompt block by an id
(``Request.prefix_ids``; equal ids at the same position = shared prefix). A key chained over
those ids (:func:`prefix_layout`) names the *group* of 16-token blocks whose last token lies
in one 512-token block: block ``j`` of group ``key`` is one hash, shared by every request with
that key. A request without ids (the Azure trace, the generators) has no layout: its blocks
can never be hit, which is what unique hashes would give, at no cost.

Per group the cache keeps how many of its blocks are present (always its first ones: a
request registers them in order and frees them tail first, so the LRU queue evicts a group's
blocks from its last down) and the holders' extents (a running request holds the first
blocks of each group it covers). The blocks nobody holds are the group's last ones, queued as
intervals, so lookups, registrations, releases and evictions cost one step per group, not per
block (Mooncake prompts hold thousands of blocks).

Left out of vLLM's behaviour: only prompt blocks are cached (vLLM also caches the blocks of
generated tokens, which only the same request can hit again after a preemption); and a block
already cached when a request fills it (two requests computed it at once) stays without a
hash, as do that request's later blocks of the same group (vLLM keeps them as second cached
copies, which serve hits only after the first copies are evicted).

The engine allocates blocks by count (its decode lane and decode runs never name a block), so
the queue applies allocations lazily: with ``free`` blocks free, its head has lost ``queued -
free`` blocks since it was last brought up to date (a FIFO's k-th pop takes its k-th entry
whatever the interleaving with appends), and :meth:`PrefixCache.sync` pops them before
anything reads the cache.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Sequence

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens named by one Mooncake ``hash_ids`` entry."""

_ROOT = 0x5EED_CAC4E
"""Seed of every key chain (an int: str hashes change with PYTHONHASHSEED)."""

Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A prompt's hashed blocks: the keys of its groups, its blocks in each, and where each group
ends among its blocks (``ends[-1]``: its hashed blocks), in order."""


def prefix_layout(prefix_ids: Sequence[int], prompt_tokens: int, kept_tokens: int,
                  block_size: int) -> Layout:
    """The groups of a prompt's full KV blocks.

    Block ``q`` of the kept prompt covers tokens ``[start + q * block_size, start + (q + 1) *
    block_size)`` of the original prompt (``start = prompt_tokens - kept_tokens``: a truncated
    prompt keeps its last tokens). The key of 512-token block ``i`` chains ``start`` and the
    ids from the one holding the first kept token up to ``i``; block ``q`` is block ``q -
    q0`` of the group of the 512-token block its last token lies in (``q0`` that group's
    first). Two requests therefore share block ``q`` iff they kept the same ``start`` and their
    ids agree up to the block's end. Blocks past the tokens the ids describe are in no group
    (never shared).

    :param prefix_ids: ids of the original prompt's 512-token blocks.
    :param prompt_tokens: the original prompt's length.
    :param kept_tokens: tokens served (``<= prompt_tokens``).
    :param block_size: tokens per KV block.
    :returns: ``(keys, sizes, ends)``; empty when no full block is described.
    """
    start = prompt_tokens - kept_tokens
    covered = min(prompt_tokens, len(prefix_ids) * MOONCAKE_BLOCK_TOKENS)
    count = (covered - start) // block_size
    if count <= 0:
        return (), (), ()
    keys: list[int] = []
    key = hash((_ROOT, start))
    i = start // MOONCAKE_BLOCK_TOKENS
    if not start % MOONCAKE_BLOCK_TOKENS and not MOONCAKE_BLOCK_TOKENS % block_size:
        # aligned: every group but the last is a whole 512-token block
        per = MOONCAKE_BLOCK_TOKENS // block_size
        for block_id in prefix_ids[i:i - (-count // per)]:
            key = hash((key, block_id))
            keys.append(key)
        full = len(keys) - 1
        return (tuple(keys), (*(per,) * full, count - per * full),
                (*range(per, per * full + 1, per), count))
    sizes: list[int] = []
    ends: list[int] = []
    q = 0
    while q < count:
        key = hash((key, prefix_ids[i]))
        i += 1
        # blocks whose last token lies in 512-token block i - 1
        end = (MOONCAKE_BLOCK_TOKENS * i - start - block_size) // block_size + 1
        if end > count:
            end = count
        if end > q:
            keys.append(key)
            sizes.append(end - q)
            ends.append(end)
            q = end
    return tuple(keys), tuple(sizes), tuple(ends)


class _Group:
    """The cached blocks of one group: its first ``present`` blocks, held by the running
    requests as their first ``holders`` blocks each; the blocks after the largest holder are
    free, queued as ``intervals`` ``[queue entry, first, end]``, the oldest (highest) first."""

    __slots__ = ("holders", "intervals", "present")

    def __init__(self, present: int, holders: list[int], intervals: list[list[int]]) -> None:
        self.present = present
        self.holders = holders
        self.intervals = intervals

    def copy(self) -> _Group:
        return _Group(self.present, self.holders[:], [i[:] for i in self.intervals])


class PrefixCache:
    """The cached blocks of one engine's KV pool and their LRU free queue (see the module
    docstring). The engine keeps the count of free blocks; every method that reads the queue
    is handed it. A request's part is its layout, its extent in each group (blocks held) and
    how many of its blocks were registered (``done``).
    """

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}
        self._queue: OrderedDict[int, int] = OrderedDict()
        """The free queue, least recently freed first: entry >= 0 a free interval of the group
        whose key is the value (stale once the interval is gone), entry < 0 a run of
        ``value`` blocks without a hash. Empty while no cached block is free (then every free
        block is without a hash and their order does not matter)."""
        self._queued = 0
        """Blocks in the queue before the pending allocations (see :meth:`sync`)."""
        self.free_cached = 0
        """Cached blocks in the queue (no running request holds them: reclaimable)."""
        self._next_entry = 0
        self._next_run = -1
        self._tail_run = 0
        """Entry of the run at the queue's tail, 0 when the tail is not a run."""
        self.queries = 0
        """Prompt tokens of first admissions looked up (vLLM ``prefix_cache_queries``)."""
        self.hits = 0
        """Tokens of those found cached (vLLM ``prefix_cache_hits``)."""
        self.evictions = 0
        """Cached blocks that lost their hash to an allocation."""

    # ----------------------------------------------------------------- the free queue
    def sync(self, free: int) -> None:
        """Apply the allocations made since the queue was last brought up to date: the
        engine has ``free`` free blocks, so the queue's head lost ``queued - free`` of them
        (cached ones lose their hash: evictions).

        :param free: the engine's free blocks now.
        """
        if not self.free_cached:
            return
        pending = self._queued - free
        assert pending >= 0, (self._queued, free)
        queue = self._queue
        groups = self._groups
        while pending and self.free_cached:
            entry, value = queue.popitem(last=False)
            if entry < 0:  # a run without a hash
                if value <= pending:
                    pending -= value
                    if entry == self._tail_run:
                        self._tail_run = 0
                else:
                    queue[entry] = value - pending
                    queue.move_to_end(entry, last=False)
                    pending = 0
                continue
            group = groups.get(value)
            if group is None or not group.intervals or group.intervals[0][0] != entry:
                continue  # stale: its blocks were taken back
            intervals = group.intervals
            interval = intervals[0]
            evicted = interval[2] - interval[1]
            if evicted > pending:
                evicted = pending
            interval[2] -= evicted  # the group's last blocks (the interval is its top)
            group.present -= evicted
            pending -= evicted
            self.free_cached -= evicted
            self.evictions += evicted
            if interval[1] == interval[2]:
                del intervals[0]
                if not group.present:
                    del groups[value]
            else:
                queue[entry] = value
                queue.move_to_end(entry, last=False)
        self._queued = free
        if not self.free_cached:
            self._forget_queue()

    def _forget_queue(self) -> None:
        """No cached block is free: the queue holds only blocks without a hash."""
        self._queue.clear()
        self._queued = 0
        self._tail_run = 0

    def _append_run(self, blocks: int) -> None:
        self._queued += blocks
        tail = self._tail_run
        if tail:
            self._queue[tail] += blocks
            return
        entry = self._next_run
        self._next_run -= 1
        self._queue[entry] = blocks
        self._tail_run = entry

    def _take_free(self, group: _Group, low: int, high: int) -> None:
        """A group's free blocks ``[low, high)`` (its lowest free ones) become held."""
        intervals = group.intervals
        while intervals:
            interval = intervals[-1]
            if interval[2] <= high:
                intervals.pop()  # its queue entry goes stale
            else:
                interval[1] = high
                break
        self.free_cached -= high - low
        self._queued -= high - low
        if not self.free_cached:
            self._forget_queue()

    # ----------------------------------------------------------------- requests
    def lookup(self, layout: Layout, max_blocks: int, free: int) -> int:
        """How many of a request's first blocks, at most ``max_blocks``, the pool holds.

        :param layout: its groups.
        :param max_blocks: ``(num_tokens - 1) // block_size`` or fewer.
        :param free: the engine's free blocks now.
        """
        self.sync(free)
        return self._hit(layout, max_blocks, {})

    def peek(self, layout: Layout, max_blocks: int, free: int) -> int:
        """What :meth:`lookup` would return, changing nothing: the evictions :meth:`sync`
        would make first are counted, not made (for estimates between iterations).

        :param layout: its groups.
        :param max_blocks: ``(num_tokens - 1) // block_size`` or fewer.
        :param free: the engine's free blocks now.
        """
        return self._hit(layout, max_blocks, self._pending_evictions(free))

    def _hit(self, layout: Layout, max_blocks: int, evicted: dict[int, int]) -> int:
        """The first blocks of ``layout`` present, at most ``max_blocks``, with ``evicted``
        blocks (group key -> count) taken off the groups' tops."""
        groups = self._groups
        hit = 0
        for key, size in zip(layout[0], layout[1], strict=True):
            group = groups.get(key)
            if group is None:
                break
            present = group.present - evicted.get(key, 0) if evicted else group.present
            if present < size:
                hit += present
                break
            hit += size
            if hit >= max_blocks:
                break
        return hit if hit < max_blocks else max_blocks

    def _pending_evictions(self, free: int) -> dict[int, int]:
        """The cached blocks per group (key -> count) :meth:`sync` would evict with ``free``
        free blocks, walking the queue as it does without changing it."""
        pending = self._queued - free
        if pending <= 0 or not self.free_cached:
            return {}
        groups = self._groups
        evicted: dict[int, int] = {}
        gone: dict[int, int] = {}  # a group's leading intervals wholly evicted in this walk
        for entry, value in self._queue.items():
            if entry < 0:  # a run without a hash
                pending -= value
            else:
                group = groups.get(value)
                k = gone.get(value, 0)
                if group is None or len(group.intervals) <= k or group.intervals[k][0] != entry:
                    continue  # stale: its blocks were taken back
                _, low, high = group.intervals[k]
                n = high - low if high - low < pending else pending
                evicted[value] = evicted.get(value, 0) + n
                pending -= n
                if n == high - low:
                    gone[value] = k + 1
            if pending <= 0:
                break
        return evicted

    def evictable(self, layout: Layout, hit: int) -> int:
        """Blocks among the first ``hit`` no running request holds (taking them uses free
        blocks, as vLLM's ``get_num_blocks_to_allocate`` counts)."""
        groups = self._groups
        count = 0
        for key, size in zip(layout[0], layout[1], strict=True):
            if hit <= 0:
                break
            take = size if size < hit else hit
            hit -= take
            holders = groups[key].holders
            top = max(holders) if holders else 0
            if take > top:
                count += take - top
        return count

    def touch(self, layout: Layout, hit: int, extents: list[int]) -> None:
        """A request admitted with its first ``hit`` blocks cached holds them (free ones
        leave the queue).

        :param layout: its groups.
        :param hit: from :meth:`lookup`, before any other change to the cache.
        :param extents: its blocks held per group (zeros; filled here).
        """
        groups = self._groups
        for index, (key, size) in enumerate(zip(layout[0], layout[1], strict=True)):
            if hit <= 0:
                break
            take = size if size < hit else hit
            hit -= take
            group = groups[key]
            holders = group.holders
            top = max(holders) if holders else 0
            holders.append(take)
            extents[index] = take
            if take > top:
                self._take_free(group, top, take)

    def register(self, layout: Layout, extents: list[int], done: int, end: int,
                 free: int) -> int:
        """A request's blocks ``[done, end)`` are filled by the tokens just scheduled: in each
        group where it holds every block it filled so far and the blocks present end, they
        become present and held; elsewhere they stay without a hash (computed twice).

        :param layout: its groups.
        :param extents: its blocks held per group (updated).
        :param done: its blocks registered so far.
        :param end: its blocks filled now (at most its hashed ones).
        :param free: the engine's free blocks now (the allocations so far evict first: a
            group's present blocks are read after them, as vLLM's eager free queue has them).
        :returns: how many more cached blocks it holds.
        """
        self.sync(free)
        keys, sizes, ends = layout
        groups = self._groups
        index = bisect_right(ends, done)
        first = ends[index] - sizes[index]  # its first block in group `index`
        gained = 0
        while done < end:
            size = sizes[index]
            filled = end - first if end - first < size else size
            held = extents[index]
            if held == done - first:  # nothing computed twice in this group yet
                key = keys[index]
                group = groups.get(key)
                if group is None:
                    group = groups[key] = _Group(0, [], [])
                if group.present == held:  # its blocks are the group's last: extend
                    holders = group.holders
                    if held:
                        holders.remove(held)
                    holders.append(filled)
                    group.present = filled
                    extents[index] = filled
                    gained += filled - held
            done = first + filled
            if filled == size:
                first += size
                index += 1
        return gained

    def release(self, layout: Layout | None, extents: list[int], done: int, blocks: int,
                free: int) -> int:
        """A request leaves the running list (finished or preempted): its blocks go back,
        tail first (vLLM frees a block table in reverse): those without a hash, and in each
        group, from the last, the blocks no other request holds, to the free queue.

        :param layout: its groups (``None``: no prefix information).
        :param extents: its blocks held per group.
        :param done: its blocks registered (or hit).
        :param blocks: its blocks.
        :param free: the engine's free blocks before.
        :returns: the free blocks after.
        """
        anon = blocks - done  # blocks without a hash, not queued yet (tail first)
        kept = 0  # its blocks other requests still hold
        if layout is not None and done:
            keys, sizes, ends = layout
            groups = self._groups
            queue = self._queue
            index = bisect_left(ends, done)  # the last group it registered blocks of
            filled = done - (ends[index] - sizes[index])
            entry = self._next_entry
            queued = 0
            while index >= 0:
                held = extents[index]
                anon += filled - held  # computed twice: no hash
                if held:
                    group = groups[keys[index]]
                    holders = group.holders
                    if len(holders) == 1:
                        holders.clear()
                        top = 0
                    else:
                        holders.remove(held)
                        top = max(holders)
                    if held <= top:
                        kept += held
                    else:  # its blocks past the other holders' become free
                        kept += top
                        if not self.free_cached and not queued and free:
                            self._append_run(free)  # ahead of them, all without a hash
                        if anon:
                            self._append_run(anon)
                            anon = 0
                        queue[entry] = keys[index]
                        group.intervals.append([entry, top, held])
                        entry += 1
                        queued += held - top
                        self._tail_run = 0
                index -= 1
                filled = sizes[index]
            self._next_entry = entry
            self._queued += queued
            self.free_cached += queued
        if anon and self.free_cached:
            self._append_run(anon)
        return free + blocks - kept

    def check(self, free: int, extents: dict[int, list[int]]) -> None:
        """Internal consistency (tests): holders, present blocks, intervals, the queue.

        :param free: the engine's free blocks now.
        :param extents: group key -> the running requests' extents in it.
        """
        total = 0
        for key, group in self._groups.items():
            present, holders = group.present, group.holders
            assert sorted(holders) == sorted(extents.get(key, [])), key
            assert present > 0 and all(0 < h <= present for h in holders), key
            low = max(holders) if holders else 0
            for entry, first, end in reversed(group.intervals):  # bottom up
                assert first == low < end and self._queue.get(entry) == key, key
                low = end
                total += end - first
            assert low == present, key  # held first, then free: every present block
        assert set(extents) <= set(self._groups)
        assert total == self.free_cached
        if self.free_cached:
            runs = sum(v for k, v in self._queue.items() if k < 0)
            assert runs + total == self._queued >= free, (runs, total, self._queued, free)

    def fork(self) -> PrefixCache:
        """An independent copy (a digital twin's engine)."""
        new = PrefixCache()
        new._groups = {key: group.copy() for key, group in self._groups.items()}
        new._queue = self._queue.copy()
        new._queued = self._queued
        new.free_cached = self.free_cached
        new._next_entry = self._next_entry
        new._next_run = self._next_run
        new._tail_run = self._tail_run
        new.queries = self.queries
        new.hits = self.hits
        new.evictions = self.evictions
        return new
