"""``gradient``: a feedback rule on the total batch from the windowed TPOT P99 against the SLA.

The baseline a learned controller must clear: a hand-built adaptive rule in the spirit of
Netflix's concurrency-limits (its gradient limit: the limit follows the ratio of the target
latency to the measured one) and of memory-aware SLA batching (arXiv 2503.05248), acting on the
engine-wide total (vLLM's ``max_num_seqs``), in deadline order, behind the guard.

Every tick, from the last tick's snapshot:

* the windowed TPOT P99 over ``tpot_target`` x the SLA's TPOT (a bigger batch makes every
  decode step slower), or the TTFT P99 over ``ttft_target`` x the SLA's TTFT while nothing
  waits (prefill contention, not queueing): the total is multiplied by the gradient
  ``target / measured`` (at least ``min_gradient``), at most once per ``cooldown_s`` (the
  window's P99 needs time to show a change);
* otherwise, while requests wait (in admission or inside an engine), the total grows by
  ``increase``; with nothing waiting it stays.

The total stays within ``[min_total, max_total]``. A TTFT breach with a queue is queueing,
which a smaller batch deepens: that is left to deadline order and to the guard.

With ``signal="misses"`` a latency breach lowers the total only while, over the last
``window_s``, more finished requests missed the SLA on TPOT alone than on TTFT: where the
queue costs more requests than slow decoding does (a burst of conversation traffic at a total
of 256), a smaller batch would trade the few for the many, so the total holds or grows.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from policies.rules import GuardedController
from rlbatch.control.action_codec import TOTAL_LADDER
from rlbatch.control.discipline import QueueOrder
from rlbatch.control.guard import GuardConfig
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats, balanced_route
from rlbatch.settings import apply

TOTAL_GUARD = GuardConfig(ladder=TOTAL_LADDER)
"""The guard on the total ladder (up to 256), as ``ppo:PATH``'s artifacts record it."""


