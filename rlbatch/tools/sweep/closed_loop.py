"""Drive one engine as a closed loop of fixed-length requests.

Method: ``concurrency`` clients each keep one request in flight. At the engine's clock 0 all
clients send at once; whenever requests finish, as many new ones are sent at the engine's
current clock (the start of its next iteration), until ``num_requests`` have been sent. The
engine therefore always holds ``concurrency`` requests until the last ones drain, and every
latency is measured from the moment its client sent it (no queueing outside the engine).

With a batch cap equal to ``concurrency`` this is exactly "all requests queued at t=0 in the
engine's FIFO queue" (vLLM admits a waiting request at the first iteration after a slot frees,
which is when the closed-loop client sends it), minus the time a queued request would have
waited behind the others, which a closed-loop benchmark does not count.

Only the :class:`rlbatch.engine.base.Engine` protocol is used (``add_request``, ``step``,
``snapshot``, ``now_s``, ``num_unfinished_total``, ``is_idle``), so a live engine runs the
same loop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from rlbatch.engine.base import Engine
from rlbatch.engine.stats import EngineStats, FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.metrics import RunTotals


@dataclass
class ClosedLoopResult:
    """Outcome of one closed-loop run.

    :param records: every finished request.
    :param sent: requests sent.
    :param makespan_s: engine time from the first send to the last finish.
    :param wall_s: wall-clock seconds the run took.
    :param totals: the engine's snapshots folded together (read after every engine step):
        KV blocks and peak usage, preemptions, KV overflows, recomputed tokens, iterations,
        most requests running at once (below the concurrency when the KV pool cannot hold
        that many: the engine admits a waiting request only if its blocks are free), and
        memory in use at the peak (NVML or process memory on a live engine, the modelled
        budget on the simulator) and in all.
    """

    records: list[FinishedRequest] = field(default_factory=list)
    sent: int = 0
    makespan_s: float = 0.0
    wall_s: float = 0.0
    totals: RunTotals = field(default_factory=RunTotals)

    def add(self, stats: EngineStats) -> None:
        """Keep a snapshot's finished requests and fold its counters into :attr:`totals`.

        :param stats: the snapshot.
        """
        self.records.extend(stats.finished)
        self.totals.add(stats)


def run_closed_loop(engine: Engine, *, bucket: int, concurrency: int, num_requests: int,
                    prompt_tokens: int, output_tokens: int,
                    max_steps: int = 50_000_000) -> ClosedLoopResult:
    """Run ``num_requests`` identical requests through ``engine``, ``concurrency`` at a time.

    :param engine: a fresh engine (clock at its start, nothing inside).
    :param bucket: the bucket index of the requests (``add_request`` needs it).
    :param concurrency: requests in flight (clients).
    :param num_requests: requests to send in all.
    :param prompt_tokens: prompt length of every request.
    :param output_tokens: output length of every request.
    :param max_steps: safety stop; exceeding it raises ``RuntimeError``.
    """
    if concurrency < 1 or num_requests < 1:
        raise ValueError(f"concurrency ({concurrency}) and num_requests ({num_requests}) "
                         f"must be >= 1")
    if not engine.is_idle():
        raise ValueError("the closed loop needs a fresh, idle engine")
    wall_start = time.perf_counter()
    result = ClosedLoopResult()
    start_s = engine.now_s
    sent = 0
    steps = 0
    while True:
        while sent < num_requests and engine.num_unfinished_total() < concurrency:
            request = Request(request_id=sent, arrival_s=engine.now_s,
                              prompt_tokens=prompt_tokens, max_output_tokens=output_tokens)
            engine.add_request(request, bucket, prompt_tokens, False)
            sent += 1
        if engine.is_idle():
            break
        # With no arrival bound the simulator may skip pure-decode iterations, but it always
        # stops before the iteration in which a request finishes, so the loop sees every
        # completion at the clock it happens.
        engine.step(math.inf)
        steps += 1
        result.add(engine.snapshot())
        if steps > max_steps:
            raise RuntimeError(f"closed loop did not finish within {max_steps} engine steps "
                               f"({len(result.records)} of {num_requests} requests done)")
    result.add(engine.snapshot())
    result.sent = sent
    result.makespan_s = max((r.finish_s for r in result.records), default=start_s) - start_s
    result.wall_s = time.perf_counter() - wall_start
    return result
