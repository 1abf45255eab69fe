"""The sidecar's production bounds as command-line options (``serve.py``'s "limits" and
"replica health" groups).

Each option is derived from the :class:`~rlbatch.sidecar.settings.SidecarSettings` field of the same
name (:func:`rlbatch.settings.add_flags`: its type, default and docstring); every limit that trips
is counted in ``rlbatch_limit_trips_total{limit}`` (docs/sidecar.md, "Limits").
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlbatch.settings import add_flags
from rlbatch.sidecar.policy_files import check_policy_path, policy_path_of
from rlbatch.sidecar.settings import SidecarSettings, UpstreamSpec

LIMITS: tuple[str, ...] = (
    "first_byte_timeout_s", "idle_timeout_s", "header_timeout_s", "body_timeout_s",
    "keepalive_timeout_s", "tokenize_timeout_s", "tokenize_breaker_failures",
    "tokenize_breaker_s", "max_body_bytes", "max_held_bytes", "max_header_bytes",
    "max_event_bytes", "max_sequences", "max_policy_bytes", "max_connections",
    "max_chars_per_token", "metrics_port")
"""The settings of the "limits" group, each a flag derived from its field."""

REPLICA_HEALTH: tuple[str, ...] = ("eject_after_failures", "eject_s")
"""The settings of the "replica health" group (passive ejection; the active check is each
tick's ``/health``, bounded by ``--scrape-timeout-s``)."""


def add_production_options(parser: argparse.ArgumentParser) -> None:
    """Add the "limits" option group: one flag per field of :data:`LIMITS` (its type, default
    and docstring from :class:`SidecarSettings`), and ``--policy-dir``; and the "replica
    health" group of :data:`REPLICA_HEALTH`.

    :param parser: the ``serve`` parser.
    """
    d = SidecarSettings(upstreams=(UpstreamSpec("fp16", "http://127.0.0.1:8000"),))
    group = parser.add_argument_group("limits (each trip counted in "
                                      "rlbatch_limit_trips_total)")
    add_flags(group, SidecarSettings, only=LIMITS, defaults=d)
    group.add_argument("--policy-dir", dest="policy_dirs", type=Path, action="append",
                       default=[], metavar="DIR",
                       help="a folder POST /admin/controller may load ppo:PATH policies "
                            "from (repeat for more; default: none, switching to a policy "
                            "file is off)")
    health = parser.add_argument_group("replica health (ejections counted in "
                                       "rlbatch_upstream_ejections_total)")
    add_flags(health, SidecarSettings, only=REPLICA_HEALTH, defaults=d)


def production_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`SidecarSettings` fields the "limits" and "replica health" options set.

    :param args: parsed options.
    """
    fields: dict[str, Any] = {name: getattr(args, name) for name in LIMITS + REPLICA_HEALTH}
    fields["policy_dirs"] = tuple(p.resolve() for p in args.policy_dirs)
    return fields


def check_start_policy(spec: str, settings: SidecarSettings) -> None:
    """Refuse a ``ppo:PATH`` start controller whose files are not regular or too large,
    before anything reads them (``--policy /dev/zero`` would read until memory runs out).
    The operator's own ``--policy`` is not confined to ``policy_dirs``.

    Only a path that exists here is checked: any other ``PATH`` is the controller factory's
    to resolve (``ppo:default`` names a policy shipped with the package, data installed with
    it rather than a path the operator chose) or to report missing, so this check accepts
    whatever the factory accepts.

    :param spec: the controller name.
    :param settings: the sidecar's settings.
    :raises PolicyPathError: refused (a ``ValueError``).
    """
    path = policy_path_of(spec)
    if path is not None and Path(path).exists():
        check_policy_path(Path(path), settings.max_policy_bytes)
