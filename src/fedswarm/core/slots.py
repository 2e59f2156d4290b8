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

__all__ = ["start_after", "starts_after", "queue_starts", "replay_sorted", "fill"]

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
    if not free:
        return 0.0
    return replay_sorted(_clipped_sorted(free), ahead, gpus)


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
    t = _replay(_clipped_sorted(free), ahead)
    g = min(max(gpus, 1), n)
    out: list[float] = []
    for j in range(count):
        if j:
            _take(t, run_s, g)
        t.sort()
        out.append(t[g - 1])
    return out


def replay_sorted(t: list[float], ahead: Ahead, gpus: int) -> float:
    """``start_after`` for slot free times ``t`` already sorted and >= 0
    (not empty), which it consumes: the list is worked on in place."""
    t = _replay(t, ahead)
    t.sort()
    return t[min(max(gpus, 1), len(t)) - 1]


def _replay(t: list[float], ahead: Ahead) -> list[float]:
    """The slot free times (heap ``t``, changed in place) after the shards
    ``ahead`` start in turn, each on the earliest slots it needs; past
    ``_MAX_REPLAY`` shards the rest are poured on evenly (``fill``). Every
    caller reads only the multiset of the result (sorting it), never the
    heap's layout."""
    n = len(t)
    spread = 0.0
    replace = heapq.heapreplace
    for i, a in enumerate(ahead):
        run, held = a[0], a[1]  # (run, slots, ...): a client passes its pending awards as they are
        if i >= _MAX_REPLAY:
            spread += run * min(max(held, 1), n)
            continue
        if held <= 1:  # the common case, inline: the earliest slot takes it, t stays a heap
            replace(t, t[0] + run)
            continue
        _take(t, run, min(held, n))
    if spread:
        t = fill(t, spread)
    return t


def _clipped_sorted(free: Sequence[float]) -> list[float]:
    """``sorted(max(x, 0.0) for x in free)``, clipping only when the
    smallest is negative (``max`` is monotone, so the order is the same)."""
    t = sorted(free)
    if t and 0.0 > t[0]:
        t = [0.0 if 0.0 > x else x for x in t]
    return t


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


def queue_starts(free: Sequence[float], queue: Sequence[tuple[float, int]]) -> list[float]:
    """When each shard of a queue starts, the queue in start order:
    ``[starts_after(free, queue[:i], queue[i][1], 0.0, 1)[0] for i in ...]``
    in one replay instead of one per shard (a peer's renewal round asks this
    of every queued lease; with 2,000 queued that was 2,000 replays of up to
    2,000 shards each)."""
    n = len(free)
    if n == 0:
        return [0.0] * len(queue)
    t = _clipped_sorted(free)  # a sorted list is a heap
    spread = 0.0
    out: list[float] = []
    for i, (run, held) in enumerate(queue):
        g = min(max(held, 1), n)
        out.append((fill(t, spread) if spread else sorted(t))[g - 1])
        # as ``_replay`` would take this shard for the ones behind it
        if i >= _MAX_REPLAY:
            spread += run * min(max(held, 1), n)
        elif held <= 1:
            heapq.heapreplace(t, t[0] + run)
        else:
            _take(t, run, min(held, n))
    return out


def fill(free: Sequence[float], work: float) -> list[float]:
    """Slot free times after ``work`` slot-seconds are poured onto the
    earliest slots (water-filling): how queued work of unknown shape, known
    only as a total, delays the slots."""
    t = _clipped_sorted(free)
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
