"""Typed, validated settings of the admission-control sidecar.

Everything the sidecar needs to know is here, validated when the object is built (bad values
raise ``ValueError`` naming them), so a misconfigured sidecar refuses to start instead of
failing on its first request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from rlbatch.buckets import Buckets
from rlbatch.control.types import SLA
from rlbatch.engine.reserve import check_kv_reserve
from rlbatch.serving.admission import AdmissionConfig

POOL_ORDER: tuple[str, ...] = ("fp16", "fp8")
"""Known pools in their canonical order (the order a policy artifact lists them in)."""

OverLength = Literal["vllm", "truncate", "reject"]
TOKENIZER_MODES: tuple[str, ...] = ("auto", "upstream", "approx")


@dataclass(frozen=True)
class UpstreamSpec:
    """One vLLM OpenAI server behind the sidecar.

    :param pool: the pool its precision puts it in (``fp16`` or ``fp8``).
    :param url: base URL, e.g. ``http://127.0.0.1:8000`` (no path).
    """

    pool: str
    url: str

    def __post_init__(self) -> None:
        if self.pool not in POOL_ORDER:
            raise ValueError(f"upstream pool must be one of {POOL_ORDER}, got {self.pool!r} "
                             f"(for {self.url})")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in (
                "", "/") or parts.query or parts.fragment:
            raise ValueError(f"upstream URL must look like http://HOST:PORT (no path), got "
                             f"{self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @classmethod
    def parse(cls, text: str) -> UpstreamSpec:
        """Parse ``POOL=URL`` (the ``--upstream`` syntax), e.g. ``fp16=http://127.0.0.1:8000``.

        :param text: the option value.
        """
        pool, sep, url = text.partition("=")
        if not sep or not pool.strip() or not url.strip():
            raise ValueError(f"--upstream takes POOL=URL, e.g. fp16=http://127.0.0.1:8000; got "
                             f"{text!r}")
        return cls(pool.strip(), url.strip())


@dataclass(frozen=True)
class SidecarSettings:
    """How the sidecar listens, admits, forwards and controls.

    :param upstreams: the vLLM servers, one or more per pool.
    :param host: address to bind (loopback unless told otherwise).
    :param port: port to bind.
    :param metrics_port: a second port for ``/metrics`` and ``/admin/*`` (and ``/health``,
        ``/ready``); ``None``: they are served on ``port``.
    :param buckets: prompt-length buckets (must match a policy artifact's).
    :param tick_s: control interval: scrape, decide, apply.
    :param window_s: sliding window of the latency percentiles the controller sees.
    :param sla: the SLA in force (goodput, guard P99 rule).
    :param max_queue_len: per-bucket admission queue bound; a request arriving at a full queue
        is answered 429 with ``Retry-After``.
    :param queue_timeout_s: the queue TTL (admission's ``queue_ttl_s``): a request that has
        waited this long since it arrived without being forwarded, in its admission queue or
        held at an upstream by an engine-wide cap, is answered 503 with ``Retry-After``.
    :param reject_ttft_slack: refuse an arrival (429 with ``Retry-After``) when its predicted
        TTFT (the requests waiting ahead of it over the rate requests complete) exceeds the
        SLA's TTFT times this; ``None``: never.
    :param max_num_queued_tokens: refuse an arrival (429 with ``Retry-After``) while the
        prompt tokens of the requests in the admission queues reach this bound (vLLM's
        ``--max-num-queued-tokens``); ``None``: no bound.
    :param drain_window_s: the window over which the rate requests complete, which the
        predicted TTFT divides by, is measured.
    :param max_retry_after_s: the longest ``Retry-After`` an overload refusal gives (the
        predicted drain time otherwise; admission's ``max_retry_after_s``); ``None``: no cap.
    :param retry_overload: overload refusals (predicted TTFT, queued tokens, queue TTL)
        invite a retry; off, they carry ``x-should-retry: false``, which the ``openai``
        client obeys (admission's ``retry_overload``).
    :param retry_after_s: the ``Retry-After`` value (seconds) of a refusal without a
        predicted drain time (a 429 or 503 whose wait cannot be predicted yet).
    :param tokenizer: how prompt length is counted: ``auto`` (a local tokenizer when the
        upstream's model folder is readable here, else ``upstream``), ``upstream`` (the
        upstream's ``/tokenize``), ``approx`` (UTF-8 bytes / ``approx_bytes_per_token``), or a
        path to a ``tokenizer.json`` / model folder.
    :param approx_bytes_per_token: divisor of the ``approx`` counter.
    :param tokenizer_thread_chars: prompts longer than this are tokenised in a worker thread
        so the event loop is never blocked for long.
    :param max_model_len: longest prompt + output admitted; ``None`` = the upstreams'
        ``max_model_len`` (or the controller guard's ``max_seq_len`` when it sets one).
    :param over_length: prompt + output over ``max_model_len``: ``vllm`` (vLLM's own rule:
        the output is shortened to fit, a prompt alone too long is refused with vLLM's 400;
        the body goes upstream untouched), ``truncate`` (keep the prompt's last tokens, vLLM
        ``truncate_prompt_tokens``, and the output asked for) or ``reject`` (400 whenever the
        sum does not fit); ``None`` = ``vllm``.
    :param kv_reserve: how the KV budget counts a forwarded request: ``observed`` (prompt + a
        high quantile of the completions its bucket recently got from that upstream, at most
        its ``max_tokens``) or ``declared`` (prompt + its ``max_tokens``, or the rest of the
        context when it sends none). The proxy sees no tokens while they are generated, so
        the observed count does not grow as a request runs (the engines' does); vLLM's KV
        usage, which the ``kv_high`` rule reads, covers what it misses.
    :param kv_reserve_quantile: output quantile ``observed`` reserves.
    :param shadow: decide and log every tick but never act: no caps, every request to
        ``shadow_pool`` (default: off).
    :param shadow_pool: pool every request goes to in shadow mode (default: the first pool).
    :param logdir: TensorBoard log directory for the decisions (``None``: none written).
    :param cold_start: the upstreams have just started: the guard's warm-up ramp applies
        (default: on; ``--no-cold-start`` for upstreams already warm).
    :param max_num_seqs: the upstreams' ``--max-num-seqs`` (vLLM does not export it).
    :param max_num_batched_tokens: the upstreams' ``--max-num-batched-tokens``.
    :param gpu: GPU profile name (or profile file) reported to the controller, from which
        the upstreams' capacity is estimated; ``unknown``: none (give ``capacity_rps``).
    :param model: model profile name (or profile file), as ``gpu``.
    :param capacity_rps: reference requests per second all upstreams together serve
        (:mod:`rlbatch.profiles.capacity`); ``None``: estimated from ``gpu`` and ``model``
        when both name profiles, else unknown (a policy with observation version 3 then
        refuses to start).
    :param scrape_timeout_s: time limit of one ``/metrics`` scrape, and of one ``/health``
        check (each tick; an upstream whose ``/health`` does not answer 200 gets no new
        requests until it does).
    :param connect_timeout_s: time limit to connect to an upstream.
    :param first_byte_timeout_s: longest wait, after a request was sent upstream, for the
        first byte of its answer's body (a stream's first event; a non-streamed answer, which
        vLLM sends when generation is done); answered 504 when it trips.
    :param idle_timeout_s: longest gap between two events of an upstream stream passed on
        (bytes that do not end an event do not count), and between two chunks of an answer's
        body; a stream that stalls longer ends with an error event.
    :param max_event_bytes: largest event of an upstream stream held while its end is awaited
        (vLLM sends each whole); a stream with a longer one ends with an error event.
    :param eject_after_failures: consecutive failed requests on one upstream (unreachable,
        connection dropped, 5xx, timeout, a body that is not the answer asked for) after which
        it is ejected: no new requests for ``eject_s``, and the requests waiting for it move
        to another replica. The last available replica of a pool is never ejected. After
        ``eject_s`` it gets requests again; one more failure before a success ejects it
        again.
    :param eject_s: how long an ejected upstream gets no requests.
    :param request_timeout_s: a hard total limit of one upstream request (``None``: none;
        prefer the two above, which never cut a healthy long stream).
    :param max_body_bytes: largest request body accepted (413 above it).
    :param max_held_bytes: budget of request-body bytes held by the requests inside the
        sidecar (from reading the body to the answer's end), counted as the bytes arrive (not
        as a ``Content-Length`` announces them, so slow uploads hold only what they sent); a
        request whose body would pass it is answered 429 with ``Retry-After`` and its
        connection closed.
    :param max_header_bytes: largest request head (request line and headers together); a
        longer one is answered 431 and its connection closed (vLLM sets no bound; bearer
        tokens of auth gateways run to several KB).
    :param header_timeout_s: a client connection must deliver a complete request head within
        this long of its first byte (slow-header connections are closed).
    :param body_timeout_s: longest time to receive a request's body (408 when it trips).
    :param keepalive_timeout_s: idle time after which a client keep-alive connection (or one
        that never sent a request) is closed; once a request's head starts arriving,
        ``header_timeout_s`` applies instead.
    :param max_connections: most client connections held at once; a new one beyond it
        closes the longest-idle connection (no request in progress), or is closed itself when
        every connection is busy. ``None``: the process' file-descriptor limit minus the
        upstream connections and a reserve.
    :param tokenize_timeout_s: time limit of one upstream ``/tokenize`` call; when it trips
        (or the call fails) the prompt is counted approximately (logged and counted).
    :param tokenize_breaker_failures: consecutive ``/tokenize`` failures after which prompts
        are counted approximately without calling it for ``tokenize_breaker_s`` (then one
        call tries it again), so a hung ``/tokenize`` does not add its time limit to every
        request.
    :param tokenize_breaker_s: how long ``/tokenize`` is not called once the breaker opened.
    :param max_chars_per_token: the most characters one token of the model's vocabulary
        spans (an upper bound); a prompt with more than ``max_model_len`` times this many
        characters is over-length without tokenising it (vLLM's own check), and counting
        stops reading a prompt there. ``None``: the local tokenizer's longest token, or 64.
    :param max_sequences: most sequences one request may ask for (``n`` (or ``best_of``)
        times the number of prompts); each request counts as one slot of its bucket's cap.
    :param admin_token: bearer token for ``/admin/*``; without one the admin endpoints are
        off (403), on any bind.
    :param policy_dirs: folders ``POST /admin/controller`` may load ``ppo:PATH`` policies from
        (the resolved path must lie under one); empty: policy switches by path are off.
    :param max_policy_bytes: largest policy file read (``policy.json``, ``policy.safetensors``).
    :param gpu_telemetry: read GPU memory with NVML when the sidecar sees the GPU (default:
        on; ``--no-gpu-telemetry`` turns it off).
    """

    upstreams: tuple[UpstreamSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    metrics_port: int | None = None
    buckets: Buckets = field(default_factory=Buckets)
    tick_s: float = 1.0
    window_s: float = 30.0
    sla: SLA = field(default_factory=SLA)
    max_queue_len: int = 256
    queue_timeout_s: float = 300.0
    reject_ttft_slack: float | None = None
    max_num_queued_tokens: int | None = None
    drain_window_s: float = 30.0
    max_retry_after_s: float | None = None
    retry_overload: bool = True
    retry_after_s: int = 1
    tokenizer: str = "auto"
    approx_bytes_per_token: float = 4.0
    tokenizer_thread_chars: int = 2048
    max_model_len: int | None = None
    over_length: OverLength | None = None
    kv_reserve: Literal["observed", "declared"] = "observed"
    kv_reserve_quantile: float = 0.9
    shadow: bool = False
    shadow_pool: str | None = None
    logdir: Path | None = None
    cold_start: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu: str = "unknown"
    model: str = "unknown"
    capacity_rps: float | None = None
    scrape_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 60.0
    max_event_bytes: int = 16 * 2**20
    eject_after_failures: int = 3
    eject_s: float = 30.0
    request_timeout_s: float | None = None
    max_body_bytes: int = 16 * 2**20
    max_held_bytes: int = 64 * 2**20
    max_header_bytes: int = 64 * 2**10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    max_connections: int | None = None
    tokenize_timeout_s: float = 5.0
    tokenize_breaker_failures: int = 3
    tokenize_breaker_s: float = 30.0
    max_chars_per_token: int | None = None
    max_sequences: int = 16
    admin_token: str | None = None
    policy_dirs: tuple[Path, ...] = ()
    max_policy_bytes: int = 64 * 2**20
    gpu_telemetry: bool = True

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one --upstream POOL=URL is required")
        urls = [u.url for u in self.upstreams]
        dupes = sorted({u for u in urls if urls.count(u) > 1})
        if dupes:
            raise ValueError(f"upstream URLs must be distinct, repeated: {dupes}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.metrics_port is not None and (
                not 0 < self.metrics_port < 65536 or self.metrics_port == self.port):
            raise ValueError(f"metrics_port must be in 1..65535 and differ from port "
                             f"{self.port}, got {self.metrics_port}")
        if not self.host:
            raise ValueError("host must not be empty")
        for name in ("tick_s", "window_s", "queue_timeout_s", "approx_bytes_per_token",
                     "scrape_timeout_s", "connect_timeout_s", "first_byte_timeout_s",
                     "idle_timeout_s", "header_timeout_s", "body_timeout_s",
                     "keepalive_timeout_s", "tokenize_timeout_s", "eject_s",
                     "tokenize_breaker_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self._check_overload()
        if self.capacity_rps is not None and not 0 < self.capacity_rps < float("inf"):
            raise ValueError(f"capacity_rps must be > 0 and finite or None, got "
                             f"{self.capacity_rps}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got "
                             f"{self.request_timeout_s}")
        for name in ("max_queue_len", "max_num_seqs", "max_num_batched_tokens",
                     "tokenizer_thread_chars", "max_body_bytes", "max_held_bytes",
                     "max_sequences", "max_policy_bytes", "max_header_bytes",
                     "max_event_bytes", "eject_after_failures", "tokenize_breaker_failures"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_held_bytes < self.max_body_bytes:
            raise ValueError(f"max_held_bytes ({self.max_held_bytes}) must be >= "
                             f"max_body_bytes ({self.max_body_bytes}): else a request at the "
                             f"body cap could never be admitted")
        for name in ("max_connections", "max_chars_per_token"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError(f"admin_token must be at least 16 characters, got "
                             f"{len(self.admin_token)}")
        object.__setattr__(self, "policy_dirs", tuple(Path(p) for p in self.policy_dirs))
        for folder in self.policy_dirs:
            if not folder.is_absolute():
                raise ValueError(f"policy_dirs must be absolute paths, got {str(folder)!r}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.over_length not in (None, "vllm", "truncate", "reject"):
            raise ValueError(f"over_length must be 'vllm', 'truncate' or 'reject', got "
                             f"{self.over_length!r}")
        # no oracle here: a proxy never knows an answer's length before it is generated
        check_kv_reserve(self.kv_reserve, self.kv_reserve_quantile, ("observed", "declared"))
        if self.tokenizer not in TOKENIZER_MODES and not Path(self.tokenizer).exists():
            raise ValueError(f"tokenizer must be one of {TOKENIZER_MODES} or an existing "
                             f"tokenizer.json / model folder, got {self.tokenizer!r}")
        check_profiles(self.gpu, self.model)
        if self.shadow_pool is not None and self.shadow_pool not in self.pools:
            raise ValueError(f"shadow_pool {self.shadow_pool!r} is not among the upstream pools "
                             f"{list(self.pools)}")

    def _check_overload(self) -> None:
        """The queue TTL (required here) and the rules that refuse at arrival, which
        admission validates (:meth:`admission_config`)."""
        if not (self.queue_timeout_s > 0 and math.isfinite(self.queue_timeout_s)):
            raise ValueError(f"queue_timeout_s must be > 0 and finite, got "
                             f"{self.queue_timeout_s}")
        slack = self.reject_ttft_slack
        if slack is not None and not math.isfinite(self.sla.ttft_s):
            raise ValueError(f"reject_ttft_slack ({slack}) needs a finite SLA TTFT "
                             f"(--sla-ttft-s), got {self.sla.ttft_s}")
        self.admission_config()

    def admission_config(self) -> AdmissionConfig:
        """Admission's settings: the over-length rule (vLLM's own is admission's
        ``reject``), the queue bound and the overload rules (the queue timeout is the queue
        TTL).

        :raises ValueError: a value admission refuses.
        """
        return AdmissionConfig(
            "truncate" if self.over_length == "truncate" else "reject", self.max_queue_len,
            queue_ttl_s=self.queue_timeout_s, reject_ttft_slack=self.reject_ttft_slack,
            max_num_queued_tokens=self.max_num_queued_tokens,
            drain_window_s=self.drain_window_s, max_retry_after_s=self.max_retry_after_s,
            retry_overload=self.retry_overload)

    @property
    def pools(self) -> tuple[str, ...]:
        """Pools present, in canonical order (``fp16`` before ``fp8``)."""
        present = {u.pool for u in self.upstreams}
        return tuple(p for p in POOL_ORDER if p in present)

    @property
    def pool_sizes(self) -> dict[str, int]:
        """Upstreams per pool, in canonical pool order."""
        return {p: sum(1 for u in self.upstreams if u.pool == p) for p in self.pools}

    @property
    def effective_shadow_pool(self) -> str:
        return self.shadow_pool or self.pools[0]

    @property
    def binds_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "::1", "localhost")


def check_profiles(gpu: str, model: str) -> None:
    """Refuse a ``gpu`` / ``model`` that is neither ``unknown`` (the default: no profile, the
    capacity comes from ``capacity_rps``) nor a profile name or file, as the other commands
    do: a typo would otherwise leave the capacity estimate at 0.

    :raises ValueError: naming the valid profiles.
    """
    from rlbatch.profiles.specs import load_gpu, load_model

    for kind, value, load in (("gpu", gpu, load_gpu), ("model", model, load_model)):
        if value != "unknown":
            try:
                load(value)
            except (ValueError, OSError) as exc:
                raise ValueError(f"{kind}: {exc}") from None
