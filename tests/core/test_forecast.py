"""A client's finish-time forecasts (core.forecast.Forecaster), on its own."""

from __future__ import annotations

import dataclasses

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


def test_a_newer_state_of_the_same_peer_is_read_afresh() -> None:
    # the slot times of a state are kept between rounds; the next state,
    # and a shard that skips the queue, must not be answered from them
    f, e, spec = _setup(slots=2)
    now = e.issued_at
    assert f.view_wait(spec, e, now) == 0.0
    busy = dataclasses.replace(e.state, seq=e.state.seq + 1, free_s=(30.0, 50.0), backlog_s=60.0)
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
