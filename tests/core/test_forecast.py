"""A client's finish-time forecasts (core.forecast.Forecaster), on its own."""

from __future__ import annotations

import dataclasses
import heapq
import math

import msgspec

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.forecast import Forecaster, position
from fedswarm.core.view import View, ViewEntry
from fedswarm.core.wire import Bid, JobSpec
from fedswarm.testing import MiniSwarm


def _setup(slots: int = 2) -> tuple[Forecaster, ViewEntry, JobSpec]:
    s = MiniSwarm(1, seed=7, peer_config=lambda i: PeerConfig(slots=slots, addrs=(), region="eu"))
    (peer,) = s.peers.values()
    e = peer.view.get(peer.id)
    assert e is not None
    view = View("me", 16)
    view.merge(e.peer, e.state, e.issued_at, e.raw, e.issued_at)
    entry = view.get(e.peer)
    assert entry is not None
    spec = JobSpec("j", "sim", 1, False, 10.0, 1, 0, None, 1.0, 0.0, e.issued_at, b"\x80")
    return Forecaster(ClientConfig(max_view=16), view, salt=1), entry, spec


def _bid(start_s: float, run_s: float = 10.0, next_s: tuple[float, ...] = (), slots: int = 2) -> Bid:
    return Bid("j", 0, (0,), start_s, run_s, slots, 1.0, 0.0, 0.0, "", next_s)


def test_an_idle_peer_starts_at_once_and_awards_since_its_state_queue_up() -> None:
    f, e, spec = _setup(slots=1)
    now = e.issued_at
    assert f.view_wait(spec, e, now) == 0.0
    assert f.eta(spec, e, now) == 10.0  # run at reference speed
    f.note_award(e.peer, now, (10.0, 1, now, "other", 0, 0))
    assert f.view_wait(spec, e, now) == 10.0 and f.awarded_since(e.peer, now) == 1
    f.unpend(e.peer, "other", 0, 0)
    assert f.view_wait(spec, e, now) == 0.0 and f.pending(e.peer) == []


def test_awards_a_newer_state_counts_are_dropped_whether_or_not_a_forecast_looked_first() -> None:
    # a client asks for forecasts of some peers and not others, in an order
    # that once followed a set of peer ids (so the hash seed): the awards
    # left pending must depend on the states received, not on those calls
    runs = []
    for look in (False, True):
        f, e, spec = _setup(slots=1)
        now = e.issued_at
        f.note_award(e.peer, now, (10.0, 1, now, "old", 0, 0))
        later = now + f.config.bid_window_s + 5.0
        f.view.merge(e.peer, msgspec.structs.replace(e.state, seq=e.state.seq + 1), later, e.raw, later)
        e2 = f.view.get(e.peer)
        assert e2 is not None
        if look:
            f.view_wait(spec, e2, later)
        f.note_award(e.peer, later + 1.0, (10.0, 1, later + 1.0, "new", 0, 0))
        runs.append((f.pending(e.peer), f.awarded_since(e.peer, now), f.view_wait(spec, e2, later + 1.0)))
    assert runs[0] == runs[1]
    assert [a[3] for a in runs[0][0]] == ["new"]  # the newer state counts "old"
    assert runs[0][1:] == (1, 10.0)


def test_a_newer_state_of_the_same_peer_is_read_afresh() -> None:
    # the slot times of a state are kept between rounds; the next state,
    # and a shard that skips the queue, must not be answered from them
    f, e, spec = _setup(slots=2)
    now = e.issued_at
    assert f.view_wait(spec, e, now) == 0.0
    busy = msgspec.structs.replace(e.state, seq=e.state.seq + 1, free_s=(30.0, 50.0), backlog_s=60.0)
    f.view.merge(e.peer, busy, now + 1.0, e.raw, now + 1.0)
    e2 = f.view.get(e.peer)
    assert e2 is not None and e2.state is busy
    # queued work 2 x 60 - (30 + 50) = 40 s poured onto the earliest slots: both free at 60
    assert f.view_wait(spec, e2, now + 1.0) == 60.0
    assert f.view_wait(spec, e2, now + 1.0, queued=False) == 30.0  # past running work only
    assert f.view_wait(spec, e2, now + 1.0) == 60.0
    assert f.view_wait(spec, e, now) == 0.0  # the older entry still reads its own state


