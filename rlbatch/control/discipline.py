"""Admission's discipline: the order of its queues and the KV budget it admits under.

These are settings of admission, fixed for a run, as vLLM's ``SchedulerConfig.policy`` picks
its request-queue class when the engine starts: a controller declares its discipline once
(:attr:`rlbatch.control.controllers.Controller.discipline`), the control loop configures
admission with it when the run starts, and every tick's :class:`~rlbatch.control.types.
ControlAction` carries only caps, routes and the total.

Queue order (:data:`QueueOrder`):

* ``fifo``: oldest first, as vLLM's own queue.
* ``deadline``: a request that can no longer meet the SLA's TTFT (its wait plus its bucket's
  predicted prefill is past it: :attr:`~rlbatch.serving.admission.AdmissionConfig.
  deadline_prefill`) goes after every request that still can, oldest first within each
  class, and an engine
  is given no more requests than it runs at once (its ``max_num_seqs``), so that requests
  wait in admission's queues, where the order applies, rather than in the engine's own FIFO
  queue. Under overload FIFO serves every request late; deadline order serves the ones that
  can still make it first and the late ones when there is room. The order drops nothing: a
  late request waits longer, and a client's timeout or the sidecar's queue timeout still
  bounds how long. What an engine's own queue held before waits in admission's now, so a
  queue bound (``--max-queue-len``) counts it. Under sustained overload a late request is
  always queued, so the hold release (:mod:`rlbatch.control.hold_release`), which reads the
  oldest request without a first token, keeps a policy's total at the top of its ladder.

KV budget (:class:`KvBudget`, the one home of its settings): admission keeps the KV its
admitted requests are counted at within a fraction of each engine's pool (how an engine
counts one request is its reserve, :mod:`rlbatch.engine.reserve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from rlbatch.engine.reserve import KvCommitMode, check_kv_commit

QueueOrder = Literal["fifo", "deadline"]
QUEUE_ORDERS: tuple[str, ...] = get_args(QueueOrder)

PPO_QUEUE_ORDER: QueueOrder = "deadline"
"""The order ``ppo:PATH`` serves in and the recipe fine-tunes in. Chosen on training traffic
and kept by a rule written before the unseen runs (BENCHMARKS.md): every shipped seed meets
the must-checks on every deployment with it (13 of 18 seed/deployment pairs with FIFO)."""


def check_queue_order(order: str) -> QueueOrder:
    """``order`` as a :data:`QueueOrder`.

    :param order: ``fifo`` or ``deadline``.
    :raises ValueError: any other value.
    """
    if order not in QUEUE_ORDERS:
        raise ValueError(f"queue order must be one of {', '.join(QUEUE_ORDERS)}, got {order!r}")
    return order  # type: ignore[return-value]


@dataclass(frozen=True)
class KvBudget:
    """Admit a request into an engine only while the KV its requests are counted at stays
    within ``fraction`` of the engine's KV pool; an empty engine always takes its oldest
    request.

    :param fraction: the share of the KV pool committed KV may use, in (0, 1].
    :param commit: what the budget compares with its limit: ``peak`` (the peak of the
        projected KV: decoding requests free theirs as they finish) or ``final`` (every
        request at its count for as long as it runs); :mod:`rlbatch.engine.reserve`.
    """

    fraction: float = 1.0
    commit: KvCommitMode = "peak"

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        check_kv_commit(self.commit)


DEFAULT_KV_BUDGET = KvBudget()
"""The guard's default budget: the whole pool, counting the peak of the projected KV."""


@dataclass(frozen=True)
class AdmissionDiscipline:
    """How admission serves its queues for a whole run.

    :param order: the order of admission's queues (module docstring).
    :param kv_budget: the KV budget admission admits under; ``None``: none (vLLM alone).
    """

    order: QueueOrder = "fifo"
    kv_budget: KvBudget | None = None

    def __post_init__(self) -> None:
        check_queue_order(self.order)


PLAIN = AdmissionDiscipline()
"""FIFO without a KV budget: what a plain vLLM server does (``static:N``, ``vllm-default``,
the sidecar's shadow mode)."""
