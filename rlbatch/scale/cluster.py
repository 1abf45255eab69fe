"""Starting or joining a Ray cluster for ``--ray [ADDRESS]``.

``--ray`` alone starts a local cluster on this machine (one CPU slot per core); ``--ray
ADDRESS`` (``auto``, ``HOST:6379`` or ``ray://HOST:10001``) joins a running one (``ray start
--head``, KubeRay). Ray is imported only here, inside :func:`connect`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

LOCAL = "local"
"""The value ``--ray`` takes without an address: start a cluster on this machine."""

# The local cluster's object store: the shared inputs (a few traces) need megabytes; Ray's
# default (30% of RAM) would reserve gigabytes of /dev/shm on a machine other jobs share.
LOCAL_OBJECT_STORE_BYTES = 512 * 2**20


def add_ray_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                   what: str = "runs") -> None:
    """Add ``--ray [ADDRESS]`` to a parser.

    :param parser: the parser or argument group.
    :param what: what runs as Ray tasks, for the help text.
    """
    parser.add_argument(
        "--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
        help=f"run the {what} as Ray tasks: without ADDRESS on a local Ray cluster started on "
             "this machine (one task per core), with ADDRESS (auto, HOST:6379, "
             "ray://HOST:10001) on a running cluster; results are identical to a run "
             "without --ray (docs/scale-out.md)")


def ray_available() -> bool:
    """Whether the ``ray`` package is installed (``scripts/setup.sh`` installs it)."""
    return importlib.util.find_spec("ray") is not None


def connect(address: str | None = LOCAL, *, num_cpus: int | None = None) -> float:
    """Start a local Ray cluster or join one; a no-op when this process is already connected.

    :param address: :data:`LOCAL` or ``None`` (a local cluster), or a cluster address.
    :param num_cpus: CPU slots of a local cluster (default: this machine's cores).
    :returns: seconds the start-up (or join) took: Ray's fixed cost per command.
    :raises ValueError: ray is not installed.
    """
    if not ray_available():
        raise ValueError("--ray needs the ray package: run scripts/setup.sh (or pip install "
                         "'ray[tune]==2.60.0')")
    # No usage-stats upload from clusters the commands start (machines may be offline).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return 0.0
    start = time.perf_counter()
    if address in (None, LOCAL):
        # address="local": always a new cluster; address=None would join any Ray instance
        # already running on this machine (another command's, a test's) or RAY_ADDRESS's.
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
                 include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return time.perf_counter() - start


def shutdown() -> None:
    """Leave the cluster (a local one stops)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
