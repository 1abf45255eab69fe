"""Forking an engine's state for a digital twin: share what is immutable, copy the rest."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from typing import TypeVar

T = TypeVar("T")


def fork_state(obj: T, item_type: type[object] | None = None,
               share: Collection[str] = ()) -> T:
    """An independent copy of ``obj``: every attribute is carried over, lists, deques, dicts
    and sets are copied (shallow), and objects of ``item_type`` (mutable per-request state,
    ``__slots__`` classes) are copied slot by slot, once each; everything else (step-time
    models, configs, frozen records) is shared. Attributes added to ``obj``'s class later are
    forked too.

    :param obj: the object whose state is forked.
    :param item_type: the mutable item class held in its containers, if any.
    :param share: attributes carried over as they are (immutable streams; parts the caller
        replaces with its own forks).
    """
    slots: tuple[str, ...] = getattr(item_type, "__slots__", ()) if item_type else ()
    copies: dict[int, object] = {}

    def dup(value: object) -> object:
        if item_type is not None and isinstance(value, item_type):
            key = id(value)
            if key not in copies:
                new_item = object.__new__(item_type)
                for name in slots:
                    setattr(new_item, name, getattr(value, name))
                copies[key] = new_item
            return copies[key]
        if isinstance(value, list):
            return [dup(v) for v in value]
        if isinstance(value, deque):
            return deque(dup(v) for v in value)
        if isinstance(value, dict | set):
            return value.copy()
        return value

    new: T = object.__new__(type(obj))
    for name, value in vars(obj).items():
        setattr(new, name, value if name in share else dup(value))
    return new
