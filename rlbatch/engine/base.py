"""The Engine protocol: what the deployment (admission, control loop) needs of an engine.

The simulator implements it now; the live vLLM engine implements the same surface, so the
control loop, the env and the evaluation never know which one runs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from rlbatch.engine.reserve import KvCommitMode
from rlbatch.engine.stats import AbortedRequest, EngineStats
from rlbatch.request import Request


class PrefillTime(NamedTuple):
    """How long an arrival's own prefill takes on an engine, from the engine's step-time
    model (:meth:`Engine.prefill_time_s`); both are floors: decodes and overheads are left
    out."""

    alone_s: float
    """On the engine with nothing else running: its prompt minus the prefix the engine's
    caches hold, in chunks of the token budget."""
    now_s: float
    """After the prefills already running on it, which the scheduler serves first."""


class Engine(Protocol):
    """One serving engine (one vLLM instance) of one pool."""

    engine_id: int
    pool: str

    @property
    def now_s(self) -> float:
        """The engine clock (simulated seconds, or wall seconds on a live engine)."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """The engine-wide cap on running sequences currently in force."""
        ...

    def set_max_num_seqs(self, value: int) -> None:
        """Change the engine-wide cap; running sequences above it finish, none is killed."""
        ...

    def num_unfinished(self, bucket: int) -> int:
        """Requests of ``bucket`` inside the engine (running or waiting)."""
        ...

    def num_unfinished_total(self) -> int:
        """Requests inside the engine (running or waiting)."""
        ...

    def num_waiting(self, bucket: int) -> int:
        """Requests of ``bucket`` inside the engine waiting to be scheduled (admission's
        queue bound counts them for a bucket without a cap)."""
        ...

    def committed_tokens(self) -> int:
        """KV the admission budget counts for the requests inside the engine, whole blocks
        each (:class:`~rlbatch.engine.reserve.OutputReserve`: their recent-output estimate,
        grown as they run, or their declared limit)."""
        ...

    def kv_tokens_to_admit(self, request: Request, bucket: int, prompt_tokens: int) -> int:
        """What :meth:`committed_tokens` would grow by if ``request`` entered now."""
        ...

    def committed_with(self, need: int, commit: KvCommitMode) -> int:
        """What the KV budget compares with its limit if a request counted at ``need``
        (:meth:`kv_tokens_to_admit`) entered now: :meth:`committed_tokens` plus ``need``
        (``final``), or the peak of the projected KV when that is smaller (``peak``;
        :mod:`rlbatch.engine.reserve`)."""
        ...

    def kv_budget_exceeded(self, need: int, commit: KvCommitMode, limit: float) -> bool:
        """Whether a request counted at ``need`` entering now would take the engine over a KV
        budget of ``limit`` tokens: :meth:`committed_with` above it, the engine holding
        something (an empty engine takes any request; :func:`kv_budget_exceeded`)."""
        ...

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block (the unit a request's KV grows by)."""
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache pool holds (blocks x block size)."""
        ...

    def add_request(self, request: Request, bucket: int, prompt_tokens: int,
                    truncated: bool) -> None:
        """Hand a request to the engine's own waiting queue (vLLM ``add_request``)."""
        ...

    def is_idle(self) -> bool:
        """Nothing running and nothing waiting."""
        ...

    def advance_idle(self, to_s: float) -> None:
        """Move the clock of an idle engine forward to ``to_s``."""
        ...

    def step(self, bound_s: float) -> None:
        """Run one iteration; may run further iterations while nothing but decoding happens
        and the clock at the start of the next one is below ``bound_s``."""
        ...

    def abort(self, request_id: int, *,
              before_first_token: bool = False) -> AbortedRequest | None:
        """Remove the request from the engine at the current iteration boundary (waiting,
        prefilling, decoding or preempted), freeing its KV blocks as vLLM does on abort
        (prefix-cached blocks stay cached and evictable, as a finished request's do). It
        never finishes and is counted in the next snapshot's ``aborted``.

        :param request_id: the workload's request id.
        :param before_first_token: abort only a request that has not produced its first
            token yet (one that has is left running).
        :returns: what it had cost; ``None`` when the engine does not hold it (finished
            already, never added) or, with ``before_first_token``, when it already produced
            its first token.
        """
        ...

    def prefill_time_s(self, request: Request, prompt_tokens: int) -> PrefillTime | None:
        """How long ``request`` would take from its first scheduled chunk to its first token
        on this engine (:class:`PrefillTime`: alone, and behind the prefills running now;
        :meth:`~rlbatch.profiles.step_time.StepTimeModel.prefill_time_s`). Admission's
        predicted TTFT adds it to the predicted wait. Reads, changes nothing.

        :param request: an arrival.
        :param prompt_tokens: its prompt as the engine would take it (truncated or whole).
        :returns: ``None`` when the engine has no latency model (a live one).
        """
        ...

    def snapshot(self) -> EngineStats:
        """Stats since the previous snapshot; resets the interval counters."""
        ...


def kv_budget_exceeded(engine: Engine, need: int, commit: KvCommitMode, limit: float) -> bool:
    """:meth:`Engine.kv_budget_exceeded` from :meth:`Engine.committed_tokens` and
    :meth:`Engine.committed_with`; the latter is read only when the sum does not fit (it is
    at most the sum, and ``peak`` projects, which costs a sort)."""
    committed = engine.committed_tokens()
    return (committed > 0 and committed + need > limit
            and engine.committed_with(need, commit) > limit)
