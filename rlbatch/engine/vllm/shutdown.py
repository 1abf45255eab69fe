"""Shutting one in-process vLLM engine core down while others in the process keep serving.

vLLM's ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory()``, which destroys the
process-wide model-parallel groups. Every in-process engine core shares those groups (the
second engine started finds them initialised and reuses them), so closing one engine while
another is open breaks the other's next forward pass (``get_pp_group()``: "pipeline model
parallel group is not initialized"). :func:`shutdown_core` skips that teardown while other
engines of this process are open; the last engine closed tears the groups down as vLLM does.
"""

from __future__ import annotations

import gc
import importlib
import weakref
from typing import Any

__all__ = ["open_engines", "register_core", "shutdown_core"]

# the in-process engine cores opened and not yet shut down; weak, so that a core dropped
# without a shutdown (vLLM's own finalizer then tears it down) stops counting
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


def open_engines() -> int:
    """How many in-process engine cores this process has open."""
    return len(_OPEN)


def register_core(client: Any) -> None:
    """Count ``client`` (an ``LLMEngine.engine_core``) as open."""
    _OPEN.add(client)


def shutdown_core(client: Any) -> None:
    """Shut ``client`` down; keep the shared distributed state while other engines are open.

    :param client: an ``LLMEngine.engine_core`` (registered with :func:`register_core` or
        not: one that never was is shut down as the others' count allows).
    """
    _OPEN.discard(client)
    if not _OPEN:
        client.shutdown()
        return
    core_module: Any = importlib.import_module("vllm.v1.engine.core")
    teardown = core_module.cleanup_dist_env_and_memory
    # the engine core looks the function up in its module at call time: swap it for the
    # duration of this one shutdown (single-threaded, restored whatever happens)
    core_module.cleanup_dist_env_and_memory = _release_memory_only
    try:
        client.shutdown()
    finally:
        core_module.cleanup_dist_env_and_memory = teardown


def _release_memory_only(shutdown_ray: bool = False) -> None:
    del shutdown_ray
    gc.collect()
