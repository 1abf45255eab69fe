"""The Controller base class, the built-in baseline controllers and the controller registry.

A controller is built from its spec (:mod:`rlbatch.control.specs`: a preset, typed settings
in brackets, or a settings file).

Controllers living outside the core package (rule controllers and PPO in ``policies/``)
register through the ``rlbatch.controllers`` entry-point group, so the core never imports
them: ``make_controller("playbook")`` finds them by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, ClassVar

from rlbatch.control.discipline import PLAIN, AdmissionDiscipline
from rlbatch.control.pipeline import DecisionPipeline
from rlbatch.control.specs import controller_specs, parse_spec
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats, balanced_route
from rlbatch.settings import SettingsError

ENTRY_POINT_GROUP = "rlbatch.controllers"

__all__ = ["BUILTIN_CONTROLLERS", "Controller", "ControllerFactory", "StaticController",
           "VllmDefaultController", "available_controllers", "controller_specs",
           "make_controller"]

NO_GUARD_FLAGS: tuple[float, ...] = (0.0,) * 5
"""The guard's activity flags of a controller without a guard (no rule ever fires)."""


class Controller(ABC):
    """Chooses a ControlAction every control tick.

    Two methods are required (:meth:`reset`, :meth:`decide`); everything else is an optional
    hook with a default that every caller may rely on:

    * :attr:`discipline`: admission's queue order and KV budget for the run (default: FIFO,
      no budget, a plain vLLM server);
    * :attr:`pipeline`: the :class:`~rlbatch.control.pipeline.DecisionPipeline` (release and
      guard) the controller's proposals go through, ``None`` for an unguarded one; its guard
      gives :attr:`guard_overrides_total` and :meth:`guard_flags`;
    * :meth:`bind`: take the run's digital twin (a simulated deployment's exact fork) before
      :meth:`reset`, for controllers that plan with one (``mpc``);
    * :meth:`row_extras`: fields the controller adds to its evaluation row;
    * :attr:`last_proposal`: the action it proposed at its last decision, before its
      pipeline, kept by a controller whose :attr:`reports_proposals` is true (a teacher of
      the learned policy must be one).
    """

    name: str
    reports_proposals: ClassVar[bool] = False
    last_proposal: ControlAction | None = None

    @abstractmethod
    def reset(self, info: DeploymentInfo) -> ControlAction:
        """Start of a run: the action in force until the first tick."""

    @abstractmethod
    def decide(self, stats: DeploymentStats) -> ControlAction:
        """The action for the next tick, given the tick that just ended."""

    @property
    def discipline(self) -> AdmissionDiscipline:
        """Admission's discipline while this controller is in charge."""
        pipeline = self.pipeline
        return PLAIN if pipeline is None else pipeline.discipline

    @property
    def pipeline(self) -> DecisionPipeline | None:
        """The decision pipeline behind the controller (``None``: unguarded)."""
        return None

    @property
    def guard_overrides_total(self) -> int:
        """Overrides the guard made so far in this run (0 without a guard)."""
        pipeline = self.pipeline
        return 0 if pipeline is None else pipeline.guard.overrides_total

    def guard_flags(self) -> tuple[float, ...]:
        """The guard's rule activity for the observation (:meth:`Guard.flags
        <rlbatch.control.guard.Guard.flags>`; all 0 without a guard)."""
        pipeline = self.pipeline
        return NO_GUARD_FLAGS if pipeline is None else pipeline.guard.flags()

    def bind(self, twin: Any) -> bool:
        """Take the run's digital twin (:class:`rlbatch.serving.twin.Twin`); returns whether
        the controller plans with it (default: it does not)."""
        return False

    def row_extras(self) -> dict[str, Any]:
        """Fields added to the controller's evaluation row (default: none)."""
        return {}


class StaticController(Controller):
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
        n = len(info.buckets)
        self._action = ControlAction((None,) * n, (balanced_route(info.pool_names),) * n,
                                     self.max_num_seqs)
        return self._action

    def decide(self, stats: DeploymentStats) -> ControlAction:
        assert self._action is not None, "decide() before reset()"
        return self._action


class VllmDefaultController(Controller):
    """``vllm-default``: no admission control, vLLM's own default budgets."""

    name = "vllm-default"

    def __init__(self) -> None:
        self._action: ControlAction | None = None

    def reset(self, info: DeploymentInfo) -> ControlAction:
        n = len(info.buckets)
        self._action = ControlAction((None,) * n, (balanced_route(info.pool_names),) * n, None)
        return self._action

    def decide(self, stats: DeploymentStats) -> ControlAction:
        assert self._action is not None, "decide() before reset()"
        return self._action


ControllerFactory = Callable[[str, Mapping[str, Any]], Controller]
"""Builds a controller from the argument of its preset (``16`` of ``static:16``) and its
settings (a nested mapping of :mod:`rlbatch.settings` values, empty for the preset's own)."""


def _no_settings(name: str, settings: Mapping[str, Any]) -> None:
    if settings:
        raise SettingsError(f"{name} takes no settings, got {', '.join(settings)}")


def _static_factory(arg: str, settings: Mapping[str, Any]) -> Controller:
    _no_settings("static:N", settings)
    try:
        n = int(arg)
    except ValueError:
        raise ValueError(f"static controller needs an integer batch size, e.g. static:16; "
                         f"got static:{arg}") from None
    return StaticController(n)


def _vllm_default_factory(arg: str, settings: Mapping[str, Any]) -> Controller:
    _no_settings("vllm-default", settings)
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
    def factory(arg: str, settings: Mapping[str, Any]) -> Controller:
        loaded: ControllerFactory = ep.load()
        return loaded(arg, settings)

    return factory


def make_controller(spec: str) -> Controller:
    """Build a controller from its spec (:mod:`rlbatch.control.specs`): a preset
    (``static:16``, ``vllm-default``, or a plugin's: ``playbook``, ``fixed:64``, ``mpc``,
    ``ppo:PATH``), the same with settings (``fixed:256[order=deadline]``), or a settings
    file (``my-controller.toml``).

    :param spec: the spec.
    :raises ValueError: an unknown controller, a bad argument or a bad setting (a
        :class:`~rlbatch.settings.SettingsError` naming the key).
    """
    parsed = parse_spec(spec)
    name, _, arg = parsed.preset.partition(":")
    factory = BUILTIN_CONTROLLERS.get(name)
    if factory is None:  # built-ins win over plugins: no entry-point scan (milliseconds)
        factories = available_controllers()
        if name not in factories:
            raise ValueError(f"unknown controller {spec!r}; available: "
                             f"{', '.join(sorted(factories))} (static takes :N, e.g. "
                             f"static:16)")
        factory = factories[name]
    try:
        controller = factory(arg, parsed.settings)
    except SettingsError as exc:
        raise SettingsError(f"{parsed.preset}: {exc}") from None
    if not isinstance(controller, Controller):
        raise TypeError(f"controller {name!r} built a {type(controller).__name__}, not a "
                        f"rlbatch.control.controllers.Controller (subclass it: its optional "
                        f"hooks have defaults)")
    controller.name = parsed.name
    return controller