@dataclass(frozen=True)
class GradientSettings:
    """Settings of ``gradient`` (:class:`GradientController`).

    ``tpot_target``, ``increase``, ``cooldown_s`` and ``signal`` are tuned on training traffic
    only (``experiments/tune_gradient.py``: the Azure training window and the traffic
    families' training seed; the best geo-mean goodput over the best static's of 16 settings).

    :param start_total: the total at the start of a run.
    :param min_total: the smallest total.
    :param max_total: the largest total.
    :param tpot_target: the fraction of the SLA's TPOT the windowed TPOT P99 is held under.
    :param ttft_target: the fraction of the SLA's TTFT that, with nothing waiting, counts as
        a breach too (prefill contention).
    :param min_gradient: the most one decrease may shrink the total (0.5: halve it).
    :param increase: added to the total per tick while requests wait and latency is within
        its targets.
    :param cooldown_s: the least time between two decreases.
    :param signal: ``p99``: a breach of a latency target lowers the total; ``misses``: only
        while TPOT misses outnumber TTFT misses over ``window_s`` (module docstring).
    :param window_s: how far back ``misses`` counts finished requests.
    :param order: the order of admission's queues.
    :param guard: the guard.
    """

    start_total: int = 64
    min_total: int = 4
    max_total: int = 256
    tpot_target: float = 1.0
    ttft_target: float = 0.9
    min_gradient: float = 0.5
    increase: int = 8
    cooldown_s: float = 15.0
    signal: Literal["p99", "misses"] = "p99"
    window_s: float = 30.0
    order: QueueOrder = "deadline"
    guard: GuardConfig = TOTAL_GUARD

    def __post_init__(self) -> None:
        if not 1 <= self.min_total <= self.start_total <= self.max_total:
            raise ValueError(f"need 1 <= min_total <= start_total <= max_total, got "
                             f"{self.min_total}, {self.start_total}, {self.max_total}")
        if not (0 < self.tpot_target <= 1 and 0 < self.ttft_target <= 1):
            raise ValueError(f"tpot_target and ttft_target must be in (0, 1], got "
                             f"{self.tpot_target}, {self.ttft_target}")
        if not 0 < self.min_gradient < 1:
            raise ValueError(f"min_gradient must be in (0, 1), got {self.min_gradient}")
        if self.signal not in ("p99", "misses"):
            raise ValueError(f"signal must be p99 or misses, got {self.signal!r}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.increase < 0 or not self.cooldown_s >= 0:
            raise ValueError(f"increase and cooldown_s must be >= 0, got {self.increase}, "
                             f"{self.cooldown_s}")
        if self.max_total > self.guard.max_total_cap:
            raise ValueError(f"max_total {self.max_total} is over the guard's max_total_cap "
                             f"{self.guard.max_total_cap}")


class GradientController(GuardedController):
    """The feedback rule of the module docstring.

    :param settings: its settings.
    """

    def __init__(self, settings: GradientSettings | None = None) -> None:
        self.settings = settings or GradientSettings()
        super().__init__("gradient", self.settings.guard, self.settings.order)
        self.total = float(self.settings.start_total)
        self._decreased_at = -math.inf
        self._misses: deque[tuple[float, int, int]] = deque()

    def on_reset(self, info: DeploymentInfo) -> None:
        self.total = float(self.settings.start_total)
        self._decreased_at = -math.inf
        self._misses.clear()

    def _tpot_dominates(self, stats: DeploymentStats) -> bool:
        """Over the last ``window_s``: more finished requests missed on TPOT alone than on
        TTFT (refused requests count as TTFT misses)."""
        assert self.info is not None
        sla = self.info.sla
        ttft = sum(stats.rejected) + sum(1 for r in stats.finished
                                         if not r.rejected and r.ttft_s > sla.ttft_s)
        tpot = sum(1 for r in stats.finished
                   if not r.rejected and r.ttft_s <= sla.ttft_s and r.tpot_s > sla.tpot_s)
        self._misses.append((stats.time_s, ttft, tpot))
        while self._misses and self._misses[0][0] <= stats.time_s - self.settings.window_s:
            self._misses.popleft()
        return sum(m[2] for m in self._misses) > sum(m[1] for m in self._misses)

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        cfg = self.settings
        if stats is not None:
            sla = self.info.sla
            w = stats.window
            waiting = sum(stats.queued) + stats.waiting_total > 0
            # target / measured of each breached latency (NaN, no completion: no signal)
            ratios: list[float] = []
            tpot_s, ttft_s = cfg.tpot_target * sla.tpot_s, cfg.ttft_target * sla.ttft_s
            # with "misses", a breach counts only while slow decoding costs more requests
            # than the queue does (the window is kept every tick, so it is asked every tick)
            if cfg.signal == "p99" or self._tpot_dominates(stats):
                if w.tpot_p99_all_s > tpot_s:
                    ratios.append(tpot_s / w.tpot_p99_all_s)
                if not waiting and w.ttft_p99_all_s > ttft_s:
                    ratios.append(ttft_s / w.ttft_p99_all_s)
            if ratios:
                if stats.time_s - self._decreased_at >= cfg.cooldown_s:
                    gradient = max(cfg.min_gradient, min(ratios))
                    self.total = max(float(cfg.min_total), self.total * gradient)
                    self._decreased_at = stats.time_s
            elif waiting:
                self.total = min(float(cfg.max_total), self.total + cfg.increase)
        n = len(self.info.buckets)
        return ControlAction((None,) * n, (balanced_route(self.info.pool_names),) * n,
                             max(1, int(self.total)))


def gradient_factory(arg: str, settings: Mapping[str, Any]) -> GradientController:
    """``gradient``; settings: :class:`GradientSettings`, e.g.
    ``gradient[tpot_target=0.8,increase=8]``.

    :raises ValueError: an argument after ``gradient:``, or a bad setting.
    """
    if arg:
        raise ValueError(f"gradient takes settings in brackets, e.g. gradient[increase=8]; "
                         f"got gradient:{arg}")
    return GradientController(apply(GradientSettings(), settings))

