"""Digital twins: a forkable simulated copy of what a controller controls.

A model-predictive controller asks its twin for a simulated deployment in the current state
whose future arrivals are a stream it chooses (a replay of what it observed), rolls candidate
actions forward on copies of it and keeps the best. A controller that wants a twin overrides
the optional hook :meth:`Controller.bind <rlbatch.control.controllers.Controller.bind>`,
which whoever runs it calls before ``reset``.

Two twins:

* :class:`DeploymentTwin`: the exact fork of a simulated :class:`~rlbatch.serving.deployment.
  Deployment` (:func:`rlbatch.serving.run.run` binds it). Its state is the simulator's own:
  the requests queued and running with their lengths and progress. Its observed arrivals are
  the requests already submitted; the trace's future never leaves the original.
* :class:`StatsTwin`: for sources that cannot fork (live engines, the sidecar's HTTP
  upstreams), a simulated deployment rebuilt from what the controller sees: the
  :class:`~rlbatch.control.types.DeploymentInfo` (GPU, model, pools, KV blocks, budgets) and
  every tick's :class:`~rlbatch.control.types.DeploymentStats` (:meth:`Twin.observe`): the
  requests queued and inside each engine per bucket, arrivals per bucket per tick, and the
  lengths of recently finished requests, used as each bucket's representative lengths.
  Progress of running requests is unknown there: they start over in the twin (pessimistic).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rlbatch.control.discipline import PLAIN, AdmissionDiscipline
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.builders import build_sim_deployment
from rlbatch.serving.deployment import Deployment, DeploymentSpec

Pending = tuple[int, float, float, int, int]
"""A request still inside an engine: ``(bucket, arrival_s, first_token_s, num_output,
max_output)`` (``first_token_s`` -1 before the first token)."""


class Twin(Protocol):
    """A forkable copy of the controlled deployment (see the module docstring)."""

    def observe(self, stats: DeploymentStats) -> None:
        """A tick's stats (a rebuilt twin keeps what it needs; an exact fork ignores it)."""
        ...

    def observed_arrivals(self, since_s: float, now_s: float) -> list[Request]:
        """Arrivals seen in ``[since_s, now_s]`` (never one after ``now_s``)."""
        ...

    def fork(self, now_s: float, arrivals: Sequence[Request]) -> Deployment:
        """A simulated deployment in the state at ``now_s`` whose future arrivals are
        ``arrivals`` (sorted by time); each call returns an independent copy."""
        ...


def can_fork(deployment: Deployment) -> bool:
    """Every engine of ``deployment`` can fork (simulated engines)."""
    return all(callable(getattr(e, "fork", None)) for e in deployment.engines)


class DeploymentTwin:
    """The exact fork of a simulated deployment.

    :param deployment: the deployment the controller controls (read, never changed).
    """

    def __init__(self, deployment: Deployment) -> None:
        if not can_fork(deployment):
            raise TypeError("DeploymentTwin needs engines that fork (simulated ones)")
        self.deployment = deployment

    def observe(self, stats: DeploymentStats) -> None:
        """Nothing to keep: the fork is the state itself."""

    def observed_arrivals(self, since_s: float, now_s: float) -> list[Request]:
        return [r for r in self.deployment.arrived_since(since_s) if r.arrival_s <= now_s]

    def fork(self, now_s: float, arrivals: Sequence[Request]) -> Deployment:
        twin = self.deployment.fork()
        twin.load(arrivals)
        return twin


def spec_from_info(info: DeploymentInfo) -> DeploymentSpec:
    """The simulated deployment that stands for ``info`` (its GPU and model profiles, pools,
    budgets, KV blocks of the first pool that reported them, buckets, SLA)."""
    blocks = next((b for b in info.num_kv_blocks.values() if b > 0), None)
    return DeploymentSpec(
        gpu=info.gpu, model=info.model, pools=dict(info.pools),
        max_num_seqs=info.default_max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        max_model_len=info.max_model_len, num_kv_blocks=blocks, buckets=info.buckets,
        admission=AdmissionConfig(over_length="truncate"), sla=info.sla, tick_s=info.tick_s)


@dataclass
class _Tick:
    time_s: float
    tick_s: float
    arrived: tuple[int, ...]


