"""The gossip view's expiry and graveyard against a brute-force model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.energy import PowerModel
from fedswarm.core.view import View
from fedswarm.core.wire import PeerState, PowerInfo

_PM = PowerModel(idle_w=10.0, max_w=65.0, alpha=2.5, levels=(1.0,))


def _state(seq: int, ttl: float, leaving: bool) -> PeerState:
    return PeerState(
        seq=seq, ttl_s=ttl, devices=(), slots=1, throughput={"*": 1.0}, backlog_s=0.0,
        power=PowerInfo(10.0, _PM.idle_w, _PM.max_w, _PM.max_w, _PM.alpha, _PM.levels),
        energy_price=0.2, carbon_g_kwh=300.0, spans=(), trust="volunteer", membership=b"", addrs=(),
        region="", leaving=leaving, ledger={},
    )


# (advance time by, peer, seq, ttl, leaving, expire after)
steps = st.lists(
    st.tuples(st.floats(0, 50), st.sampled_from("abcdefgh"), st.integers(0, 6), st.floats(1, 120), st.booleans(),
              st.booleans()),
    max_size=60,
)


@settings(max_examples=200)
@given(steps)
def test_expire_drops_exactly_the_expired_entries_and_buries_them(ops: list) -> None:
    v = View("me", max_size=6, graveyard_s=100.0)
    now = 0.0
    buried: dict[str, float] = {}  # the model of the graveyard
    model: dict[str, tuple[int, float]] = {}  # peer -> (seq, expires at)
    for dt, peer, seq, ttl, leaving, expire in ops:
        now += dt
        issued = now - dt / 2
        fresh = issued + ttl > now and (peer not in model or model[peer][0] < seq)
        if fresh and peer not in model and len(model) >= 6:
            # a full view makes room by dropping the entry that expires soonest
            del model[min(model, key=lambda p: (model[p][1], p))]
        if fresh:
            model[peer] = (seq, issued + ttl)
        assert v.merge(peer, _state(seq, ttl, leaving), issued, b"", now) == fresh
        assert set(v.peers()) == set(model)
        if peer in v:
            buried.pop(peer, None)
        if not expire:
            continue
        due = sorted(p for p in v.peers() if v.get(p).expires_at <= now)  # type: ignore[union-attr]
        leaving_due = {p for p in due if v.get(p).state.leaving}  # type: ignore[union-attr]
        assert v.expire(now) == due
        for p in due:
            del model[p]
        assert all(v.get(p) is None for p in due)
        assert all(e.expires_at > now for e in (v.get(p) for p in v.peers()) if e is not None)
        for p in due:
            if p not in leaving_due:
                buried[p] = now
        buried = {p: t for p, t in buried.items() if t > now - 100.0}
        if len(buried) > 6:  # the newest max_size are kept
            buried = dict(sorted(buried.items(), key=lambda kv: (-kv[1], kv[0]))[:6])
        assert dict(v.graveyard) == buried


def _state_cap(seq: int, ttl: float, leaving: bool, slots: int, free: tuple[float, ...]) -> PeerState:
    from msgspec.structs import replace

    return replace(_state(seq, ttl, leaving), slots=slots, free_s=free)


# (advance time by, peer, seq, ttl, leaving, slots, busy slots, action)
cap_steps = st.lists(
    st.tuples(st.floats(0, 40), st.sampled_from("abcdefgh"), st.integers(0, 6), st.floats(1, 120), st.booleans(),
              st.integers(0, 4), st.integers(0, 4), st.sampled_from(["merge", "expire", "remove", "ask", "ask-earlier"])),
    max_size=60,
)


@settings(max_examples=200)
@given(cap_steps)
def test_capacity_equals_a_scan_of_the_live_entries(ops: list) -> None:
    """The running capacity sums agree with summing ``live(now)`` after any
    mix of merges (new, replaced, tombstones, evictions), expiries, removals
    and questions about the present or the past."""
    v = View("me", max_size=5)
    now = 0.0

    def scan(t: float) -> tuple[int, int, int]:
        slots = known = busy = 0
        for e in v.live(t):
            slots += e.state.slots
            if e.state.free_s and len(e.state.free_s) == min(e.state.slots, 64):
                known += len(e.state.free_s)
                busy += sum(1 for x in e.state.free_s if x > 0.0)
        return slots, known, busy

    for dt, peer, seq, ttl, leaving, slots, busy, action in ops:
        now += dt
        if action == "merge":
            busy = min(busy, slots)
            free = tuple([0.0] * (slots - busy) + [5.0] * busy)
            v.merge(peer, _state_cap(seq, ttl, leaving, slots, free), now - dt / 2, b"", now)
        elif action == "expire":
            v.expire(now)
        elif action == "remove":
            v.remove(peer)
        elif action == "ask-earlier":
            assert v.capacity(now - dt) == scan(now - dt)
        assert v.capacity(now) == scan(now)


@settings(max_examples=200)
@given(steps, st.integers(0, 2**32))
def test_a_full_view_with_an_rng_drops_the_expired_first_then_a_random_entry_never_its_own(ops: list, seed: int) -> None:
    v = View("me", max_size=4, rng=random.Random(seed), rumour_age_s=10.0)
    assert v.merge("me", _state(1, 1e6, False), 0.0, b"", 0.0)
    now = 0.0
    for dt, peer, seq, ttl, leaving, expire in ops:
        now += dt
        issued = now - dt / 2
        before = {p: v.get(p) for p in v.peers()}
        full = len(before) >= 4
        recent = list(v._recent)
        news = v.merge(peer, _state(seq, ttl, leaving), issued, b"", now)
        fresh = issued + ttl > now and (peer not in before or before[peer].state.seq < seq)  # type: ignore[union-attr]
        assert news == fresh
        assert "me" in v and len(v) <= 4
        gone = set(before) - set(v.peers())
        if news and peer not in before and full:
            assert len(gone) == 1
            [victim] = gone
            assert victim != "me"
            expired = [p for p, e in before.items() if p != "me" and e.expires_at <= now]  # type: ignore[union-attr]
            if expired:  # an expired entry goes first
                assert victim in expired
            # a newcomer with an old state is churn: not a rumour
            assert v._recent == (recent + [peer] if now - issued <= 10.0 else recent)
        else:
            assert not gone
            if news:
                assert v._recent == recent + [peer]
            else:
                assert v._recent == recent
        if expire:
            v.expire(now)


def test_random_eviction_is_seeded() -> None:
    def run(seed: int) -> list[str]:
        v = View("me", max_size=8, rng=random.Random(seed))
        for i in range(100):
            v.merge(f"p{i:03d}", _state(1, 100.0, False), 0.0, b"", 1.0)
        return list(v.peers())

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len(run(1)) == 8


long_steps = st.lists(
    st.tuples(st.floats(0, 5), st.sampled_from("abcdefghij"), st.integers(0, 400), st.floats(1, 120), st.booleans(),
              st.sampled_from(["merge", "merge", "merge", "expire", "capacity"])),
    min_size=100, max_size=250,
)


@settings(max_examples=25, deadline=None)
@given(long_steps, st.booleans())
def test_compacting_the_heaps_changes_nothing_a_caller_sees(ops: list, with_rng: bool) -> None:
    views = [View("me", max_size=6, rng=random.Random(3) if with_rng else None) for _ in range(2)]
    views[1].compact_slack = 10**9  # never compacted
    now = 0.0
    for dt, peer, seq, ttl, leaving, action in ops:
        now += dt
        if action == "merge":
            outs = [v.merge(peer, _state_cap(seq, ttl, leaving, 2, (0.0, 3.0)), now - dt / 2, b"", now) for v in views]
        elif action == "expire":
            outs = [v.expire(now) for v in views]
        else:
            outs = [v.capacity(now) for v in views]
        assert outs[0] == outs[1]
        assert views[0].peers() == views[1].peers()
        assert [e.peer for e in views[0].live(now)] == [e.peer for e in views[1].live(now)]
    assert len(views[0]._expiry) <= 4 * len(views[0]) + 65  # bounded


def test_a_view_that_turns_over_keeps_its_heaps_bounded() -> None:
    v = View("me", max_size=8, rng=random.Random(1))
    for i in range(2000):
        assert v.merge(f"p{i % 50:02d}", _state_cap(i, 600.0, False, 1, (0.0,)), 0.0, b"", 1.0)
    assert len(v) == 8
    assert len(v._expiry) <= 4 * 8 + 65 and len(v._cap_heap) <= 4 * 8 + 65
    assert v.capacity(1.0) == (8, 8, 0)


# (advance time by, peer (our own id among them), seq, ttl, leaving, action)
live_steps = st.lists(
    st.tuples(st.floats(0, 40), st.sampled_from(["me", "a", "b", "c", "d", "e", "f", "g"]), st.integers(0, 6),
              st.floats(1, 120), st.booleans(), st.sampled_from(["merge", "merge", "expire", "remove", "ask", "ask-earlier"])),
    max_size=80,
)


@settings(max_examples=300)
@given(live_steps, st.booleans())
def test_live_is_the_unexpired_non_leaving_entries_in_id_order(ops: list, random_evict: bool) -> None:
    """``live(t)`` (found from the expiry heap, not by a scan) equals a scan
    of the view's entries after any mix of merges (new, replaced with a
    shorter or longer TTL, tombstones, our own state, evictions of a full
    view), expiries, removals and questions about the present or the past;
    ``is_live(p, t)`` answers whether ``p`` is in it."""
    v = View("me", max_size=5, rng=random.Random(7) if random_evict else None)
    now = 0.0

    def scan(t: float) -> list[str]:
        return [p for p in v.peers() if not v.get(p).state.leaving and v.get(p).expires_at > t]  # type: ignore[union-attr]

    for dt, peer, seq, ttl, leaving, action in ops:
        now += dt
        if action == "merge":
            v.merge(peer, _state(seq, ttl, leaving), now - dt / 2, b"", now)
        elif action == "expire":
            v.expire(now)
        elif action == "remove":
            v.remove(peer)
        elif action == "ask-earlier":
            assert [e.peer for e in v.live(now - dt)] == scan(now - dt)
        assert [e.peer for e in v.live(now)] == scan(now)
        everyone = sorted(["me", "a", "b", "c", "d", "e", "f", "g"])  # in id order, as live() and scan()
        assert [p for p in everyone if v.is_live(p, now)] == scan(now)
