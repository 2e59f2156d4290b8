"""When a shard could start on a peer: list scheduling over its slots.

A peer runs its queue in priority order without backfilling (a gang at the
head waits for its slots rather than being overtaken; ``PeerCore._schedule``).
So the start of a new shard is found by replaying that order on the times at
which each slot frees: every shard ahead takes the earliest slots it needs,
then the new shard does.

An average of the work per slot (what ``PeerState.backlog_s`` says) is a
poor stand-in: a peer with one long shard on one of its 8 slots would say a
new single-GPU shard waits an eighth of that shard, although it starts at
once. Bids and client estimates built on the average steer single shards to
idle peers and spread them over every multi-GPU peer, leaving no peer whose
slots free together when a gang arrives.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

__all__ = ["start_after", "starts_after", "fill"]

_MAX_REPLAY = 256  # shards ahead replayed one by one; the rest are spread evenly
#: shards ahead: (run seconds, slots held), or a client's pending award
#: (``core.forecast.Pending``), whose first two fields are those
Ahead = Iterable[tuple[float, int] | tuple[float, int, float, str, int, int]]


def start_after(free: Sequence[float], ahead: Ahead, gpus: int) -> float:
    """Seconds until ``gpus`` slots are free together for a new shard.

    ``free``: seconds until each slot frees (one entry per slot, 0 = free);
    ``ahead``: (run seconds, slots held) of the shards that start first, in
    the order they start. A shard that holds more slots than there are is
    given all of them.
    """
    return starts_after(free, ahead, gpus, 0.0, 1)[0]


def starts_after(free: Sequence[float], ahead: Ahead, gpus: int, run_s: float,
                 count: int) -> list[float]:
    """Seconds until each of ``count`` new shards (``gpus`` slots each,
    ``run_s`` long) would start, placed one after another behind ``ahead``
    (as in ``start_after``): how far a second, third... shard of one job
    given to this peer waits, which its free slots, not its slot count,
    decide."""
    n = len(free)
    if n == 0:
        return [0.0] * count
    t = sorted(max(x, 0.0) for x in free)
    spread = 0.0
    for i, a in enumerate(ahead):
        run, held = a[0], a[1]  # (run, slots, ...): a client passes its pending awards as they are
        if i >= _MAX_REPLAY:
            spread += run * min(max(held, 1), n)
            continue
        if held <= 1:  # the common case, inline: t stays a heap, smallest first
            heapq.heappush(t, heapq.heappop(t) + run)
            continue
        _take(t, run, min(held, n))
    if spread:
        t = fill(t, spread)
    g = min(max(gpus, 1), n)
    out: list[float] = []
    for j in range(count):
        if j:
            _take(t, run_s, g)
        t.sort()
        out.append(t[g - 1])
    return out


def _take(t: list[float], run_s: float, g: int) -> None:
    """Start one shard on the ``g`` earliest slots of heap ``t``."""
    if g == 1:
        start = heapq.heappop(t)  # t stays a heap: smallest first
        heapq.heappush(t, start + run_s)
        return
    t.sort()
    start = t[g - 1]
    for k in range(g):
        t[k] = start + run_s
    heapq.heapify(t)


def fill(free: Sequence[float], work: float) -> list[float]:
    """Slot free times after ``work`` slot-seconds are poured onto the
    earliest slots (water-filling): how queued work of unknown shape, known
    only as a total, delays the slots."""
    t = sorted(max(x, 0.0) for x in free)
    if work <= 0 or not t:
        return t
    n = len(t)
    left = work
    k = 1
    level = t[0]
    while True:
        nxt = t[k] if k < n else float("inf")
        room = (nxt - level) * k
        if left <= room:
            level += left / k
            break
        left -= room
        level = nxt
        k += 1
    return [max(x, level) for x in t]
