"""Control actions, the Controller protocol and the built-in baseline controllers.

A controller is consulted once per control tick with the deployment's stats snapshot and
returns a ControlAction. Controllers living outside the core package (rule controllers and
PPO in ``policies/``) register through the ``rlbatch.controllers`` entry-point group, so the
core never imports them: ``make_controller("playbook")`` finds them by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Protocol, runtime_checkable

from rlbatch.buckets import Buckets
from rlbatch.engine.stats import EngineStats

ENTRY_POINT_GROUP = "rlbatch.controllers"


@dataclass(frozen=True)
class ControlAction:
    """What a controller sets at a control tick.

    :param caps: per bucket, the most requests of that bucket an engine may hold (running or
        waiting inside it); ``None`` = no admission control for that bucket (requests go
        straight to the engine's own FIFO queue, as with a plain vLLM server).
    :param pools: per bucket, the pool (``fp16`` / ``fp8``) its requests are routed to.
    :param max_num_seqs: engine-wide cap on running sequences (vLLM ``--max-num-seqs``;
        live: the scheduler's ``max_num_active_reqs``); ``None`` keeps the engine default.
    :param kv_budget_fraction: admit a request into an engine only while the KV its
        requests may need (prompt + max output, committed) stays within this fraction of the
        KV pool; an empty engine always takes its oldest request. ``None`` = no budget. Set by
        the guard's KV-budget rule.
    """

    caps: tuple[int | None, ...]
    pools: tuple[str, ...]
    max_num_seqs: int | None = None
    kv_budget_fraction: float | None = None

    def __post_init__(self) -> None:
        if len(self.caps) != len(self.pools):
            raise ValueError(f"caps ({len(self.caps)}) and pools ({len(self.pools)}) must have "
                             f"one entry per bucket")
        for cap in self.caps:
            if cap is not None and cap < 1:
                raise ValueError(f"bucket caps must be >= 1 or None, got {self.caps}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")
        if self.kv_budget_fraction is not None and not 0 < self.kv_budget_fraction <= 1:
            raise ValueError(f"kv_budget_fraction must be in (0, 1] or None, got "
                             f"{self.kv_budget_fraction}")


@dataclass(frozen=True)
class SLA:
    """Per-request service-level objective (DistServe-style goodput counts requests meeting
    both).

    :param ttft_s: time-to-first-token limit.
    :param tpot_s: time-per-output-token limit.
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLA limits must be > 0, got ttft_s={self.ttft_s}, "
                             f"tpot_s={self.tpot_s}")


@dataclass(frozen=True)
class DeploymentInfo:
    """What a controller knows about the deployment it controls.

    :param buckets: the prompt-length buckets.
    :param pools: the pools present, each with its number of engines.
    :param gpu: GPU profile name.
    :param model: model profile name.
    :param default_max_num_seqs: the engines' configured ``max_num_seqs``.
    :param max_num_batched_tokens: the engines' token budget per iteration.
    :param num_kv_blocks: KV blocks per engine, by pool.
    :param block_size: tokens per KV block.
    :param max_model_len: longest sequence an engine accepts.
    :param tick_s: control interval.
    :param sla: the SLA in force.
    :param cold_start: the engines have just started (cold caches, graphs still compiling):
        the guard's warm-up ramp applies. Simulated engines are warm from t=0 and a trace
        slice starts mid-service, so simulated runs say ``False`` unless asked otherwise.
    """

    buckets: Buckets
    pools: dict[str, int]
    gpu: str
    model: str
    default_max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: dict[str, int]
    block_size: int
    max_model_len: int
    tick_s: float
    sla: SLA
    cold_start: bool = False

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(self.pools)


@dataclass(frozen=True)
class WindowStats:
    """Latency percentiles over the sliding window ending at the tick (NaN when empty).

    :param window_s: window length.
    :param ttft_p99_s: per bucket.
    :param tpot_p99_s: per bucket.
    :param ttft_p99_all_s: all buckets together.
    :param tpot_p99_all_s: all buckets together.
    :param e2e_p99_all_s: all buckets together.
    :param completed: per bucket, completions in the window.
    :param sla_met: per bucket, completions in the window that met the SLA.
    """

    window_s: float
    ttft_p99_s: tuple[float, ...]
    tpot_p99_s: tuple[float, ...]
    ttft_p99_all_s: float
    tpot_p99_all_s: float
    e2e_p99_all_s: float
    completed: tuple[int, ...]
    sla_met: tuple[int, ...]


@dataclass(frozen=True)
class DeploymentStats:
    """One control tick's snapshot of the whole deployment.

    :param time_s: tick time.
    :param tick_s: interval length.
    :param engines: one EngineStats per engine.
    :param queued: per bucket, requests waiting in rlbatch's admission queues.
    :param arrived: per bucket, arrivals during the tick.
    :param rejected: per bucket, requests refused during the tick.
    :param window: sliding-window latency percentiles.
    :param action: the action in force during the tick.
    :param kv_budget_blocked: the KV budget held a request back during the tick.
    :param oldest_wait_s: per bucket, how long the head of its admission queue has waited
        (0 when empty).
    """

    time_s: float
    tick_s: float
    engines: tuple[EngineStats, ...]
    queued: tuple[int, ...]
    arrived: tuple[int, ...]
    rejected: tuple[int, ...]
    window: WindowStats
    action: ControlAction
    kv_budget_blocked: bool = False
    oldest_wait_s: tuple[float, ...] = ()


@runtime_checkable
class Controller(Protocol):
    """Chooses a ControlAction every control tick."""

    name: str

    def reset(self, info: DeploymentInfo) -> ControlAction:
        """Start of a run: the action in force until the first tick."""
        ...

    def decide(self, stats: DeploymentStats) -> ControlAction:
        """The action for the next tick, given the tick that just ended."""
        ...


class StaticController:
    """``static:N``: a fixed batch size, vLLM's ``--max-num-seqs N`` and nothing else.

    :param max_num_seqs: the batch size N.
    """

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"static batch size must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.name = f"static:{max_num_seqs}"
        self._action: ControlAction | None = None

    def reset(self, info: DeploymentInfo) -> ControlAction:
        first_pool = info.pool_names[0]
        n = len(info.buckets)
        self._action = ControlAction((None,) * n, (first_pool,) * n, self.max_num_seqs)
        return self._action

    def decide(self, stats: DeploymentStats) -> ControlAction:
        assert self._action is not None, "decide() before reset()"
        return self._action


class VllmDefaultController:
    """``vllm-default``: no admission control, vLLM's own default budgets."""

    name = "vllm-default"

    def __init__(self) -> None:
        self._action: ControlAction | None = None

    def reset(self, info: DeploymentInfo) -> ControlAction:
        first_pool = info.pool_names[0]
        n = len(info.buckets)
        self._action = ControlAction((None,) * n, (first_pool,) * n, None)
        return self._action

    def decide(self, stats: DeploymentStats) -> ControlAction:
        assert self._action is not None, "decide() before reset()"
        return self._action


ControllerFactory = Callable[[str], Controller]


def _static_factory(arg: str) -> Controller:
    try:
        n = int(arg)
    except ValueError:
        raise ValueError(f"static controller needs an integer batch size, e.g. static:16; "
                         f"got static:{arg}") from None
    return StaticController(n)


def _vllm_default_factory(arg: str) -> Controller:
    if arg:
        raise ValueError(f"vllm-default takes no argument, got vllm-default:{arg}")
    return VllmDefaultController()


BUILTIN_CONTROLLERS: dict[str, ControllerFactory] = {
    "static": _static_factory,
    "vllm-default": _vllm_default_factory,
}


def available_controllers() -> dict[str, ControllerFactory]:
    """Built-in controllers plus those registered in the ``rlbatch.controllers`` entry-point
    group (loaded lazily on first use)."""
    found: dict[str, ControllerFactory] = dict(BUILTIN_CONTROLLERS)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = _lazy_factory(ep)
    return found


def _lazy_factory(ep: metadata.EntryPoint) -> ControllerFactory:
    def factory(arg: str) -> Controller:
        loaded: ControllerFactory = ep.load()
        return loaded(arg)

    return factory


def make_controller(spec: str) -> Controller:
    """Build a controller from its command-line name: ``static:16``, ``vllm-default``, or any
    name registered by a plugin (``playbook``, ``ppo:PATH``, ...)."""
    name, _, arg = spec.strip().partition(":")
    factories = available_controllers()
    if name not in factories:
        raise ValueError(f"unknown controller {spec!r}; available: "
                         f"{', '.join(sorted(factories))} (static takes :N, e.g. static:16)")
    return factories[name](arg)


def controller_specs(text: str) -> list[str]:
    """Split a comma-separated controller list; ``static:{4,8,16}`` expands to three."""
    specs: list[str] = []
    for part in _split_top_level(text):
        if "{" in part and part.endswith("}"):
            head, _, inner = part.partition("{")
            specs.extend(head + x.strip() for x in inner[:-1].split(",") if x.strip())
        elif part:
            specs.append(part)
    if not specs:
        raise ValueError(f"no controller in {text!r}")
    return specs


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]