def test_a_bid_is_news_until_a_newer_state_and_teaches_how_stale_states_are() -> None:
    f, e, spec = _setup()
    now = e.issued_at + 2.0
    f.remember(now, e.peer, _bid(30.0), deadline=False)
    assert f.news_wait(spec, e, now + 5.0) == 25.0
    assert f.eta(spec, e, now + 5.0) == 35.0  # the bid's later start wins over the state's
    newer = dataclasses.replace(e, issued_at=now + 1.0)
    assert f.news_wait(spec, newer, now + 5.0) is None  # the state is newer: the news is dropped
    k = f.stale_class(spec, e, now, 0.0)
    assert f.stale_means[k] == 0.0
    f.learn_stale((k, 0.0), _bid(8.0))
    assert 0.0 < f.stale_means[k] <= 8.0
    # a second look ranks a state-only estimate later by what was learnt
    assert f.eta(spec, e, now, stale=True) > f.eta(spec, e, now)


def test_stale_idle_states_are_learnt_per_speed_so_slow_idle_peers_rank_first() -> None:
    # a loaded swarm: old "idle" states of fast peers bid minutes out, and
    # that must not raise the estimate of equally old idle slow peers
    f, e, spec = _setup(slots=1)
    slow_state = msgspec.structs.replace(e.state, throughput={"*": 0.45})
    f.view.merge("slow", slow_state, e.issued_at, e.raw, e.issued_at)
    slow = f.view.get("slow")
    assert slow is not None
    now = e.issued_at + 300.0  # both states are 300 s old and say idle
    fast_k, slow_k = f.stale_class(spec, e, now, 0.0), f.stale_class(spec, slow, now, 0.0)
    assert fast_k != slow_k
    for _ in range(40):  # fast peers with such states bid to start 300 s out
        f.learn_stale((fast_k, 0.0), _bid(300.0))
    assert f.stale_means[fast_k] > 250.0 and f.stale_means[slow_k] == 0.0
    # the first look trusts the states: the fast peer finishes first (10 s against 22 s)
    assert [x.peer for x in f.rank(spec, [e, slow], 1, now)] == [e.peer]
    # a second look corrects them by what was learnt: the slow idle peer first
    assert [x.peer for x in f.rank(spec, [e, slow], 1, now, stale=True)] == ["slow"]
    assert f.eta(spec, slow, now, stale=True) == f.eta(spec, slow, now) == 10.0 / 0.45
    # peers of one speed still share a class whatever else differs in their states
    twin = msgspec.structs.replace(e.state, throughput={"*": 0.5, "sim": 0.48})
    f.view.merge("twin", twin, e.issued_at, e.raw, e.issued_at)
    assert f.stale_class(spec, f.view.get("twin"), now, 0.0) == slow_k  # type: ignore[arg-type]


def test_round_trips_time_the_bid_window_and_stand_in_for_a_region() -> None:
    f, e, _ = _setup()
    cfg = f.config
    assert f.rto(e.peer) is None and f.transit(e.peer) == 0.0
    assert f.bid_window([e.peer]) == cfg.bid_window_s  # never heard from: the whole window
    f.sample_rtt(e.peer, e.issued_at, 0.2)
    assert f.transit(e.peer) == 0.2 and f.rto(e.peer) == 0.2 + 4 * 0.1
    assert f.bid_window([e.peer]) == min(cfg.bid_window_s, max(0.6, cfg.bid_window_min_s))
    other = dataclasses.replace(e, peer="unmeasured")  # same region
    assert f.transit(other.peer, other) == 0.2
    assert f.tie(e.peer) == f.tie(e.peer) != Forecaster(cfg, f.view, salt=2).tie(e.peer)


def test_position_reads_the_waits_a_bid_lists_then_whole_waves() -> None:
    b = _bid(1.0, run_s=10.0, next_s=(1.0, 11.0), slots=2)
    # past the list: waves of ``slots`` shards counted from the last listed wait
    assert [position(b, k) for k in range(6)] == [1.0, 1.0, 11.0, 21.0, 31.0, 31.0]
    assert [position(_bid(0.0, slots=2), k) for k in range(4)] == [0.0, 0.0, 10.0, 10.0]


