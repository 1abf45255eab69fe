"""Map a function over independent inputs as Ray tasks: one progress bar, shared inputs put
in the object store once, every failure retried once and then kept as a :class:`TaskError`.

Results come back in input order whatever order the tasks finish in, and a task sees only
its own inputs (never a worker id or a counter), so a grid's rows equal a serial run's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class TaskError:
    """A task that failed on every attempt.

    :param index: its position in the inputs.
    :param inputs: its inputs, in words.
    :param error: ``ExceptionType: message`` of the last attempt.
    :param detail: the last attempt's full report (remote traceback).
    :param attempts: how many times it ran.
    """

    index: int
    inputs: str
    error: str
    detail: str
    attempts: int


def failed(results: Sequence[Any]) -> list[TaskError]:
    """The :class:`TaskError` entries of a :func:`run_tasks` result.

    :param results: what :func:`run_tasks` returned.
    """
    return [r for r in results if isinstance(r, TaskError)]


def _call(fn: Callable[[Any, Any], Any], item: Any, shared: Any, cwd: str) -> Any:
    # Relative paths in the inputs (ppo:policies/default, trace files) mean the driver's
    # working directory; a worker on the same machine or a shared filesystem has it.
    if os.path.isdir(cwd) and os.getcwd() != cwd:
        os.chdir(cwd)
    return fn(item, shared)


def _describe_failure(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError: the task's exception
    err = cause if isinstance(cause, BaseException) else exc
    return f"{type(err).__name__}: {err}"


def run_tasks(fn: Callable[[T, Any], R], items: Sequence[T], *,
              shared: Mapping[Any, Any] | None = None,
              shared_key: Callable[[T], Hashable] | None = None,
              describe: Callable[[T], str] = repr, desc: str = "tasks", quiet: bool = False,
              retries: int = 1, num_cpus: float = 1.0) -> list[R | TaskError]:
    """Run ``fn(item, shared[shared_key(item)])`` for every item as a Ray task on the
    connected cluster (:func:`rlbatch.scale.connect` first).

    :param fn: a picklable function of (item, its shared input or ``None``); a module-level
        function travels by reference.
    :param items: the small per-task inputs (pickled with each task).
    :param shared: large inputs (workloads, profiles) by key: each is put in the object store
        once and handed to every task whose ``shared_key`` names it.
    :param shared_key: which shared input an item needs (``None``: none).
    :param describe: an item in words, for failure reports.
    :param desc: the progress bar's label.
    :param quiet: no progress bar (failure reports still go to stderr).
    :param retries: extra attempts of a failed task (the issue's contract: one).
    :param num_cpus: CPU slots a task holds (the simulator is single-threaded: one).
    :returns: per item, in order, the result or a :class:`TaskError`.
    """
    import ray

    refs = {key: ray.put(value) for key, value in (shared or {}).items()}
    remote = ray.remote(_call).options(num_cpus=num_cpus, max_retries=0)
    fn_ref = ray.put(fn)  # once, not pickled into every task
    cwd = os.getcwd()

    def submit(i: int) -> Any:
        key = shared_key(items[i]) if shared_key is not None else None
        return remote.remote(fn_ref, items[i], refs[key] if key is not None else None, cwd)

    results: list[Any] = [None] * len(items)
    pending = {submit(i): (i, 1) for i in range(len(items))}
    with tqdm(total=len(items), unit="task", desc=desc, file=sys.stderr,
              disable=quiet) as bar:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i, attempt = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:  # the task's own error or a lost worker
                    error = _describe_failure(exc)
                    if attempt <= retries:
                        tqdm.write(f"{desc}: task {describe(items[i])} failed ({error}); "
                                   f"retrying", file=sys.stderr)
                        pending[submit(i)] = (i, attempt + 1)
                        continue
                    tqdm.write(f"{desc}: task {describe(items[i])} failed {attempt} times: "
                               f"{error}", file=sys.stderr)
                    results[i] = TaskError(i, describe(items[i]), error, str(exc), attempt)
                bar.update(1)
    return results
