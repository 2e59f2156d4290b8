"""The simulator's event heap: events ordered by (time, sequence number).

``netsim/_eventq.c``, compiled by ``scripts/build_native.py`` beside the
huge-page allocator (one manifest for both, ``netsim.hugepages``), keeps the
keys in one array, so that a comparison reads two doubles instead of
comparing two tuples whose items lie anywhere in a heap of several GB (at
10,000 peers ``heappop`` alone was about 5% of the run). ``PyEventQueue`` is
its pure-Python twin, a ``heapq`` list of tuples, used where the build is
missing or stale. The sequence numbers are unique, so both pop the same
events in the same order and hand back the times as pushed: results do not
depend on which is used (tests/netsim/test_eventq.py compares them).
"""

from __future__ import annotations

import heapq
import importlib
from typing import Any

from . import hugepages

__all__ = ["PyEventQueue", "event_queue", "native_queue"]


class PyEventQueue:
    """``push(t, seq, kind, a, b, c)``; ``pop() -> (t, kind, a, b, c)``, the
    first by ``(t, seq)``; ``peek_time()``; ``len()``."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[Any, ...]] = []

    def push(self, t: float, seq: int, kind: int, a: Any, b: Any, c: Any) -> None:
        heapq.heappush(self._heap, (t, seq, kind, a, b, c))

    def pop(self) -> tuple[Any, ...]:
        t, _seq, kind, a, b, c = heapq.heappop(self._heap)
        return t, kind, a, b, c

    def peek_time(self) -> float:
        return self._heap[0][0]

    def __len__(self) -> int:
        return len(self._heap)


_native: list[Any] = []


def native_queue() -> Any:
    """The compiled ``EventQueue`` class, or None where it is not built for
    this source and interpreter."""
    if not _native:
        cls = None
        if hugepages.build_current():
            try:
                cls = importlib.import_module("netsim._native._eventq").EventQueue
            except ImportError:  # a damaged build: the Python twin
                cls = None
        _native.append(cls)
    return _native[0]


def event_queue() -> Any:
    """A new, empty event queue: the compiled one when built, else ``PyEventQueue``."""
    cls = native_queue()
    return cls() if cls is not None else PyEventQueue()