class StatsTwin:
    """A simulated twin rebuilt from the deployment info and the stats a controller sees.

    :param info: the deployment.
    :param memory_s: how much arrival history to keep.
    :param lengths_kept: finished requests' lengths kept per bucket.
    :raises ValueError: the info's GPU or model is not a known profile.
    """

    def __init__(self, info: DeploymentInfo, *, memory_s: float = 600.0,
                 lengths_kept: int = 64) -> None:
        self.info = info
        self.template = build_sim_deployment(spec_from_info(info))
        self.memory_s = memory_s
        n = len(info.buckets)
        self.default_lengths = _default_lengths(info)
        self.lengths: list[deque[tuple[int, int]]] = [deque(maxlen=lengths_kept)
                                                      for _ in range(n)]
        self.ticks: deque[_Tick] = deque()
        self.last: DeploymentStats | None = None

    def observe(self, stats: DeploymentStats) -> None:
        self.last = stats
        self.ticks.append(_Tick(stats.time_s, stats.tick_s, stats.arrived))
        while self.ticks and self.ticks[0].time_s < stats.time_s - self.memory_s:
            self.ticks.popleft()
        for rec in stats.finished:
            if not rec.rejected:
                self.lengths[rec.bucket].append((rec.prompt_tokens, rec.output_tokens))

    def _length(self, bucket: int, k: int) -> tuple[int, int]:
        kept = self.lengths[bucket]
        return kept[k % len(kept)] if kept else self.default_lengths[bucket]

    def observed_arrivals(self, since_s: float, now_s: float) -> list[Request]:
        out: list[Request] = []
        seen = [0] * len(self.info.buckets)
        for tick in self.ticks:
            start = tick.time_s - tick.tick_s
            if tick.time_s < since_s or start > now_s:
                continue
            for b, count in enumerate(tick.arrived):
                for j in range(count):
                    t = start + tick.tick_s * (j + 0.5) / count
                    if since_s <= t <= now_s:
                        prompt, output = self._length(b, seen[b])
                        seen[b] += 1
                        out.append(Request(len(out), t, prompt, output))
        out.sort(key=lambda r: r.arrival_s)
        return out

    def fork(self, now_s: float, arrivals: Sequence[Request]) -> Deployment:
        twin = self.template.fork()
        for eng in twin.engines:
            eng.advance_idle(now_s)
        stats = self.last
        if stats is not None:
            rid = -1
            admission = twin.admission
            for es, eng in zip(stats.engines, twin.engines, strict=False):
                for b in range(len(es.running)):
                    for j in range(es.running[b] + es.waiting[b]):
                        prompt, output = self._length(b, j)
                        prompt = min(prompt, self.info.max_model_len - output)
                        if prompt >= 1:
                            eng.add_request(Request(rid, now_s, prompt, output), b, prompt,
                                            False)
                        rid -= 1
            waits = stats.oldest_wait_s or (0.0,) * len(stats.queued)
            queued: list[tuple[int, Request]] = []
            for b, count in enumerate(stats.queued):
                for j in range(count):
                    prompt, output = self._length(b, j)
                    arrival = max(0.0, now_s - waits[b] * (1 - j / count))
                    queued.append((b, Request(rid, arrival, prompt, output)))
                    rid -= 1
            queued.sort(key=lambda q: q[1].arrival_s)
            for b, req in queued:
                admission.queues[b].append((req, req.prompt_tokens, False))
        twin.load(arrivals)
        return twin


def _default_lengths(info: DeploymentInfo) -> tuple[tuple[int, int], ...]:
    """Per bucket, (prompt, output) lengths assumed before any request of it finished: the
    middle of the bucket (the last: 1.5x its lower edge) and 256 output tokens."""
    edges = info.buckets.edges
    out = 256
    room = max(1, info.max_model_len - out)
    mids = [edges[0] // 2] + [(a + b) // 2 for a, b in itertools.pairwise(edges)]
    mids.append(edges[-1] * 3 // 2)
    return tuple((max(1, min(m, room)), out) for m in mids)


@dataclass(frozen=True)
class Rollout:
    """What a rollout left: requests that finished or were refused, and those still inside
    (engines: :data:`Pending`; admission queues: ``(bucket, arrival_s)``) at its end.

    :param start_s: when it started (the fork's present).
    :param end_s: the horizon.
    :param finished: finished and rejected records.
    :param pending: requests inside engines.
    :param queued: requests in admission queues.
    """

    start_s: float
    end_s: float
    finished: list[FinishedRequest]
    pending: list[Pending]
    queued: list[tuple[int, float]]


def roll_out(twin: Deployment, action: ControlAction, start_s: float,
             end_s: float, discipline: AdmissionDiscipline = PLAIN) -> Rollout:
    """Run a forked deployment under ``action`` until ``end_s`` (the twin is consumed).

    :param twin: a fork (:meth:`Twin.fork`).
    :param action: the (guarded) action held for the whole rollout.
    :param start_s: the fork's present.
    :param end_s: the horizon.
    :param discipline: admission's discipline in the rollout (the controller's).
    """
    twin.admission.configure(discipline, twin.info.sla.ttft_s, twin.info.capacity_rps)
    twin.apply(action)
    twin.run_until(end_s)
    finished = [rec for es in twin.snapshot() for rec in es.finished]
    finished.extend(twin.admission.take_rejected())
    pending: list[Pending] = []
    for eng in twin.engines:
        pending_of = getattr(eng, "pending", None)
        if pending_of is not None:
            pending.extend(pending_of())
    queued = [(b, item[0].arrival_s) for b, q in enumerate(twin.admission.queues) for item in q]
    return Rollout(start_s, end_s, finished, pending, queued)


def replay(observed: Sequence[Request], now_s: float, window_s: float,
           horizon_s: float) -> list[Request]:
    """The arrivals of the last ``window_s`` seconds shifted forward past ``now_s``, tiled to
    fill ``horizon_s`` (the traffic assumed to continue as it just was, prompt prefixes
    included: RAG traffic that shares documents keeps sharing them, so the twin's prefix
    cache serves the replay as the engine serves the traffic).

    :param observed: the arrivals seen in ``[now_s - window_s, now_s]``.
    :param now_s: the present.
    :param window_s: the length of the observed window (> 0).
    :param horizon_s: how far to fill.
    """
    if window_s <= 0 or not observed:
        return []
    out: list[Request] = []
    tiles = math.ceil(horizon_s / window_s)
    for k in range(1, tiles + 1):
        shift = k * window_s
        for r in observed:
            t = r.arrival_s + shift
            if now_s < t <= now_s + horizon_s:
                out.append(Request(len(out), t, r.prompt_tokens, r.max_output_tokens,
                                   r.prefix_ids, r.max_tokens))
    out.sort(key=lambda r: r.arrival_s)
    return out