def _forecasters(data: st.DataObject) -> tuple[Forecaster, Forecaster, list[ViewEntry], JobSpec, float]:
    """Two equal forecasters over a view of generated peers: states of
    1-4 slots with slot free times or only a backlog, of several ages;
    this client's awards since some of them, bids newer than others, round
    trips and staleness means learnt. (Built twice from the same draws, not
    copied: a compiled core's objects have no deepcopy.)"""
    f, e, spec = _setup()
    t0 = e.issued_at
    gpus = data.draw(st.integers(1, 3))
    spec = msgspec.structs.replace(spec, gpus=gpus, deadline_s=data.draw(st.sampled_from([None, 30.0])))
    times = st.floats(0.0, 200.0, allow_nan=False)
    merges = []
    for i in range(data.draw(st.integers(1, 24))):
        slots = data.draw(st.integers(1, 4))
        free = tuple(sorted(data.draw(st.lists(times, min_size=slots, max_size=slots)))) if data.draw(st.booleans()) else ()
        s = msgspec.structs.replace(e.state, slots=slots, free_s=free, backlog_s=data.draw(times),
                                throughput={"sim": data.draw(st.floats(0.25, 4.0))}, ttl_s=600.0)
        issued = t0 + data.draw(st.floats(0.0, 20.0))
        merges.append((f"p{i}", s, issued))
    salt = data.draw(st.integers(0, 2**31))

    def build() -> Forecaster:
        view = View("me", 64)
        for peer, state, issued in merges:
            view.merge(peer, state, issued, e.raw, issued)
        return Forecaster(ClientConfig(max_view=64), view, salt=salt)

    f = build()
    now = t0 + 20.0 + data.draw(st.floats(0.0, 30.0))
    entries = f.view.live(now)
    calls: list[tuple[str, tuple, dict]] = []
    for x in entries:
        if data.draw(st.booleans()):  # awards since its state (some sent before it: dropped when read)
            for j in range(data.draw(st.integers(1, 12))):
                calls.append(("note_award", (x.peer, x.issued_at + data.draw(st.floats(-10.0, 5.0)),
                              (data.draw(st.floats(0.5, 60.0)), data.draw(st.integers(1, 3)), now, "o", j, 0)), {}))
        if data.draw(st.booleans()):  # a bid, older or newer than the state
            calls.append(("remember", (x.issued_at + data.draw(st.floats(-5.0, 5.0)), x.peer, _bid(data.draw(times))),
                          {"deadline": data.draw(st.booleans())}))
        if data.draw(st.booleans()):
            calls.append(("sample_rtt", (x.peer, now, data.draw(st.floats(0.001, 2.0))), {}))
    for k in range(len(f.stale_means)):
        calls.append(("learn_stale", ((k, 0.0), _bid(data.draw(times))), {}))
    plain = build()
    for g in (f, plain):
        for name, args, kw in calls:
            getattr(g, name)(*args, **kw)
    return f, plain, entries, spec, now


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_ranking_with_floors_is_the_plain_ranking_with_the_same_side_effects(data: st.DataObject) -> None:
    # rank visits peers by a lower bound of their key and stops once the
    # bound loses, and skips the award replay at peers whose floor cannot
    # win: its answer, and what it leaves behind (awards and news dropped
    # for newer states), must equal those of evaluating every eta
    f, plain, entries, spec, now = _forecasters(data)
    k = data.draw(st.integers(1, len(entries)))
    stale = data.draw(st.booleans())
    want = heapq.nsmallest(k, plain.view.live(now), key=lambda e: (
        plain.eta(spec, e, now, stale=stale) + 2.0 * plain.transit(e.peer, e), plain.tie(e.peer)))
    assert [e.peer for e in f.rank(spec, entries, k, now, stale=stale)] == [e.peer for e in want]
    assert f._pending == plain._pending and f._news == plain._news
    for e in entries:  # every floor is below its eta, and exact where it says so
        lo, exact = f.floor(spec, e, now, stale=stale)
        eta = f.eta(spec, e, now, stale=stale)
        assert lo <= eta and (not exact or lo == eta)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_beats_is_a_test_of_the_soonest_eta_with_the_same_side_effects(data: st.DataObject) -> None:
    # beats stops at the first peer that wins and skips peers whose run
    # alone loses: its answer and what it leaves behind must equal those of
    # taking the minimum of every eta
    f, plain, entries, spec, now = _forecasters(data)
    soonest = min(plain.eta(spec, e, now) for e in plain.view.live(now))
    # thresholds at, around and far from the answer
    cut = data.draw(st.sampled_from([soonest, soonest + 1e-9, soonest - 1e-9, 0.0, math.inf]) | st.floats(0.0, 400.0))
    strict = data.draw(st.booleans())

    def wins(v: float) -> bool:
        return v < cut if strict else v <= cut

    assert f.beats(spec, entries, now, wins) == wins(soonest)
    assert f._pending == plain._pending and f._news == plain._news
    assert not f.beats(spec, [], now, lambda v: True)
