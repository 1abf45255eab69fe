"""Scale-out on Ray: run independent tasks (evaluation runs, sweep points, teacher episodes,
training seeds) as Ray tasks on a local or remote cluster.

Ray is optional: nothing here imports it at module level, so ``python -m rlbatch --help`` and
every command without ``--ray`` stay dependency-free. :func:`connect` starts or joins a
cluster; :func:`run_tasks` maps a function over inputs with one progress bar, large shared
inputs put in the object store once, and every failed task retried once and then returned as
a :class:`TaskError` (never dropped).
"""

from __future__ import annotations

from rlbatch.scale.cluster import LOCAL, add_ray_option, connect, ray_available
from rlbatch.scale.tasks import TaskError, failed, run_tasks

__all__ = ["LOCAL", "TaskError", "add_ray_option", "connect", "failed", "ray_available",
           "run_tasks"]
