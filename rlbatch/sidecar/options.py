"""The sidecar's production bounds as command-line options (``serve.py``'s "limits" group).

Each option sets the :class:`~rlbatch.sidecar.settings.SidecarSettings` field of the same
name, with the field's default; every limit that trips is counted in
``rlbatch:limit_trips_total{limit}`` (docs/sidecar.md, "Limits").
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlbatch.sidecar.policy_files import check_policy_dir, policy_path_of
from rlbatch.sidecar.settings import SidecarSettings, UpstreamSpec

_FLOATS: tuple[tuple[str, str], ...] = (
    ("first_byte_timeout_s", "longest wait for the first byte of an upstream answer (a "
     "stream's first chunk; a whole non-streamed answer); 504 when it trips"),
    ("idle_timeout_s", "longest gap between two chunks of an upstream stream; the stream "
     "ends with an error event when it trips (healthy long streams are never cut)"),
    ("header_timeout_s", "a client must send a complete request head within this long of "
     "its first byte, else its connection is closed"),
    ("body_timeout_s", "longest time to receive a request body (408)"),
    ("keepalive_timeout_s", "idle client keep-alive connections are closed after this long "
     "(vLLM/uvicorn: 5 s)"),
    ("tokenize_timeout_s", "time limit of one upstream /tokenize call; the prompt is then "
     "counted approximately (logged, counted)"),
)
_INTS: tuple[tuple[str, str], ...] = (
    ("max_body_bytes", "largest request body (413 above it)"),
    ("max_held_bytes", "budget of request-body bytes held by all requests inside the "
     "sidecar; a request that would pass it is answered 429 before its body is read"),
    ("max_sequences", "most sequences one request may ask for (n or best_of, times the "
     "prompts of a prompt list)"),
    ("max_policy_bytes", "largest policy.json / policy.safetensors read"),
)


def add_production_options(parser: argparse.ArgumentParser) -> None:
    """Add the "limits" option group.

    :param parser: the ``serve`` parser.
    """
    d = SidecarSettings(upstreams=(UpstreamSpec("fp16", "http://127.0.0.1:8000"),))
    group = parser.add_argument_group("limits (each trip counted in "
                                      "rlbatch:limit_trips_total)")
    for name, text in _FLOATS:
        group.add_argument("--" + name.replace("_", "-"), type=float,
                           default=getattr(d, name), help=text)
    for name, text in _INTS:
        group.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                           help=text)
    group.add_argument("--max-connections", type=int, default=None,
                       help="most client connections at once; past it the longest-idle one "
                            "is closed (default: the descriptor limit minus the upstream "
                            "connections and a reserve)")
    group.add_argument("--max-chars-per-token", type=int, default=None,
                       help="characters one token may span: a prompt longer than "
                            "max_model_len times this is refused without tokenising "
                            "(vLLM's check; default: the local tokenizer's longest token, "
                            "else 64)")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="serve /metrics and /admin/* (and /health, /ready) on this port "
                            "instead of the API port (default: on the API port)")
    group.add_argument("--policy-dir", dest="policy_dirs", type=Path, action="append",
                       default=[], metavar="DIR",
                       help="a folder POST /admin/controller may load ppo:PATH policies "
                            "from (repeat for more; default: none, switching to a policy "
                            "file is off)")


def production_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`SidecarSettings` fields the "limits" options set.

    :param args: parsed options.
    """
    fields: dict[str, Any] = {name: getattr(args, name) for name, _ in (*_FLOATS, *_INTS)}
    fields["max_connections"] = args.max_connections
    fields["metrics_port"] = args.metrics_port
    fields["max_chars_per_token"] = args.max_chars_per_token
    fields["policy_dirs"] = tuple(p.resolve() for p in args.policy_dirs)
    return fields


def check_start_policy(spec: str, settings: SidecarSettings) -> None:
    """Refuse a ``ppo:PATH`` start controller whose files are not regular or too large,
    before anything reads them (``--policy /dev/zero`` would read until memory runs out).
    The operator's own ``--policy`` is not confined to ``policy_dirs``.

    :param spec: the controller name.
    :param settings: the sidecar's settings.
    :raises PolicyPathError: refused (a ``ValueError``).
    """
    path = policy_path_of(spec)
    if path is not None:
        check_policy_dir(Path(path), settings.max_policy_bytes)
