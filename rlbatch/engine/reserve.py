"""How much KV the admission budget counts for each request inside an engine.

A client rarely says how long its answer will be: OpenAI's ``max_tokens`` is optional, and
when it is sent it is a ceiling (often 1-4k) far above the typical answer. Counting every
request at its declared limit (``declared``) therefore admits a fraction of what the pool
holds; counting the real output (``oracle``) is only possible in a simulator replaying a
trace. ``observed`` (the default) counts what the engine's own recent completions say:

* at admission a request reserves its prompt plus a high quantile of the outputs recently
  finished in its length bucket (``quantile``, over the last ``window`` completions), never
  more than its declared limit; until a bucket has ``min_samples`` completions the quantile
  of all buckets' completions stands in, and until those are ``min_samples`` a prior
  of ``prior_output_tokens`` (4,096) stands in. The prior matters on long-context models: a
  request sent without ``max_tokens`` may run to the end of a 128k context, and counting it
  there until 16 completions are seen held 97% of a cold start's admissions back on
  Llama-3.1-8B (committed 0.92 of the pool while 0.11 was in use). On a 4k-context model the
  prior is the limit, so nothing changes there;
* a running request that has generated ``g`` tokens counts at least ``prompt + 2 g`` (a
  request that already ran long is likely to run as long again: output lengths are heavy
  tailed), capped at its limit. This is a pure function of the request's state, so event
  skipping and stepping give the same figure;
* when the traffic turns to longer answers, a window of past completions lags it, and more
  so than its size says: the first new requests to finish are the new traffic's shortest.
  A history whose recent completions ran past its own quantile far more often than the
  quantile allows (``shift_trigger`` of the last ``shift_window``; at the defaults, 6 of 16
  where a steady 0.9-quantile expects 1.6, a false alarm on 0.3% of windows) forgets all
  but those completions, so the next admissions count what the new traffic needs. Without
  it, a queue held back through a turn from code completion (tens of output tokens) to
  chat (hundreds) entered at a total of 256 counted at 75% of what it would generate; the
  pool overflowed five seconds later (six preemptions behind the guard; BENCHMARKS.md). A
  turn to shorter answers needs no such rule: the budget is then conservative, not unsafe,
  until the window turns over.

The budget is then an estimate, not a guarantee: a burst of unusually long answers can still
outgrow the pool (vLLM preempts), which the ``kv_high`` rule watches. Preemptions are counted
in every row.

What the budget compares with its limit (``kv_commit``):

* ``final``: every request at its count for as long as it runs (the sum of the counts). A
  request about to finish holds its whole count, and a new one is admitted only when the sum
  fits, although the two will never hold their full KV at once. In a surge of long prompts
  this held an FP16 engine to 74-84 requests where vLLM alone runs 121-141 (and preempts);
* ``peak``: the peak of the projected KV (:func:`peak_commitment`), when it is below the
  sum. A decoding request grows one token per iteration from its current KV to its count
  and then frees it all; a request not decoding yet (waiting, loading from the host tier,
  in prefill, the one being admitted) holds its whole count from now on. The budget then
  holds what the pool would hold at the worst moment ahead if nothing else entered and the
  counts held.

The projection assumes every decoding request is scheduled every iteration. Between
finishes the ``peak`` figure never falls while that holds (the decoding requests'
projections are fixed in time and only grow when a count grows), so a request the budget
holds back stays held until an iteration that is not pure decode: one in which a request
finishes, starts decoding, is preempted or is not scheduled. The engines keep their event
skipping exact on that (see :meth:`rlbatch.serving.deployment.Deployment.run_until`).
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Literal

from rlbatch.request import Request

PRIOR_OUTPUT_TOKENS = 4096
SHIFT_WINDOW = 16
SHIFT_TRIGGER = 6
KvReserveMode = Literal["observed", "declared", "oracle"]
KV_RESERVE_MODES: tuple[KvReserveMode, ...] = ("observed", "declared", "oracle")
KvCommitMode = Literal["final", "peak"]
KV_COMMIT_MODES: tuple[KvCommitMode, ...] = ("final", "peak")


def check_kv_commit(mode: str) -> None:
    """Refuse a ``kv_commit`` that is not one of :data:`KV_COMMIT_MODES`.

    :raises ValueError: naming the bad value.
    """
    if mode not in KV_COMMIT_MODES:
        raise ValueError(f"kv_commit must be one of {KV_COMMIT_MODES}, got {mode!r}")


PEAK_KEY_SHIFT = 40
""":func:`peak_of_keys` packs a decoding request as ``rem << 40 | current`` (current KV
below 2**40 tokens): sorting those ints sorts the ``(rem, current)`` pairs, faster."""


def peak_commitment(held: int, decoding: list[tuple[int, int]], block_size: int) -> int:
    """What ``kv_commit="peak"`` compares with the budget (the module docstring): the peak of
    the projected KV, or the sum of the counts when that is smaller. ``held`` tokens
    throughout, plus each decoding request at ``current + k`` tokens ``k`` iterations from
    now until it reaches its count, then nothing. Each request alive at the peak but the one
    reaching its count there is rounded up to whole blocks (``block_size - 1`` tokens more),
    so with exact counts (whole blocks) the figure bounds the blocks the requests will hold.

    :param held: the counts of the requests not decoding (and of the one being admitted).
    :param decoding: ``(current KV, count)`` of each decoding request, tokens.
    :param block_size: tokens per KV block.
    :returns: the largest total at any iteration from now on, at most ``held`` plus the
        decoding requests' counts, tokens.
    """
    keys = [((count - cur if count > cur else 0) << PEAK_KEY_SHIFT) | cur
            for cur, count in decoding]
    return peak_of_keys(held, keys, sum(count for _, count in decoding), block_size)


def peak_of_keys(held: int, keys: list[int], counts: int, block_size: int) -> int:
    """:func:`peak_commitment` of decoding requests packed as ``rem << PEAK_KEY_SHIFT |
    current`` (``rem``: tokens to grow to the count, 0 at or past it); ``keys`` is sorted
    in place.

    :param held: as :func:`peak_commitment`.
    :param keys: one per decoding request.
    :param counts: the decoding requests' counts summed.
    :param block_size: tokens per KV block.
    """
    # The total rises between finishes, so its peak is just before one: k iterations on, the
    # requests alive are those with at least k tokens to grow (taken longest first).
    keys.sort(reverse=True)
    mask = (1 << PEAK_KEY_SHIFT) - 1
    peak = total = 0
    slack = block_size - 1
    for alive, key in enumerate(keys, start=1):
        total += key & mask
        value = total + alive * (key >> PEAK_KEY_SHIFT) + (alive - 1) * slack
        if value > peak:
            peak = value
    return held + (peak if peak < counts else counts)


def check_kv_reserve(mode: str, quantile: float,
                     modes: tuple[str, ...] = KV_RESERVE_MODES) -> None:
    """Refuse a reserve mode or quantile that is not one (every settings class calls this).

    :param mode: the mode asked for.
    :param quantile: the output quantile asked for.
    :param modes: the modes the caller supports.
    :raises ValueError: naming the bad value.
    """
    if mode not in modes:
        raise ValueError(f"kv_reserve must be one of {modes}, got {mode!r}")
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"kv_reserve_quantile must be in (0, 1], got {quantile}")


def declared_output_limit(request: Request, prompt_tokens: int, max_model_len: int) -> int:
    """The output ceiling vLLM enforces: the client's ``max_tokens``, or the rest of the
    context when it sent none (vLLM's default), cut to the context.

    :param request: the request.
    :param prompt_tokens: its prompt tokens (after truncation).
    :param max_model_len: the engine's context.
    """
    room = max(max_model_len - prompt_tokens, 1)
    return room if request.max_tokens is None else min(request.max_tokens, room)


def round_to_blocks(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to whole KV blocks (a request holds ``ceil(tokens / block)``)."""
    return -(-tokens // block_size) * block_size


class OutputReserve:
    """Per-engine reservation rule (see the module docstring).

    :param mode: ``observed``, ``declared`` or ``oracle``.
    :param num_buckets: prompt-length buckets (one output history each).
    :param block_size: tokens per KV block.
    :param max_model_len: the engine's context.
    :param quantile: the output quantile reserved at admission (``observed``).
    :param window: completions kept per bucket.
    :param min_samples: completions a bucket needs before its quantile is trusted.
    :param prior_output_tokens: output tokens reserved (``observed``) while no history has
        ``min_samples`` completions yet.
    :param shift_window: the recent completions a history watches for a turn to longer
        outputs (the module docstring).
    :param shift_trigger: how many of them, each longer than the history's quantile when it
        finished, make the history forget all but them (``None``: never).
    """

    def __init__(self, mode: KvReserveMode, num_buckets: int, block_size: int,
                 max_model_len: int, *, quantile: float = 0.9, window: int = 256,
                 min_samples: int = 16, prior_output_tokens: int = PRIOR_OUTPUT_TOKENS,
                 shift_window: int = SHIFT_WINDOW,
                 shift_trigger: int | None = SHIFT_TRIGGER) -> None:
        check_kv_reserve(mode, quantile)
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got "
                             f"window={window}, min_samples={min_samples}")
        if prior_output_tokens < 1:
            raise ValueError(f"prior_output_tokens must be >= 1, got {prior_output_tokens}")
        if shift_trigger is not None and not 1 <= shift_trigger <= shift_window <= window:
            raise ValueError(f"need 1 <= shift_trigger <= shift_window <= window, got "
                             f"shift_trigger={shift_trigger}, shift_window={shift_window}, "
                             f"window={window}")
        self.shift_window = shift_window
        self.shift_trigger = shift_trigger
        self.prior_output_tokens = prior_output_tokens
        self.mode: KvReserveMode = mode
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.quantile = quantile
        self.min_samples = min_samples
        # one history per bucket, and the last one pooled over all buckets; each also kept
        # sorted as completions come and go, so a quantile is one index
        self._history: list[deque[int]] = [deque(maxlen=window)
                                           for _ in range(num_buckets + 1)]
        self._sorted: list[list[int]] = [[] for _ in range(num_buckets + 1)]
        # Quantiles are re-read only after new completions (a cache per history).
        self._cached: list[int | None] = [None] * (num_buckets + 1)
        # per history: whether each of its last shift_window completions ran past the
        # quantile in force when it finished
        self._past: list[deque[bool]] = [deque(maxlen=shift_window)
                                         for _ in range(num_buckets + 1)]

    def fork(self) -> OutputReserve:
        """An independent copy (a digital twin's engine fork must not feed the original)."""
        new = object.__new__(OutputReserve)
        new.__dict__.update(self.__dict__)
        new._history = [deque(h, maxlen=h.maxlen) for h in self._history]
        new._sorted = [list(s) for s in self._sorted]
        new._cached = list(self._cached)
        new._past = [deque(p, maxlen=p.maxlen) for p in self._past]
        return new

    def observe(self, bucket: int, output_tokens: int) -> None:
        """A request of ``bucket`` finished after ``output_tokens`` tokens."""
        if self.mode == "observed":
            for index in (bucket, -1):
                history = self._history[index]
                ordered = self._sorted[index]
                if self.shift_trigger is not None:
                    # noted before the completion joins the history it is compared with
                    quantile = self._quantile_of(index)
                    self._past[index].append(quantile is not None and output_tokens > quantile)
                if len(history) == history.maxlen:
                    del ordered[bisect.bisect_left(ordered, history[0])]
                history.append(output_tokens)
                bisect.insort(ordered, output_tokens)
                self._cached[index] = None
                if self.shift_trigger is not None and sum(self._past[index]) >= self.shift_trigger:
                    self._forget_before_shift(index)

    def _quantile_of(self, index: int) -> int | None:
        ordered = self._sorted[index]
        if len(ordered) < self.min_samples:
            return None
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def _forget_before_shift(self, index: int) -> None:
        """The history keeps only the completions that showed the turn."""
        history = self._history[index]
        if len(history) > self.shift_window:
            kept = list(history)[-self.shift_window:]
            history.clear()
            history.extend(kept)
            self._sorted[index] = sorted(kept)
        self._past[index].clear()

    def expected_output(self, bucket: int) -> int | None:
        """The output tokens reserved at admission for ``bucket``: its own quantile, else
        the pooled one (``None``: too few completions anywhere yet)."""
        for index in (bucket, -1):
            cached = self._cached[index]
            if cached is not None:
                return cached
            value = self._quantile_of(index)
            if value is not None:
                self._cached[index] = value
                return value
        return None

    def limit_tokens(self, request: Request, prompt_tokens: int) -> int:
        """KV at the request's limit, whole blocks (what ``declared`` reserves)."""
        if self.mode == "oracle":
            tokens = prompt_tokens + request.max_output_tokens
        else:
            tokens = prompt_tokens + declared_output_limit(request, prompt_tokens,
                                                           self.max_model_len)
        if tokens > self.max_model_len:
            tokens = self.max_model_len
        block = self.block_size
        return -(-tokens // block) * block  # round_to_blocks, inline (once per request)

    def admission(self, request: Request, bucket: int,
                  prompt_tokens: int) -> tuple[int, int, int]:
        """A request entering the engine: ``(limit, count, grow_at)``, its
        :meth:`limit_tokens`, its :meth:`within` that limit and the :meth:`next_growth_at` of
        that count."""
        limit = self.limit_tokens(request, prompt_tokens)
        count = self.within(limit, bucket, prompt_tokens)
        return limit, count, self.next_growth_at(count, limit, prompt_tokens)

    def at_admission(self, request: Request, bucket: int, prompt_tokens: int) -> int:
        """KV the request is counted at when it enters the engine, whole blocks."""
        return self.within(self.limit_tokens(request, prompt_tokens), bucket, prompt_tokens)

    def within(self, limit: int, bucket: int, prompt_tokens: int) -> int:
        """The admission count of a request whose limit is ``limit`` tokens: the limit, or
        (``observed``) prompt + its bucket's expected output (the prior while nothing is
        known) when that is less.

        :param limit: its KV at its limit (:meth:`limit_tokens`, or what the caller knows).
        :param bucket: its bucket.
        :param prompt_tokens: its prompt.
        """
        if self.mode != "observed":
            return limit
        expected = self.expected_output(bucket)
        if expected is None:
            expected = self.prior_output_tokens
        block = self.block_size
        tokens = -(-(prompt_tokens + expected) // block) * block  # round_to_blocks
        return tokens if tokens < limit else limit

    def grown(self, reserved: int, limit: int, prompt_tokens: int, num_output: int) -> int:
        """The count of a running request that generated ``num_output`` tokens: its
        admission reserve, or ``prompt + 2 x num_output`` once it outgrows that, at most its
        limit (whole blocks).

        :param reserved: its admission reserve.
        :param limit: its limit (:meth:`limit_tokens`).
        :param prompt_tokens: its prompt.
        :param num_output: tokens generated so far.
        """
        block = self.block_size
        need = -(-(prompt_tokens + 2 * num_output) // block) * block  # round_to_blocks
        if need <= reserved:
            return reserved
        return need if need < limit else limit

    def next_growth_at(self, reserved: int, limit: int, prompt_tokens: int) -> int:
        """The output count from which :meth:`grown` exceeds ``reserved`` (a sentinel above
        any output when it never does)."""
        if reserved >= limit:
            return 1 << 62
        # grown > reserved  <=>  prompt + 2 g > reserved
        return max((reserved - prompt_tokens) // 2 + 1, 0)


def shift_trigger(enabled: bool) -> int | None:
    """The :class:`OutputReserve` ``shift_trigger`` of an engine setting ``kv_reserve_shift``
    (on: :data:`SHIFT_TRIGGER`; off: ``None``)."""
    return SHIFT_TRIGGER if enabled else None
