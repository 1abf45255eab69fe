"""Host-memory KV tier with the semantics of vLLM's native CPU offloading.

vLLM 0.32 (``--kv-offloading-size GiB``, backend ``native``: the ``OffloadingConnector``
over ``v1/kv_offload/cpu``) keeps a second, larger pool of KV blocks in pinned host memory:

* **stores are write-through, not evictions**: every full block a request computes is
  offered to the host pool in the step that computes it (``_build_store_jobs``); a block
  the host already holds is not copied again. A request whose prefix hit only the GPU cache
  offers its hit blocks too (absent ones are copied from the GPU); one that loaded from the
  host offers only the blocks after its hit (``OffloadPolicy.CHUNK_LEVEL``);
* **LRU** (``cpu/policies/lru.py``): a stored block is the most recent; when a request
  finishes, every block it stored, found or loaded is ranked again, tail first, so its
  first blocks are the most recent; new stores evict the least recent blocks;
* **loads are asynchronous**: a request whose prefix continues in the host pool past its
  GPU hit allocates GPU blocks for it, leaves the scheduling queue
  (``WAITING_FOR_REMOTE_KVS``, holding its blocks, no running slot, no token budget) while
  the blocks cross the host link on a copy stream of their own, in submission order,
  overlapping the forward passes; it is scheduled again, first among the waiting, at the
  first step after the copy completed, with the loaded tokens computed;
* capacity: ``floor(GiB * 2**30 / block bytes)``, a block's bytes being every
  tensor-parallel rank's share rounded up to the 4 KiB page (one copy for MLA, which every
  rank replicates).

Per 512-token group (:mod:`rlbatch.engine.prefix_cache`) the tier keeps how many of its first
blocks it holds and one recency for the group, so a lookup, a store or an eviction costs one
step per group, as in the GPU cache. What that changes, all under host-memory pressure only:
a group's recency is its most recent block's (vLLM ranks the blocks one by one, so the
first blocks of a group stored over two steps are a step older than its last ones); an
eviction takes a group's blocks from its end (vLLM's LRU could take a middle block of a
request still running, leaving the blocks after it stored but unreachable by a prefix
lookup until the hole is stored again: here they are not stored); blocks being loaded can
be evicted meanwhile (vLLM pins them until the copy completes: here the copy still
completes).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass

from rlbatch.engine.prefix_cache import Layout
from rlbatch.profiles import RooflineStepTimeModel

HOST_PAGE_BYTES = 4096
"""vLLM rounds a host block up to the memory page (``SharedOffloadRegion``: ``mmap.PAGESIZE``)."""

GIB = 1 << 30


@dataclass(frozen=True)
class HostLink:
    """What one KV block costs the host tier of one engine.

    :param block_bytes: host memory one block takes: every tensor-parallel rank's share
        (MLA: one copy), rounded up to :data:`HOST_PAGE_BYTES`.
    :param load_s_per_block: seconds one block takes over the host link (host to GPU; the
        ranks copy their shares in parallel, each over its own link).
    """

    block_bytes: int
    load_s_per_block: float

    def __post_init__(self) -> None:
        if self.block_bytes < 1 or not self.load_s_per_block > 0:
            raise ValueError(f"block_bytes ({self.block_bytes}) and load_s_per_block "
                             f"({self.load_s_per_block}) must be positive")


def host_link_of(step_model: RooflineStepTimeModel, block_size: int) -> HostLink:
    """The host link of a roofline engine: its GPU profile's ``host_link_bandwidth_bytes_s``
    and its KV bytes per token.

    :param step_model: the engine's step-time model (GPU, model, precision, TP).
    :param block_size: tokens per KV block.
    :raises ValueError: the GPU profile has no host link bandwidth.
    """
    bandwidth = step_model.gpu.host_link_bandwidth_bytes_s
    if bandwidth is None:
        raise ValueError(f"GPU profile {step_model.gpu.name!r} has no "
                         f"host_link_bandwidth_bytes_s: add it (bytes/s, host to GPU) to use "
                         f"the host KV tier (--kv-offload-gib)")
    per_gpu = block_size * step_model.kv_bytes_per_token_per_gpu
    copies = 1 if step_model.model.mla is not None else step_model.tp
    block_bytes = -(-per_gpu * copies // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    return HostLink(block_bytes, per_gpu / bandwidth)


def host_capacity_blocks(gib: float, link: HostLink) -> int:
    """Blocks ``gib`` GiB of host memory hold (vLLM's ``cpu_bytes_to_use // block bytes``).

    :param gib: host memory, GiB.
    :param link: the engine's host link.
    :raises ValueError: not even one block fits.
    """
    blocks = int(gib * GIB) // link.block_bytes
    if blocks < 1:
        raise ValueError(f"kv_offload_gib={gib} holds no KV block of {link.block_bytes} bytes")
    return blocks


class HostTier:
    """The host pool of one engine: per group key, how many of its first blocks it holds,
    least recently used first (see the module docstring), and the host-to-GPU copy queue.

    :param num_blocks: blocks the pool holds.
    :param link: bytes per block and copy time per block.
    """

    def __init__(self, num_blocks: int, link: HostLink) -> None:
        self.num_blocks = num_blocks
        self.link = link
        self._groups: OrderedDict[int, int] = OrderedDict()
        """Group key -> its first blocks held, least recently used first."""
        self.used = 0
        """Blocks held."""
        self._link_free_s = 0.0
        """When the last copy queued on the link completes."""
        self.hits = 0
        """Tokens of first admissions found here past their GPU hit (and loaded)."""
        self.loads = 0
        """Copies to the GPU issued (one per request admitted with a host hit)."""
        self.loaded = 0
        """Blocks copied to the GPU."""
        self.load_s = 0.0
        """Summed seconds from a load's issue to its completion (link queue included)."""
        self.stored = 0
        """Blocks copied to the host."""
        self.evictions = 0
        """Blocks dropped to make room."""

    def lookup(self, layout: Layout, first: int, max_blocks: int) -> int:
        """How many blocks after a request's first ``first`` (its GPU hit) the pool holds in
        a row, up to its block ``max_blocks``.

        :param layout: the request's groups.
        :param first: blocks already found in the GPU cache.
        :param max_blocks: ``(num_tokens - 1) // block_size`` or fewer.
        """
        keys, sizes, ends = layout
        groups = self._groups
        hit = first
        index = bisect_right(ends, hit)
        while hit < max_blocks and index < len(keys):
            start = ends[index] - sizes[index]
            end = start + groups.get(keys[index], 0)
            if end <= hit:
                break
            hit = end
            if end < ends[index]:
                break
            index += 1
        return (hit if hit < max_blocks else max_blocks) - first

    def store(self, layout: Layout, low: int, high: int) -> None:
        """A request offers its blocks ``[low, high)``: those the pool lacks are copied in
        and become the most recent, least recent blocks of other groups make room.

        :param layout: the request's groups.
        :param low: first block offered.
        :param high: end of the blocks offered (at most its hashed blocks).
        """
        keys, sizes, ends = layout
        groups = self._groups
        index = bisect_right(ends, low)
        wanted = 0
        grown: list[tuple[int, int, int]] = []  # (key, blocks held, blocks it will hold)
        stop = None  # the first of them the pool holds: eviction stops there
        while low < high:
            end = ends[index]
            start = end - sizes[index]
            top = (high if high < end else end) - start
            key = keys[index]
            held = groups.get(key, 0)
            if low - start <= held < top:  # no hole before the blocks offered
                grown.append((key, held, top))
                wanted += top - held
                if held:
                    groups.move_to_end(key)  # most recent: protected from the eviction below
                    if stop is None:
                        stop = key
            low = start + top
            index += 1
        if not wanted:
            return
        room = self.num_blocks - self.used
        if wanted > room:
            room += self._evict(wanted - room, stop)
        for key, held, top in grown:
            take = top - held if top - held < room else room
            if take <= 0:
                break  # the pool is full of the blocks offered (a pool smaller than a prompt)
            groups[key] = held + take  # a new group goes to the end, in block order
            room -= take
            self.used += take
            self.stored += take

    def _evict(self, count: int, stop: int | None) -> int:
        """Drop up to ``count`` blocks, least recently used first, each group from its end,
        up to the group ``stop`` (the groups being stored come from there on: vLLM protects
        the blocks offered). Returns the blocks dropped."""
        groups = self._groups
        dropped = 0
        while dropped < count and groups:
            key, held = groups.popitem(last=False)
            if key == stop:
                groups[key] = held
                groups.move_to_end(key, last=False)
                break  # only the groups being stored are left
            take = count - dropped
            if take < held:
                groups[key] = held - take
                groups.move_to_end(key, last=False)
            else:
                take = held
            dropped += take
        self.used -= dropped
        self.evictions += dropped
        return dropped

    def finish(self, layout: Layout, low: int, high: int) -> None:
        """A request finished: the groups of the blocks ``[low, high)`` it stored, found or
        loaded become the most recent, its first group last (vLLM ranks them tail first).

        :param layout: the request's groups.
        :param low: its first block the pool saw.
        :param high: end of the blocks the pool saw.
        """
        keys, _, ends = layout
        groups = self._groups
        for index in range(bisect_left(ends, high), bisect_right(ends, low) - 1, -1):
            key = keys[index]
            if key in groups:
                groups.move_to_end(key)

    def load(self, blocks: int, now_s: float) -> float:
        """Queue a copy of ``blocks`` blocks to the GPU, issued at ``now_s`` (copies run in
        submission order); when it completes.

        :param blocks: blocks copied.
        :param now_s: the issuing iteration's start.
        """
        start = now_s if now_s > self._link_free_s else self._link_free_s
        done = start + blocks * self.link.load_s_per_block
        self._link_free_s = done
        self.loads += 1
        self.loaded += blocks
        self.load_s += done - now_s
        return done

    def counters(self) -> tuple[int, int, int, float, int, int]:
        """``(hits, loads, loaded, load_s, stored, evictions)`` since the tier started."""
        return self.hits, self.loads, self.loaded, self.load_s, self.stored, self.evictions

    def check(self) -> None:
        """Internal consistency (tests)."""
        assert all(held > 0 for held in self._groups.values())
        assert sum(self._groups.values()) == self.used <= self.num_blocks

    def fork(self) -> HostTier:
        """An independent copy (a digital twin's engine)."""
        new = HostTier(self.num_blocks, self.link)
        new._groups = self._groups.copy()
        new.used = self.used
        new._link_free_s = self._link_free_s
        new.hits, new.loads, new.loaded, new.load_s = (self.hits, self.loads, self.loaded,
                                                       self.load_s)
        new.stored, new.evictions = self.stored, self.evictions
        return new
