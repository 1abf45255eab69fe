"""Clients that give up and retry: how the users behind a workload react to waits and refusals.

A workload says when requests arrive; a client profile says what its client does next. The
simulator replays the profiles (:class:`ClientSession`, driven by
:class:`~rlbatch.serving.deployment.Deployment`), the sidecar's load tests use the same ones.

* ``patient``: waits forever, never retries (every run before profiles existed).
* ``sdk``: the official ``openai`` Python client's defaults (``openai/_constants.py`` and
  ``_base_client.py``, version 3.63): a 600-s timeout per attempt (``httpx.Timeout(600)``;
  a non-streamed request receives nothing until it completes), 2 retries, on 408, 409, 429,
  every 5xx and timeouts; the delay is the server's ``Retry-After`` when it lies in
  (0, 120] s (a longer one is not retried), else ``min(0.5 * 2**retries_taken, 8)`` s times
  ``1 - 0.25 * U[0, 1)``; a response with ``x-should-retry: false`` is not retried.
* ``interactive``: a browser or gateway that gives up on a request without a first token
  after 20 s, and never retries.

A client that gives up cancels its request: admission drops it from its queue, or the engine
aborts it and frees its KV (as vLLM aborts a request whose connection closed); the work the
engine spent on it is *wasted*. A retry is a new arrival with a new id, linked to its
original: the user's wait runs from the original's arrival.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlbatch.engine.stats import AbortedRequest, FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.admission import Rejected


@dataclass(frozen=True)
class ClientProfile:
    """How one kind of client behaves.

    :param name: the profile's name.
    :param first_token_patience_s: give up on a request without a first token this long
        after its first attempt arrived; ``None``: never.
    :param attempt_timeout_s: give up on an attempt not complete this long after it was sent
        (a timeout, retried when ``retry_on_timeout``); ``None``: never.
    :param max_retries: retries after the first attempt.
    :param retry_statuses: refusal statuses retried besides every 5xx when
        ``retry_server_errors``.
    :param retry_server_errors: every 5xx status is retried.
    :param retry_on_timeout: an attempt that timed out is retried.
    :param initial_retry_delay_s: the first backoff delay.
    :param max_retry_delay_s: the longest backoff delay.
    :param max_retry_after_s: the longest ``Retry-After`` honoured (a longer one ends the
        request: not retried).
    :param jitter: the backoff delay is cut by up to this share, uniformly.
    :param obeys_should_retry: a refusal that says not to retry (``x-should-retry: false``)
        ends the request.
    """

    name: str
    first_token_patience_s: float | None = None
    attempt_timeout_s: float | None = None
    max_retries: int = 0
    retry_statuses: tuple[int, ...] = ()
    retry_server_errors: bool = False
    retry_on_timeout: bool = False
    initial_retry_delay_s: float = 0.5
    max_retry_delay_s: float = 8.0
    max_retry_after_s: float = 120.0
    jitter: float = 0.25
    obeys_should_retry: bool = False

    def __post_init__(self) -> None:
        for name in ("first_token_patience_s", "attempt_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    @property
    def gives_up(self) -> bool:
        """The client may cancel a request it sent."""
        return self.first_token_patience_s is not None or self.attempt_timeout_s is not None

    def retries_status(self, status: int, retry_after_s: float | None,
                       should_retry: bool = True) -> bool:
        """Whether a refusal with ``status`` (and ``Retry-After``) is retried, retries
        left aside.

        :param status: the HTTP status.
        :param retry_after_s: the server's advice; ``None``: none.
        :param should_retry: the server's ``x-should-retry`` (``False``: do not).
        """
        if not should_retry and self.obeys_should_retry:
            return False
        if retry_after_s is not None and retry_after_s > self.max_retry_after_s:
            return False
        return status in self.retry_statuses or (self.retry_server_errors and status >= 500)

    def retry_delay_s(self, retries_taken: int, retry_after_s: float | None,
                      rng: np.random.Generator) -> float:
        """How long the client waits before retry number ``retries_taken + 1``.

        :param retries_taken: retries already made.
        :param retry_after_s: the server's advice; ``None``: none.
        :param rng: the jitter's source.
        """
        if retry_after_s is not None and 0 < retry_after_s <= self.max_retry_after_s:
            return retry_after_s
        delay = min(self.initial_retry_delay_s * 2.0 ** retries_taken, self.max_retry_delay_s)
        return delay * (1.0 - self.jitter * float(rng.random()))


PROFILES: dict[str, ClientProfile] = {p.name: p for p in (
    ClientProfile("patient"),
    ClientProfile("sdk", attempt_timeout_s=600.0, max_retries=2, retry_statuses=(408, 409, 429),
                  retry_server_errors=True, retry_on_timeout=True, obeys_should_retry=True),
    ClientProfile("interactive", first_token_patience_s=20.0),
)}
"""The named profiles (module docstring)."""


@dataclass(frozen=True)
class ClientMix:
    """Which profile each request's client has: one profile, or shares of several.

    :param profiles: ``(profile, share)`` pairs, shares > 0 summing to 1.
    """

    profiles: tuple[tuple[ClientProfile, float], ...]

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError("a client mix needs at least one profile")
        shares = [s for _, s in self.profiles]
        if any(not s > 0 for s in shares) or not math.isclose(sum(shares), 1.0, abs_tol=1e-9):
            raise ValueError(f"client shares must be > 0 and sum to 1, got {shares}")

    @classmethod
    def parse(cls, text: str) -> ClientMix:
        """``sdk``, or ``interactive:0.3,sdk:0.7`` (shares normalised to 1).

        :param text: the mix.
        :raises ValueError: an unknown profile, a bad share.
        """
        pairs: list[tuple[ClientProfile, float]] = []
        for part in text.split(","):
            name, _, share = part.strip().partition(":")
            if name not in PROFILES:
                raise ValueError(f"unknown client profile {name!r}; profiles: "
                                 f"{', '.join(PROFILES)}")
            try:
                weight = float(share) if share else 1.0
            except ValueError:
                raise ValueError(f"bad share {share!r} in client mix {text!r}") from None
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"client shares must be > 0, got {share!r} in {text!r}")
            pairs.append((PROFILES[name], weight))
        if len({p.name for p, _ in pairs}) != len(pairs):
            raise ValueError(f"a profile named twice in client mix {text!r}")
        total = sum(w for _, w in pairs)
        return cls(tuple((p, w / total) for p, w in pairs))

    @property
    def name(self) -> str:
        """The mix as :meth:`parse` reads it (one profile: its name)."""
        if len(self.profiles) == 1:
            return self.profiles[0][0].name
        return ",".join(f"{p.name}:{s:g}" for p, s in self.profiles)

    @property
    def patient(self) -> bool:
        """Every client waits forever and never retries."""
        return all(not p.gives_up and p.max_retries == 0 for p, _ in self.profiles)


@dataclass(slots=True)
class _Original:
    """One user request and what became of it."""

    request: Request
    profile: ClientProfile
    retries: int = 0
    attempt_id: int = -1
    outcome: str = "open"  # open (waiting, served or unfinished), rejected, abandoned
    reason: str = ""
    end_s: float = math.nan


_GIVE_UP, _TIMEOUT = 0, 1


class ClientSession:
    """The clients of one run: who gives up when, who retries, and what each user got.

    :param mix: the clients' profiles.
    :param seed: seed of the profile draws and the retry jitter.
    :param first_retry_id: the id of the first retry (above every id of the workload).
    """

    def __init__(self, mix: ClientMix, seed: int, first_retry_id: int) -> None:
        self.mix = mix
        self.rng = np.random.default_rng(seed)
        self._cum = np.cumsum([s for _, s in mix.profiles])
        self._next_id = first_retry_id
        self.originals: dict[int, _Original] = {}
        self.attempt_of: dict[int, int] = {}
        """Attempt id -> its original's id (the original is its own first attempt)."""
        self._timers: list[tuple[float, int, int]] = []
        self._retries: list[tuple[float, int, Request]] = []
        self.aborted: list[AbortedRequest] = []
        """Every attempt an engine aborted because its client gave up."""
        self.cancelled_in_queue = 0
        """Attempts withdrawn from admission's queues because their client gave up."""

    # events

    def next_event_s(self) -> float:
        """The earliest pending give-up or retry; ``inf`` when none."""
        t = self._timers[0][0] if self._timers else math.inf
        if self._retries and self._retries[0][0] < t:
            t = self._retries[0][0]
        return t

    @property
    def retries_pending(self) -> bool:
        """Some retry has not arrived yet."""
        return bool(self._retries)

    def arrive(self, request: Request) -> None:
        """An attempt reaches the deployment: a new user request (its profile drawn) or a
        retry; its give-up timers start.

        :param request: the attempt.
        """
        rid = request.request_id
        original_id = self.attempt_of.get(rid)
        if original_id is None:
            profile = self._draw_profile()
            self.originals[rid] = _Original(request, profile)
            self.attempt_of[rid] = original_id = rid
        entry = self.originals[original_id]
        entry.attempt_id = rid
        profile = entry.profile
        if profile.first_token_patience_s is not None:
            heapq.heappush(self._timers, (entry.request.arrival_s
                                          + profile.first_token_patience_s, rid, _GIVE_UP))
        if profile.attempt_timeout_s is not None:
            heapq.heappush(self._timers, (request.arrival_s + profile.attempt_timeout_s, rid,
                                          _TIMEOUT))

    def due_timers(self, now_s: float) -> list[tuple[int, bool]]:
        """Give-ups due by ``now_s`` of attempts still current: ``(attempt id,
        before_first_token)`` each (a patience timer only cancels a request without a first
        token; a timeout cancels it wherever it is).

        :param now_s: the time.
        """
        out: list[tuple[int, bool]] = []
        timers = self._timers
        while timers and timers[0][0] <= now_s:
            _, rid, kind = heapq.heappop(timers)
            entry = self.originals[self.attempt_of[rid]]
            if entry.outcome == "open" and entry.attempt_id == rid:
                out.append((rid, kind == _GIVE_UP))
        return out

    def due_retries(self, now_s: float) -> list[Request]:
        """Retries whose delay ended by ``now_s``, in time order.

        :param now_s: the time.
        """
        out: list[Request] = []
        while self._retries and self._retries[0][0] <= now_s:
            out.append(heapq.heappop(self._retries)[2])
        return out

    def gave_up(self, attempt_id: int, timed_out: bool, now_s: float,
                aborted: AbortedRequest | None) -> None:
        """The client of ``attempt_id`` cancelled it (admission dropped it, or the engine
        aborted it: ``aborted``); a timeout may be retried.

        :param attempt_id: the attempt.
        :param timed_out: an attempt timeout (else first-token patience ran out).
        :param now_s: the time.
        :param aborted: the engine's record of the work spent, if it held the request.
        """
        if aborted is not None:
            self.aborted.append(aborted)
        else:
            self.cancelled_in_queue += 1
        entry = self.originals[self.attempt_of[attempt_id]]
        profile = entry.profile
        if timed_out and profile.retry_on_timeout and entry.retries < profile.max_retries:
            self._retry(entry, now_s + profile.retry_delay_s(entry.retries, None, self.rng))
            return
        entry.outcome, entry.reason, entry.end_s = "abandoned", "gave_up", now_s

    def refused(self, request: Request, outcome: Rejected, now_s: float) -> None:
        """Admission refused the attempt ``request``: the client retries or the user gets
        the refusal.

        :param request: the attempt.
        :param outcome: the refusal.
        :param now_s: when it was answered.
        """
        entry = self.originals[self.attempt_of[request.request_id]]
        profile = entry.profile
        if (entry.retries < profile.max_retries
                and profile.retries_status(outcome.status, outcome.retry_after_s,
                                           outcome.retry)):
            self._retry(entry, now_s + profile.retry_delay_s(entry.retries,
                                                             outcome.retry_after_s, self.rng))
            return
        entry.outcome, entry.reason, entry.end_s = "rejected", outcome.reason, now_s

    def _retry(self, entry: _Original, at_s: float) -> None:
        entry.retries += 1
        first = entry.request
        retry = Request(self._next_id, at_s, first.prompt_tokens, first.max_output_tokens,
                        first.prefix_ids, first.max_tokens)
        self.attempt_of[retry.request_id] = first.request_id
        entry.attempt_id = retry.request_id
        self._next_id += 1
        heapq.heappush(self._retries, (at_s, retry.request_id, retry))

    def _draw_profile(self) -> ClientProfile:
        profiles = self.mix.profiles
        if len(profiles) == 1:
            return profiles[0][0]
        i = int(np.searchsorted(self._cum, self.rng.random(), side="right"))
        return profiles[min(i, len(profiles) - 1)][0]

    # accounting

    def users_records(self, records: Sequence[FinishedRequest]) -> list[FinishedRequest]:
        """The run's records as the users saw them: one per user request that was served
        (its attempt's timings measured from the first attempt's arrival, under the first
        attempt's id) or finally refused; refusals that were retried and abandoned requests
        leave none.

        :param records: every attempt's record (served or refused).
        """
        out: list[FinishedRequest] = []
        for rec in records:
            original_id = self.attempt_of.get(rec.request_id, rec.request_id)
            entry = self.originals.get(original_id)
            if entry is None:
                out.append(rec)
                continue
            if rec.rejected:
                if entry.outcome == "rejected" and entry.attempt_id == rec.request_id:
                    out.append(_as_user(rec, entry.request, rec.finish_s))
                continue
            out.append(_as_user(rec, entry.request, rec.finish_s))
        return out


def _as_user(rec: FinishedRequest, first: Request, finish_s: float) -> FinishedRequest:
    delay = rec.arrival_s - first.arrival_s
    return FinishedRequest(
        request_id=first.request_id, bucket=rec.bucket, pool=rec.pool,
        arrival_s=first.arrival_s, prompt_tokens=rec.prompt_tokens,
        output_tokens=rec.output_tokens, ttft_s=rec.ttft_s + delay, tpot_s=rec.tpot_s,
        e2e_s=rec.e2e_s + delay, finish_s=finish_s, preemptions=rec.preemptions,
        truncated=rec.truncated, rejected=rec.rejected)
