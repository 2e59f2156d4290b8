"""List scheduling over a peer's slots (core.slots): what bids and client
estimates say about when a shard starts."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.slots import _MAX_REPLAY, fill, queue_starts, replay_sorted, start_after, starts_after

times = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
slots = st.lists(times, min_size=1, max_size=16)
shards = st.lists(st.tuples(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), st.integers(1, 20)), max_size=40)


def test_a_free_slot_starts_a_single_shard_at_once() -> None:
    # one long shard on one of 8 slots: the average (500 / 8) is no wait at all
    assert start_after([0.0] * 7 + [500.0], [], 1) == 0.0
    # a gang of 8 waits for that shard
    assert start_after([0.0] * 7 + [500.0], [], 8) == 500.0


def test_shards_ahead_take_the_earliest_slots_in_order() -> None:
    # 2 slots free at 0 and 10; ahead: a 2-slot gang of 5 s, then a 30 s single
    free = [0.0, 10.0]
    assert start_after(free, [(5.0, 2)], 1) == 15.0
    assert start_after(free, [(5.0, 2), (30.0, 1)], 1) == 15.0
    assert start_after(free, [(5.0, 2), (30.0, 1)], 2) == 45.0
    # no backfilling past a gang: the single waits behind it
    assert start_after([0.0, 100.0], [(1.0, 2)], 1) == 101.0


def test_further_shards_of_one_job_take_the_free_slots_then_wait() -> None:
    # 8 slots, one free, the others busy for 50 s: a second shard of 100 s
    # waits for them (a slot count alone would say it starts at once)
    assert starts_after([0.0] + [50.0] * 7, [], 1, 100.0, 3) == [0.0, 50.0, 50.0]
    # a short one waits for the first instead
    assert starts_after([0.0] + [50.0] * 7, [], 1, 10.0, 3) == [0.0, 10.0, 20.0]
    # one slot: each waits for the one before; a queued 5 s shard goes first
    assert starts_after([0.0], [(5.0, 1)], 1, 10.0, 3) == [5.0, 15.0, 25.0]
    # 2-slot gangs on 4 slots
    assert starts_after([0.0, 0.0, 0.0, 30.0], [], 2, 10.0, 3) == [0.0, 10.0, 20.0]


def test_fill_pours_work_onto_the_earliest_slots() -> None:
    assert fill([0.0, 10.0, 40.0], 30.0) == [20.0, 20.0, 40.0]
    assert fill([0.0, 10.0], 0.0) == [0.0, 10.0]
    assert fill([5.0, 5.0], 10.0) == [10.0, 10.0]


@given(slots, shards, st.integers(1, 20))
def test_start_is_bounded_by_the_work_ahead(free: list[float], ahead: list[tuple[float, int]], g: int) -> None:
    t = start_after(free, ahead, g)
    n = len(free)
    lo = sorted(free)[min(g, n) - 1]
    # never before its slots free; never later than running everything ahead back to back
    assert t >= lo - 1e-6
    assert t <= max(free) + sum(r for r, _ in ahead) + 1e-6
    # more work ahead never makes it start sooner
    assert start_after(free, [*ahead, (1.0, 1)], g) >= t - 1e-6


@given(slots, st.floats(min_value=0.0, max_value=1e5, allow_nan=False))
def test_fill_conserves_work(free: list[float], work: float) -> None:
    out = fill(free, work)
    added = sum(out) - sum(free)
    assert math.isclose(added, work, rel_tol=1e-6, abs_tol=1e-6)
    assert all(a >= b - 1e-9 for a, b in zip(out, sorted(free)))


@given(slots, shards, st.integers(1, 20), st.floats(min_value=0.0, max_value=1e3, allow_nan=False), st.integers(1, 17))
def test_further_starts_begin_where_one_start_would_and_never_go_back(
        free: list[float], ahead: list[tuple[float, int]], g: int, run_s: float, count: int) -> None:
    out = starts_after(free, ahead, g, run_s, count)
    assert len(out) == count
    assert out[0] == start_after(free, ahead, g)
    assert all(b >= a for a, b in zip(out, out[1:]))
    # the k-th further shard of the job is the one that would start if k
    # of its shards were ahead of it
    k = count - 1
    assert math.isclose(out[-1], start_after(free, [*ahead, *[(run_s, g)] * k], g), rel_tol=1e-9, abs_tol=1e-6)


def _reference_start(free: list[float], ahead: list[tuple[float, int]], g: int) -> float:
    """List scheduling spelled out with a sort per shard: each shard ahead
    takes its earliest slots, those past ``_MAX_REPLAY`` are poured evenly."""
    t = sorted(max(x, 0.0) for x in free)
    n = len(t)
    spread = 0.0
    for i, (run, held) in enumerate(ahead):
        if i >= _MAX_REPLAY:
            spread += run * min(max(held, 1), n)
            continue
        h = min(max(held, 1), n)
        t.sort()
        start = t[h - 1]
        t[:h] = [start + run] * h
    if spread:
        t = fill(t, spread)
    return sorted(t)[min(g, n) - 1]


signed_slots = st.lists(st.floats(min_value=-50.0, max_value=1e4, allow_nan=False), min_size=1, max_size=16)


@given(signed_slots, st.lists(st.tuples(st.floats(min_value=0.0, max_value=1e3, allow_nan=False),
                                        st.integers(1, 3)), max_size=_MAX_REPLAY + 20), st.integers(1, 20))
def test_the_heap_replay_is_the_spelled_out_list_schedule(
        free: list[float], ahead: list[tuple[float, int]], g: int) -> None:
    # exactly equal, not close: the simulator's results must not move when the replay is made cheaper
    want = _reference_start(free, ahead, g)
    assert start_after(free, ahead, g) == want
    # a client's forecast hands over slot times it has already sorted and clipped
    assert replay_sorted(sorted(max(x, 0.0) for x in free), ahead, g) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(min_value=-50.0, max_value=1e4, allow_nan=False), max_size=16),
       st.lists(st.tuples(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), st.integers(1, 3)),
                max_size=_MAX_REPLAY + 12))
def test_a_queues_starts_in_one_replay_are_each_shards_own_replay(
        free: list[float], queue: list[tuple[float, int]]) -> None:
    # exactly equal: a peer's renewal round reads these instead of one replay per lease
    assert queue_starts(free, queue) == [starts_after(free, queue[:i], held, 0.0, 1)[0]
                                         for i, (_, held) in enumerate(queue)]


def test_a_long_queues_starts_in_one_replay_past_the_replay_cap() -> None:
    rng = random.Random(7)
    for slots in (1, 3, 8):
        free = [rng.uniform(-5.0, 50.0) for _ in range(slots)]
        queue = [(rng.uniform(0.0, 30.0), rng.choice((1, 1, 1, 2, 3))) for _ in range(_MAX_REPLAY + 40)]
        assert queue_starts(free, queue) == [starts_after(free, queue[:i], held, 0.0, 1)[0]
                                             for i, (_, held) in enumerate(queue)]
