"""A deployment: pools of engines behind one admission layer, advanced in engine time."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from rlbatch.buckets import Buckets
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo
from rlbatch.engine.base import Engine
from rlbatch.engine.config import PRECISIONS, check_kv_offload
from rlbatch.engine.fork import fork_state
from rlbatch.engine.reserve import KvReserveMode, check_kv_reserve
from rlbatch.engine.stats import EngineStats
from rlbatch.profiles.capacity import reference_capacity_rps
from rlbatch.profiles.step_time import StepTimeModel
from rlbatch.request import Request
from rlbatch.serving.admission import Admission, AdmissionConfig, Rejected
from rlbatch.serving.clients import ClientMix, ClientSession

_HOLD_SCAN = 16
"""Arrivals looked at ahead for one engine step (each look costs about a microsecond)."""


@dataclass(frozen=True)
class DeploymentSpec:
    """Everything needed to build a simulated deployment.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param pools: engines per pool, e.g. ``{"fp16": 1}`` or ``{"fp16": 1, "fp8": 1}``.
    :param tp: tensor-parallel degree (``None``: the model profile's default).
    :param max_num_seqs: engine ``max_num_seqs`` (``None``: vLLM's default for the GPU).
    :param max_num_batched_tokens: engine token budget (``None``: vLLM's default for the GPU).
    :param gpu_memory_utilization: vLLM ``--gpu-memory-utilization``.
    :param max_model_len: longest sequence (``None``: the model's own limit).
    :param num_kv_blocks: force the KV pool size of every engine (tests, calibration);
        ``None`` derives it from GPU memory.
    :param buckets: prompt-length buckets.
    :param admission: over-length and queue-bound policy.
    :param event_skipping: advance pure-decode runs in one go (identical results; faster).
    :param sla: SLA used by metrics and controllers.
    :param tick_s: control interval.
    :param cold_start: treat the run as starting right after an engine start (the guard's
        warm-up ramp applies); the simulator itself has no cold-start cost.
    :param engine: ``sim`` (the simulator) or ``vllm`` (real in-process vLLM engines; the
        model is ``tiny`` or a checkpoint folder).
    :param profile: a calibrated step-time profile (``rlbatch calibrate``) the simulator
        uses instead of the roofline model.
    :param kv_reserve: how the KV budget counts a request (``observed``, ``declared``,
        ``oracle``; :mod:`rlbatch.engine.reserve`).
    :param kv_reserve_quantile: output quantile ``observed`` reserves at admission.
    :param kv_reserve_shift: ``observed`` forgets a bucket's older outputs when its recent
        completions show a turn to longer answers (:mod:`rlbatch.engine.reserve`).
    :param enable_prefix_caching: the simulated engines cache prompt prefixes as vLLM V1
        does by default (``EngineConfig.enable_prefix_caching``); live engines keep it off.
    :param kv_offload_gib: host memory of each simulated engine's KV tier, GiB (vLLM's
        ``--kv-offloading-size``; ``EngineConfig.kv_offload_gib``); 0 (the default) turns it
        off. Needs prefix caching and a GPU profile with a host link bandwidth; the
        calibrated-profile simulator and live engines refuse it.
    :param clients: the clients behind the arrivals (:mod:`rlbatch.serving.clients`):
        ``patient`` (wait forever, never retry), ``sdk``, ``interactive``, or a mix such as
        ``interactive:0.3,sdk:0.7``.
    :param clients_seed: seed of the clients' profile draws and retry jitter.
    """

    gpu: str = "a100-80g"
    model: str = "llama-2-7b"
    pools: dict[str, int] = field(default_factory=lambda: {"fp16": 1})
    tp: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    buckets: Buckets = field(default_factory=Buckets)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    event_skipping: bool = True
    sla: SLA = field(default_factory=SLA)
    tick_s: float = 1.0
    cold_start: bool = False
    engine: str = "sim"
    profile: str | None = None
    kv_reserve: KvReserveMode = "observed"
    kv_reserve_quantile: float = 0.9
    kv_reserve_shift: bool = True
    enable_prefix_caching: bool = True
    kv_offload_gib: float = 0.0
    clients: str = "patient"
    clients_seed: int = 0

    def __post_init__(self) -> None:
        ClientMix.parse(self.clients)  # refuses an unknown profile or a bad share
        if not self.pools:
            raise ValueError("a deployment needs at least one pool")
        for pool in self.pools:
            if pool not in PRECISIONS:
                raise ValueError(f"unknown pool {pool!r}; pools are {PRECISIONS}")
        if not self.tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")
        if self.engine not in ("sim", "vllm"):
            raise ValueError(f"engine must be 'sim' or 'vllm', got {self.engine!r}")
        check_kv_reserve(self.kv_reserve, self.kv_reserve_quantile)
        check_kv_offload(self.kv_offload_gib, self.enable_prefix_caching)
        if self.kv_offload_gib and (self.engine != "sim" or self.profile is not None):
            raise ValueError(f"kv_offload_gib={self.kv_offload_gib}: the host KV tier is "
                             f"simulated on the roofline model only (not with --engine vllm "
                             f"or a calibrated --profile)")


class Deployment:
    """Engines of one or more pools, the admission layer, and the arrival stream.

    Built by :func:`rlbatch.serving.builders.build_deployment`; the constructor does no I/O.

    :param engines: the engines (ids 0..n-1).
    :param admission: the admission layer over those engines.
    :param info: what controllers are told about this deployment.
    """

    def __init__(self, engines: Sequence[Engine], admission: Admission,
                 info: DeploymentInfo) -> None:
        self.engines = list(engines)
        self.admission = admission
        self.info = info
        self._requests: list[Request] = []
        self._next = 0
        self.clients: ClientSession | None = None
        """The clients behind the arrivals (:meth:`set_clients`); ``None``: patient ones."""
        self.client_mix: tuple[ClientMix, int] | None = None
        """The clients' mix and seed: :meth:`load` starts a session of them."""
        self._bind_engines()

    def _bind_engines(self) -> None:
        """What :meth:`run_until` calls on the engines, looked up once: a simulated engine's
        ``advance`` (it may run further between the boundaries looked at here) and, with one
        skipping engine, whether it would admit a request added now."""
        single = self.engines[0] if len(self.engines) == 1 else None
        # Several engines can share a bucket's queue (replicas of a pool, or a bucket routed
        # to any pool): which one admits a queued request depends on how far each has run,
        # so they keep step()'s boundaries (advance() runs further and would hand requests
        # out in another order).
        self._advance = {id(e): getattr(e, "advance", e.step) if single is not None else e.step
                         for e in self.engines}
        # Several skipping engines sharing queued requests: while the KV budget holds one's
        # queue back, its skipped iterations stop at the others' boundaries
        # (see _before_other_boundaries).
        self._skip_cut: dict[int, Callable[[float, float], None]] = {
            id(e): cast("Callable[[float, float], None]", e.step) for e in self.engines
            if single is None and getattr(e, "event_skipping", False)}
        # Running past arrivals is exact only when an arrival's fate does not depend on when
        # it is submitted; refusals on overload and clients that give up depend on it.
        skips = getattr(single, "event_skipping", False)
        runs_past = skips and not (self.clients is not None or self.admission.config.sheds)
        self._holds = getattr(single, "holds_new_arrivals", None) if runs_past else None
        self._run_on = getattr(single, "advance", None) if runs_past else None
        # The budget's peak count (kv_commit="peak") can fall after an iteration that is not
        # pure decode (a request starts decoding, is preempted or is not scheduled), which
        # advance() may run past: while that budget holds a request back, the engine takes
        # step()'s boundaries (each such iteration is looked at).
        self._step_while_peak_held = (cast("Callable[[float], None]", single.step)
                           if single is not None and skips else None)

    def load(self, requests: Sequence[Request]) -> None:
        """Set the arrival stream (sorted by arrival time)."""
        if any(b.arrival_s < a.arrival_s for a, b in itertools.pairwise(requests)):
            raise ValueError("requests must be sorted by arrival_s")
        self._requests = list(requests)
        self._next = 0
        if self.client_mix is not None:
            mix, seed = self.client_mix
            first_retry_id = max((r.request_id for r in requests), default=-1) + 1
            self.set_clients(ClientSession(mix, seed, first_retry_id))

    def set_clients(self, session: ClientSession | None) -> None:
        """Put clients that give up and retry behind the arrivals (before the run starts).

        :param session: the run's clients; ``None``: patient ones.
        """
        self.clients = session
        self._bind_engines()

    def apply(self, action: ControlAction) -> None:
        self.admission.apply(action)

    def fork(self) -> Deployment:
        """An independent copy of the deployment's state (a digital twin): engines and
        admission copied, the request stream, profiles and info shared (immutable). Run
        forward under the same actions it gives exactly the records the original gives;
        running or loading it never changes the original.

        :raises TypeError: an engine cannot fork (live vLLM engines).
        """
        engines: list[Engine] = []
        for eng in self.engines:
            fork = getattr(eng, "fork", None)
            if fork is None:
                raise TypeError(f"{type(eng).__name__} cannot fork; only simulated engines do")
            engines.append(fork())
        # a twin plans without the clients: it serves the requests it holds as if their
        # clients waited (a planner's approximation)
        new = fork_state(self, share=("_requests", "engines", "admission", "clients"))
        new.clients = None
        new.client_mix = None
        new.engines = engines
        new.admission = self.admission.fork(engines)
        new._bind_engines()
        return new

    def arrived_since(self, since_s: float) -> list[Request]:
        """The requests already submitted (arrived) at or after ``since_s``: what the
        service has seen of its recent traffic, never a future arrival.

        :param since_s: the earliest arrival time wanted.
        """
        requests = self._requests
        lo = bisect.bisect_left(requests, since_s, hi=self._next, key=lambda r: r.arrival_s)
        return requests[lo:self._next]

    @property
    def submitted(self) -> int:
        return self._next

    @property
    def last_arrival_s(self) -> float:
        return self._requests[-1].arrival_s if self._requests else 0.0

    def run_until(self, t_stop: float) -> None:
        """Advance every engine until its next iteration would start at or after ``t_stop``."""
        requests = self._requests
        n_req = len(requests)
        admission = self.admission
        engines = self.engines
        single = engines[0] if len(engines) == 1 else None
        holds = self._holds
        advance = self._advance
        run_on = self._run_on
        idx = self._next
        skip_cut = self._skip_cut
        step_while_peak_held = self._step_while_peak_held
        clients = self.clients
        events = clients is not None or admission.config.queue_ttl_s is not None
        submit = admission.submit if clients is None else self._submit_attempt
        while True:
            eng = single if single is not None else min(
                engines, key=lambda e: (e.now_s, e.engine_id))
            now = eng.now_s
            if now >= t_stop:
                break
            if events:
                self._client_events(now)
            while idx < n_req and requests[idx].arrival_s <= now:
                submit(requests[idx])
                idx += 1
            admission.admit(eng)
            bound = requests[idx].arrival_s if idx < n_req else math.inf
            if t_stop < bound:
                bound = t_stop
            if events:
                bound = min(bound, self._next_event_s(now))
            # deadline order: the request the KV budget holds back turns late there, and
            # another may go first without a finish
            turn = admission.order_change_s
            cut = (math.inf if turn == math.inf
                   else turn if turn > now else math.nextafter(now, math.inf))
            if cut < bound:
                bound = cut
            if eng.is_idle():
                eng.advance_idle(bound)
            elif id(eng) in skip_cut and admission.budget_blocked:
                skip_cut[id(eng)](bound, _before_other_boundaries(eng, engines, now, bound))
            elif (step_while_peak_held is not None and admission.budget_blocked
                  and admission.kv_commit == "peak"):
                step_while_peak_held(bound)
            elif run_on is not None:
                # One skipping engine: past arrivals that cannot change its running requests,
                # and on through boundaries where nothing is to be done here.
                then = -math.inf if any(admission.queues) else bound
                if holds is not None and bound < t_stop:
                    bound = min(self._hold_bound(idx, t_stop, holds()), cut)
                run_on(bound, then)
            else:
                advance[id(eng)](bound)
        if holds is not None:
            # Arrivals the engine ran past that were due before its last iteration started
            # belong to this tick, as when stepping.
            last = getattr(single, "last_start_s", -math.inf)
            while idx < n_req and requests[idx].arrival_s <= last:
                submit(requests[idx])
                idx += 1
        self._next = idx

    def _submit_attempt(self, request: Request) -> None:
        """Submit an attempt whose client may give up or retry (:attr:`clients`)."""
        clients = self.clients
        assert clients is not None
        clients.arrive(request)
        outcome = self.admission.submit(request)
        if isinstance(outcome, Rejected):
            clients.refused(request, outcome, request.arrival_s)

    def _client_events(self, now: float) -> None:
        """At an iteration boundary: expire queued requests past the queue TTL, cancel the
        requests whose clients gave up, and submit the retries that are due."""
        admission = self.admission
        clients = self.clients
        for request, refusal in admission.expire(now):
            admission.forget(request.request_id)
            if clients is not None:
                clients.refused(request, refusal, now)
        if clients is None:
            return
        for rid, before_first_token in clients.due_timers(now):
            aborted = None
            if admission.cancel(rid):
                admission.forget(rid)
            else:
                for engine in self.engines:
                    aborted = engine.abort(rid, before_first_token=before_first_token)
                    if aborted is not None:
                        admission.forget(rid)
                        break
                else:
                    continue  # finished, or it has its first token: the client stays
            clients.gave_up(rid, not before_first_token, now, aborted)
        for retry in clients.due_retries(now):
            self._submit_attempt(retry)

    def _next_event_s(self, now: float) -> float:
        """The next client event or queue expiry after ``now`` (the engines stop there)."""
        t = self.admission.next_expiry_s()
        if self.clients is not None:
            t = min(t, self.clients.next_event_s())
        return t if t > now else math.nextafter(now, math.inf)

    def _hold_bound(self, idx: int, t_stop: float, engine_holds: bool) -> float:
        """The next arrival that can change the engine's running requests (within the next
        few, at most ``t_stop``): the engine may run past the others, which are then submitted
        at the next boundary (:meth:`Admission.leaves_running`; one engine only)."""
        requests = self._requests
        admission = self.admission
        engine = self.engines[0]
        end = min(len(requests), idx + _HOLD_SCAN)
        while idx < end:
            request = requests[idx]
            if request.arrival_s >= t_stop or not admission.leaves_running(
                    request, engine, engine_holds):
                return min(request.arrival_s, t_stop)
            idx += 1
        return requests[idx].arrival_s if idx < len(requests) and \
            requests[idx].arrival_s < t_stop else t_stop

    def done(self) -> bool:
        """All arrivals submitted (retries included), nothing queued, every engine idle."""
        return (self._next >= len(self._requests) and self.admission.num_queued() == 0
                and all(e.is_idle() for e in self.engines)
                and (self.clients is None or not self.clients.retries_pending))

    def unfinished(self) -> int:
        """Requests submitted but not finished or rejected (queued or inside an engine)."""
        return self.admission.num_queued() + sum(e.num_unfinished_total() for e in self.engines)

    def snapshot(self) -> tuple[EngineStats, ...]:
        return tuple(e.snapshot() for e in self.engines)

    def close(self) -> None:
        """Release engines that hold resources (live vLLM engines: model and KV pool)."""
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if close is not None:
                close()


def _before_other_boundaries(engine: Engine, engines: list[Engine], now: float,
                             bound: float) -> float:
    """``bound`` cut to the earliest boundary of the other engines (``engine`` is at the
    earliest one, ``now``, and its KV budget holds the oldest eligible request back): there
    one of them may take that request, after which stepping admits the next one into
    ``engine`` at its next boundary, so no iteration of ``engine`` that starts later may be
    skipped. (A queue closed to ``engine`` by its caps or routes stays closed whatever the
    others take, until something here finishes.) At a tie the cut lies just past ``now``:
    one iteration, none skipped. Waits are not cut (``step``'s ``skip_before_s``): the
    request-by-request reference does not cut them either."""
    for other in engines:
        if other is not engine:
            start = other.now_s
            if start < bound:
                bound = start if start > now else math.nextafter(now, math.inf)
    return bound


def describe_deployment(*, pools: dict[str, int], num_kv_blocks: dict[str, int],
                        buckets: Buckets, gpu: str, model: str, max_model_len: int,
                        block_size: int, default_max_num_seqs: int,
                        max_num_batched_tokens: int, tick_s: float = 1.0,
                        sla: SLA | None = None, cold_start: bool = False,
                        capacity_rps: float = 0.0) -> DeploymentInfo:
    """What controllers are told about a deployment: the one place a DeploymentInfo is made
    (:func:`assemble_deployment` for engines in this process, the sidecar for upstream
    servers, whose pools and KV sizes it learns from their metrics).

    :param pools: engines per pool.
    :param num_kv_blocks: KV blocks per engine of each pool.
    :param buckets: prompt-length buckets.
    :param gpu: device name for reports.
    :param model: model name for reports.
    :param max_model_len: longest sequence admitted.
    :param block_size: tokens per KV block.
    :param default_max_num_seqs: the engines' configured ``max_num_seqs``.
    :param max_num_batched_tokens: the engines' token budget per iteration.
    :param tick_s: control interval.
    :param sla: the SLA (default: DESIGN.md's).
    :param cold_start: the engines have just started (the guard's warm-up applies).
    :param capacity_rps: reference requests per second of the whole deployment (0: unknown).
    :raises ValueError: a negative or non-finite ``capacity_rps``.
    """
    if not math.isfinite(capacity_rps) or capacity_rps < 0:
        raise ValueError(f"capacity_rps must be finite and >= 0, got {capacity_rps}")
    return DeploymentInfo(
        buckets=buckets, pools=pools, gpu=gpu, model=model,
        default_max_num_seqs=default_max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
        block_size=block_size, max_model_len=max_model_len, tick_s=tick_s,
        sla=sla or SLA(), cold_start=cold_start, capacity_rps=capacity_rps)


def assemble_deployment(
    engines: Sequence[Engine],
    *,
    buckets: Buckets,
    admission: AdmissionConfig,
    gpu: str,
    model: str,
    max_model_len: int,
    block_size: int,
    default_max_num_seqs: int,
    max_num_batched_tokens: int,
    tick_s: float = 1.0,
    sla: SLA | None = None,
    cold_start: bool = False,
    step_models: Mapping[str, StepTimeModel] | None = None,
) -> Deployment:
    """Put engines (simulated, calibrated or live) behind one admission layer; the pools and
    their KV block counts are read off the engines, in engine order.

    :param engines: the engines, ids 0..n-1, grouped by pool.
    :param buckets: prompt-length buckets.
    :param admission: over-length and queue-bound policy.
    :param gpu: device name for reports.
    :param model: model name for reports.
    :param max_model_len: longest sequence admitted.
    :param block_size: tokens per KV block.
    :param default_max_num_seqs: the engines' configured ``max_num_seqs``.
    :param max_num_batched_tokens: the engines' token budget per iteration.
    :param tick_s: control interval.
    :param sla: the SLA (default: DESIGN.md's).
    :param cold_start: the engines have just started (the guard's warm-up applies).
    :param step_models: the step-time model of each pool's engines, for the deployment's
        reference capacity (:mod:`rlbatch.profiles.capacity`, summed over engines); ``None``:
        the capacity is unknown (0).
    """
    pools: dict[str, int] = {}
    for eng in engines:
        pools[eng.pool] = pools.get(eng.pool, 0) + 1
    capacity_rps = 0.0 if step_models is None else sum(
        reference_capacity_rps(step_models[e.pool], e.kv_capacity_tokens, default_max_num_seqs)
        for e in engines)
    info = describe_deployment(
        buckets=buckets, pools=pools, gpu=gpu, model=model,
        default_max_num_seqs=default_max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks={e.pool: e.kv_capacity_tokens // block_size for e in engines},
        block_size=block_size, max_model_len=max_model_len, tick_s=tick_s,
        sla=sla, cold_start=cold_start, capacity_rps=capacity_rps)
    return Deployment(engines, Admission(list(engines), buckets, max_model_len, admission), info)
