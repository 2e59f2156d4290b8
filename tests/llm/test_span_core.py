"""The sans-IO serving core (``fedswarm.core.spans``): admission, the session
table, expiry, batch decisions and span placement, with no torch and no
clock (time is an argument; tensors are opaque handles)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.energy import PowerModel
from fedswarm.core.spans import (
    Admission,
    Advertise,
    DropSpan,
    LoadSpan,
    PlacementPolicy,
    Probe,
    ProbeDone,
    Refusal,
    ServerLimits,
    ServingCore,
    SetSpanLevel,
    SpanAd,
    SpanLoaded,
    SpanLoadFailed,
    auto_span_size,
    choose_span,
    layout_score,
    per_block,
    span_level,
)

BPP = 100  # cache bytes per position


def make(limits: ServerLimits | None = None, *, spans=((0, 2),), policy=None, self_id="me", layers=4) -> ServingCore:
    c = ServingCore(self_id, limits or ServerLimits(), max_length=64, max_tokens=8, num_layers=layers, policy=policy)
    for a, b in spans:
        c.add_span(0.0, a, b, bytes_per_pos=BPP, throughput=100.0)
    return c


def fwd(c: ServingCore, now=0.0, sender="a", sid=b"s" * 16, span=(0, 2), pos=0, t=1, ml=32):
    return c.admit_forward(now, sender, sid, span, pos, t, ml)


# -- admission and the session table -------------------------------------------------

def test_admission_order_and_codes():
    c = make(ServerLimits(max_sessions=2, max_cache_bytes=32 * BPP * 2 + 1))
    assert fwd(c, pos=3) == Refusal("unknown-session", "no such session (expired?): replay from position 0")
    assert fwd(c, ml=65).code == "too-large"
    a = fwd(c, t=4)
    assert isinstance(a, Admission) and a.created and a.refusal is None and a.session.busy
    # busy until finished; then the positions are the session's
    assert fwd(c, pos=4).refusal.code == "busy"
    c.finish(1.0, [a.session], [4], True)
    assert a.session.length == 4 and not a.session.busy
    r = fwd(c, pos=9).refusal
    assert (r.code, r.length) == ("pos-mismatch", 4)
    # created, then refused for its length (the protocol keeps the session)
    b = fwd(c, sid=b"b" * 16, t=5, ml=4)
    assert b.created and b.refusal.code == "too-large" and len(c.sessions) == 2
    assert fwd(c, sid=b"c" * 16).code == "full"
    assert c.close("a", b"b" * 16) and not c.close("a", b"b" * 16)
    c2 = make(ServerLimits(max_cache_bytes=32 * BPP + 1))
    assert isinstance(fwd(c2), Admission)
    assert fwd(c2, sid=b"x" * 16) == Refusal("full", "KV cache memory exhausted")
    assert c2.cache_bytes == 32 * BPP


def test_retry_rolls_back_and_sessions_are_per_sender_and_span():
    c = make(spans=((0, 2), (2, 4)))
    a = fwd(c, t=5)
    c.finish(0.0, [a.session], [5], True)
    a2 = fwd(c, pos=3)
    assert a2.session is a.session and a.session.length == 3
    c.finish(0.0, [a.session], [1], True)
    assert a.session.length == 4
    assert fwd(c, sender="b", pos=4).code == "unknown-session"
    # the same id on another span is another session; close frees both
    other = fwd(c, span=(2, 4))
    assert other.created and other.session is not a.session
    assert c.check_step("a", b"s" * 16, (2, 4), 0) == Refusal("busy", "a step of this session is running")
    assert c.close("a", b"s" * 16) and c.sessions == {} and c.cache_bytes == 0


def test_expiry_only_of_idle_sessions_not_computing():
    c = make(ServerLimits(idle_timeout_s=10.0))
    a = fwd(c, now=0.0, sid=b"a" * 16)
    b = fwd(c, now=0.0, sid=b"b" * 16)
    c.finish(0.0, [b.session], [1], True)
    assert c.expire(10.0) == 0  # not idle for longer than the timeout yet
    assert c.expire(11.0) == 1  # b; a is still computing
    assert list(c.sessions) == [("a", b"a" * 16, 0, 2)] and a.session.busy
    c.finish(11.0, [a.session], [1], True)
    assert c.expire(21.0) == 0 and c.expire(21.5) == 1 and c.stats.sessions_expired == 2


def test_expiry_scans_by_the_oldest_use_even_after_a_clock_that_went_back():
    """``expire`` skips the scan while no session can be idle long enough;
    a use stamped earlier than every other (a clock that went back), by a
    new session or by a step of an open one, must still expire on time."""
    c = make(ServerLimits(idle_timeout_s=10.0))
    a = fwd(c, now=100.0, sid=b"a" * 16)
    c.finish(100.0, [a.session], [1], True)
    assert c.expire(105.0) == 0
    b = fwd(c, now=50.0, sid=b"b" * 16)  # a new session, stamped before a
    c.finish(50.0, [b.session], [1], True)
    assert c.expire(60.5) == 1 and list(c.sessions) == [("a", b"a" * 16, 0, 2)]
    a2 = fwd(c, now=40.0, sid=b"a" * 16, pos=1)  # a step of a, stamped before its first
    assert a2.refusal is None
    c.finish(40.0, [a2.session], [1], True)
    assert c.expire(50.5) == 1 and c.sessions == {}


def test_batches_take_same_span_and_token_count_one_at_a_time():
    c = make(ServerLimits(max_batch=3), spans=((0, 2), (2, 4)))
    keys = {}
    for i, (span, t) in enumerate([((0, 2), 1), ((0, 2), 1), ((2, 4), 1), ((0, 2), 4), ((0, 2), 1), ((0, 2), 1)]):
        keys[i] = ("a", bytes([i]) * 16, *span)
        c.enqueue(i, keys[i], t)
    assert c.take_batch() == [0, 1, 4]  # max_batch 3, same span and T as the first
    assert c.take_batch() == []  # one forward at a time
    c.batch_done()
    assert c.take_batch() == [2]
    c.batch_done()
    c.cancel(3)
    assert c.take_batch() == [5] and c.queued == 0
    c.batch_done()
    # about max_tokens positions per forward: 3 + 3 + 3 (the check is before each append)
    c2 = make(ServerLimits(max_batch=10))
    for i in range(5):
        c2.enqueue(i, ("a", bytes([i]) * 16, 0, 2), 3)
    assert c2.take_batch() == [0, 1, 2]


OPS = st.lists(st.tuples(st.sampled_from(["fwd", "finish", "close", "expire", "tick"]), st.integers(0, 3),
                         st.integers(0, 3), st.integers(0, 40), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 4), st.integers(1, 120))
def test_table_invariants(ops, max_sessions, cache_positions):
    """Cache bytes are the sum of the open sessions' and never above the
    limit; sessions are keyed by their sender; expiry frees idle sessions only."""
    lim = ServerLimits(max_sessions=max_sessions, max_cache_bytes=cache_positions * BPP, idle_timeout_s=5.0)
    c = make(lim)
    now = 0.0
    owner: dict[tuple, str] = {}
    busy: list = []
    for op, who, sid, pos, n in ops:
        sender, sidb = f"c{who}", bytes([sid]) * 16
        if op == "fwd":
            r = fwd(c, now, sender, sidb, pos=pos, t=min(n, 8), ml=n)
            if isinstance(r, Admission):
                owner.setdefault(r.key, sender)
                if r.refusal is None:
                    busy.append((r.session, min(n, 8)))
        elif op == "finish" and busy:
            s, t = busy.pop(0)
            c.finish(now, [s], [t], True)
        elif op == "close":
            c.close(sender, sidb)
        elif op == "expire":
            before = {k: (s.busy, s.last_used) for k, s in c.sessions.items()}
            c.expire(now)
            for k, (was_busy, last) in before.items():
                assert (k in c.sessions) == (was_busy or now - last <= lim.idle_timeout_s)
        else:
            now += n / 4
        assert c.cache_bytes == sum(s.nbytes for s in c.sessions.values()) <= lim.max_cache_bytes
        assert len(c.sessions) <= max_sessions
        for k, s in c.sessions.items():
            assert k[0] == owner[k] and k[2:] == s.span and 0 <= s.length <= s.max_length


# -- placement -----------------------------------------------------------------------

def test_choose_span_least_served_window_and_spread():
    spans = [("p1", 0, 2, 100.0), ("p2", 0, 2, 100.0), ("p3", 2, 3, 50.0)]
    assert choose_span(spans, 4, 1, self_id="me") == (3, 4)
    # peers that see the same empty swarm do not all take the same window
    picks = {choose_span([], 8, 2, self_id=f"peer{i}") for i in range(20)}
    assert len(picks) >= 4


def test_layout_score_prefers_coverage_then_bottleneck():
    assert layout_score([1.0, 0.0]) > layout_score([0.5, 0.5])
    assert layout_score([2.0, 1.0, 9.0]) > layout_score([2.0, 2.0, 2.0])
    assert per_block([(0, 2, 1.0), (1, 3, 2.0)], 3) == [1.0, 3.0, 2.0]


def policy(**kw) -> PlacementPolicy:
    return PlacementPolicy(n_blocks=2, **kw)


def test_one_of_two_peers_that_see_the_same_gap_moves():
    """a and b both serve 0:2 and see blocks 2:4 uncovered: one moves now,
    the other only if the gap is still there after its patience."""
    cores = {p: make(policy=policy(), self_id=p) for p in ("a", "b")}
    view = [SpanAd("a", 0, 2, 100.0), SpanAd("b", 0, 2, 100.0)]
    first = {p: [e for e in c.poll(0.0, view) if isinstance(e, LoadSpan)] for p, c in cores.items()}
    movers = [p for p, effs in first.items() if effs]
    assert len(movers) == 1 and first[movers[0]] == [LoadSpan(2, 4)]
    waiter = cores[next(p for p in cores if p not in movers)]
    assert not [e for e in waiter.poll(2.0, view) if isinstance(e, LoadSpan)]
    # the mover failed to load: after its patience the other one goes
    assert [e for e in waiter.poll(6.0, view) if isinstance(e, LoadSpan)] == [LoadSpan(2, 4)]


def test_switch_loads_first_then_drains_the_old_span():
    c = make(policy=policy(drain_s=20.0))
    old = fwd(c, now=0.0)
    # x holds two spans (a fixed --blocks peer, not one that moves): we fill the gap
    fixed = [SpanAd("x", 0, 1, 90.0), SpanAd("x", 1, 2, 90.0)]
    effs = c.poll(0.0, [SpanAd("me", 0, 2, 100.0), *fixed])
    assert LoadSpan(2, 4) in effs and c.loading == (2, 4)
    # while loading the old span serves and nothing else is decided
    assert c.accepts((0, 2)) and not [e for e in c.poll(3.0, []) if isinstance(e, LoadSpan)]
    effs = c.handle(4.0, SpanLoaded(2, 4, 80.0, BPP, 0.5))
    assert effs == [Advertise(((2, 4, 80.0),))]  # the old span keeps its session, off the routes
    assert c.span_changes == 1 and c.primary == (2, 4) and c.accepts((0, 2))
    c.finish(5.0, [old.session], [1], True)
    assert fwd(c, now=5.0, pos=1).refusal is None  # the old session still steps
    c.finish(6.0, [old.session], [1], True)
    assert c.poll(7.0, []) == [] and c.spans[(0, 2)].draining
    c.close("a", b"s" * 16)
    assert DropSpan(0, 2) in c.poll(7.5, []) and not c.accepts((0, 2))


def test_drain_is_bounded_and_a_failed_load_keeps_the_old_span():
    c = make(policy=policy(drain_s=10.0))
    fwd(c, now=0.0)
    c.finish(0.0, list(c.sessions.values()), [1], True)
    fixed = [SpanAd("x", 0, 1, 90.0), SpanAd("x", 1, 2, 90.0)]
    assert LoadSpan(2, 4) in c.poll(0.0, fixed)
    assert c.handle(1.0, SpanLoadFailed(2, 4, "OSError")) == [] and c.loading is None and c.primary == (0, 2)
    assert LoadSpan(2, 4) in c.poll(2.0, fixed)
    c.handle(3.0, SpanLoaded(2, 4, 80.0, BPP))
    assert c.poll(12.0, []) == []
    assert DropSpan(0, 2) in c.poll(13.5, []) and c.sessions == {} and c.sessions_dropped == 1


def test_a_gap_moves_a_peer_again_while_its_old_span_drains():
    c = make(policy=policy(drain_s=100.0), layers=6)
    a = fwd(c, now=0.0)
    c.finish(0.0, [a.session], [1], True)
    x = [SpanAd("x", 0, 1, 90.0), SpanAd("x", 1, 2, 90.0)]  # fixed peers: two spans each
    y = [SpanAd("y", 4, 5, 90.0), SpanAd("y", 5, 6, 90.0)]
    z = [SpanAd("z", 2, 3, 90.0), SpanAd("z", 3, 4, 90.0)]
    assert LoadSpan(2, 4) in c.poll(0.0, x + y)
    c.handle(1.0, SpanLoaded(2, 4, 80.0, BPP))
    assert c.spans[(0, 2)].draining
    # y goes, z comes: blocks 4:6 are uncovered and only we can move there
    assert LoadSpan(4, 6) in c.poll(3.0, x + z)
    effs = c.handle(4.0, SpanLoaded(4, 6, 80.0, BPP))
    assert effs == [Advertise(((4, 6, 80.0),)), DropSpan(2, 4)]  # 2:4 had no sessions
    assert c.spans[(0, 2)].draining and c.span_changes == 2


def test_throughput_moves_need_min_gain_and_dwell():
    # we hold 0:2 beside a fast fixed peer; 2:4 has one slow peer: moving triples the bottleneck
    view = [SpanAd("p", 0, 1, 300.0), SpanAd("p", 1, 2, 300.0), SpanAd("r", 2, 4, 50.0)]
    c = make(policy=policy(min_dwell_s=30.0, min_gain=1.5))
    assert not [e for e in c.poll(10.0, view) if isinstance(e, LoadSpan)]  # held for 10 s only
    assert [e for e in c.poll(31.0, view) if isinstance(e, LoadSpan)] == [LoadSpan(2, 4)]
    # a gain below min_gain: no move however long it waits
    c2 = make(policy=policy(min_gain=1.5))
    view2 = [SpanAd("p", 0, 2, 100.0), SpanAd("r", 2, 4, 90.0)]
    assert not [e for e in c2.poll(100.0, view2) if isinstance(e, LoadSpan)]


def test_probes_round_robin_and_two_failures_make_a_holder_gone():
    c = make(policy=policy(max_probes=2, suspect_after=2))
    view = [SpanAd("b", 2, 4, 100.0), SpanAd("c", 2, 4, 100.0), SpanAd("d", 2, 4, 100.0)]
    probes = [e for e in c.poll(0.0, view) if isinstance(e, Probe)]
    assert [p.peer for p in probes] == ["b", "c"]
    for p in probes:
        c.handle(0.5, ProbeDone(p.peer, True))
    assert [e.peer for e in c.poll(2.0, view) if isinstance(e, Probe)] == ["d", "b"]
    # d dies: two failed probes and its span no longer counts (x, fixed, holds 0:2 too)
    view = [SpanAd("x", 0, 1, 90.0), SpanAd("x", 1, 2, 90.0), SpanAd("d", 2, 4, 100.0)]
    c = make(policy=policy())
    c.poll(0.0, view)
    c.handle(0.1, ProbeDone("x", True))
    c.handle(0.1, ProbeDone("d", False))
    assert not c.gone("d") and not [e for e in c.poll(2.0, view) if isinstance(e, LoadSpan)]
    c.handle(2.1, ProbeDone("d", False))
    assert c.gone("d")
    assert [e for e in c.poll(4.0, view) if isinstance(e, LoadSpan)] == [LoadSpan(2, 4)]
    c.handle(4.5, ProbeDone("d", True))
    assert not c.gone("d")


# -- a swarm of cores in virtual time ----------------------------------------------------

class Sim:
    """Auto-placing cores with exact views: a load takes ``load_s``, a probe of
    a dead peer fails, an advertised span is seen by all at the next tick."""

    def __init__(self, layers: int, seed: int, load_s: float = 0.5) -> None:
        self.layers = layers
        self.rng = random.Random(seed)
        self.load_s = load_s
        self.cores: dict[str, ServingCore] = {}
        self.ads: dict[str, tuple[int, int, float]] = {}
        self.alive: set[str] = set()
        self.loads: list[tuple[float, str, LoadSpan]] = []
        self.t = 0.0

    def view(self) -> list[SpanAd]:
        return [SpanAd(p, a, b, thr) for p, (a, b, thr) in sorted(self.ads.items())]

    def join(self, peer: str, n: int) -> None:
        thr = self.rng.uniform(80.0, 120.0)
        a, b = choose_span([(x.peer, x.start, x.end, x.throughput) for x in self.view() if x.peer in self.alive],
                           self.layers, n, self_id=peer)
        c = ServingCore(peer, max_length=64, max_tokens=8, num_layers=self.layers, policy=PlacementPolicy(n_blocks=n))
        c.add_span(self.t, a, b, bytes_per_pos=BPP, throughput=thr)
        self.cores[peer] = c
        self.ads[peer] = (a, b, thr)
        self.alive.add(peer)

    def kill(self, peer: str) -> None:
        self.alive.discard(peer)  # its state stays in the view (the TTL has not run out)

    def perform(self, peer: str, effs: list) -> None:
        c = self.cores[peer]
        for e in effs:
            if isinstance(e, LoadSpan):
                self.loads.append((self.t + self.load_s, peer, e))
            elif isinstance(e, Probe):
                c.handle(self.t, ProbeDone(e.peer, e.peer in self.alive))
            elif isinstance(e, Advertise):
                (a, b, thr), = e.spans
                self.ads[peer] = (a, b, thr)

    def run(self, until: float, dt: float = 0.5) -> None:
        while self.t < until:
            self.t += dt
            for at, peer, e in [x for x in self.loads if x[0] <= self.t]:
                self.loads.remove((at, peer, e))
                if peer in self.alive:
                    thr = self.rng.uniform(80.0, 120.0)
                    self.perform(peer, self.cores[peer].handle(self.t, SpanLoaded(e.start, e.end, thr, BPP, self.load_s)))
            for peer in sorted(self.alive):
                self.perform(peer, self.cores[peer].poll(self.t, self.view()))

    def covered(self) -> bool:
        return all(x > 0 for x in per_block((self.ads[p] for p in self.alive), self.layers))


@pytest.mark.parametrize("seed", range(6))
def test_sim_four_auto_peers_recover_after_kills(seed):
    """Four peers of 2 blocks on a 4-block model, started one after another,
    cover every block; after a kill, and after a second kill that leaves a
    gap, the survivors cover it again, each changing span at most twice."""
    sim = Sim(4, seed)
    for i in range(4):
        sim.join(f"peer{i}", 2)
        sim.run(sim.t + 3.0)
    sim.run(sim.t + 40.0)
    assert sim.covered()
    changes0 = {p: c.span_changes for p, c in sim.cores.items()}
    sim.kill(sorted(sim.alive)[seed % 4])
    sim.run(sim.t + 30.0)
    assert sim.covered()
    # a second kill that leaves a gap: the holder of a block nobody else serves
    lone = [p for p in sorted(sim.alive)
            if not per_block((sim.ads[q] for q in sim.alive if q != p), 4).count(0.0) == 0]
    assert lone  # three peers of 2 blocks on 4 blocks: some block has one holder
    sim.kill(lone[0])
    assert not sim.covered()
    t_kill = sim.t
    while not sim.covered() and sim.t < t_kill + 30.0:
        sim.run(sim.t + 0.5)
    assert sim.covered(), sim.ads
    assert sum(sim.cores[p].span_changes - changes0[p] for p in sim.alive) >= 1  # someone moved into the gap
    for p in sim.alive:
        assert sim.cores[p].span_changes - changes0[p] <= 2
    # and then it stays put
    before = {p: sim.cores[p].span_changes for p in sim.alive}
    sim.run(sim.t + 120.0)
    assert {p: sim.cores[p].span_changes for p in sim.alive} == before


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(1, 4), st.integers(2, 7), st.integers(0, 10_000))
def test_sim_survivors_cover_when_they_can(layers, n, peers, seed):
    n = min(n, layers)
    sim = Sim(layers, seed)
    for i in range(peers):
        sim.join(f"p{i}", n)
        sim.run(sim.t + 3.0)
    sim.run(sim.t + 30.0)
    base = {p: c.span_changes for p, c in sim.cores.items()}
    sim.kill(f"p{seed % peers}")
    sim.run(sim.t + 40.0)
    if peers - 1 >= -(-layers // n):  # enough blocks among the survivors
        assert sim.covered(), (layers, n, sim.ads)
    assert all(sim.cores[p].span_changes - base[p] <= 2 for p in sim.alive)


def test_auto_span_size_half_the_model_or_what_fits():
    assert auto_span_size(32, 100, 1 << 40) == 16
    assert auto_span_size(32, 100, 2_000, cache_bytes=500) == 5  # (1000 - 500) // 100
    assert auto_span_size(32, 100, 100) == 1  # at least one block
    assert auto_span_size(4, 0, 0) == 2  # nothing known: half


# -- routes: spans whose boundaries meet ---------------------------------------------

def test_a_peer_moves_to_join_spans_whose_boundaries_do_not_meet():
    """Blocks 0..7 all held by 0-4, 3-5 and 5-8, but no span starts at 4: no
    chain. The spare holder of block 6 moves to 4-5, which joins them."""
    pol = PlacementPolicy(n_blocks=1, tick_s=1.0, patience_s=1.0)
    me = make(spans=((6, 7),), policy=pol, layers=8)
    swarm = [SpanAd("a", 0, 4, 50.0), SpanAd("b", 3, 5, 50.0), SpanAd("c", 5, 8, 50.0), SpanAd("me", 6, 7, 50.0)]
    out = me.poll(100.0, swarm)
    assert LoadSpan(4, 5) in out
    assert me.decisions[-1]["why"]["need"] == "route"
    # once the chain exists nobody moves for it
    swarm2 = [*swarm[:3], SpanAd("me", 4, 5, 50.0)]
    other = make(spans=((6, 7),), policy=pol, self_id="d", layers=8)
    assert not [e for e in other.poll(100.0, [*swarm2, SpanAd("d", 6, 7, 50.0)]) if isinstance(e, LoadSpan)]


# -- energy: the clock level of a span -------------------------------------------------

POWER = PowerModel(idle_w=60.0, max_w=400.0, alpha=2.5, levels=(0.6, 0.8, 1.0))


def test_span_level_is_the_least_energy_level_that_meets_demand():
    # u = demand / f must stay <= LEVEL_HEADROOM (0.5); among those, least mean power
    assert span_level(POWER, 0.0, saturated=False) == 0.6
    assert span_level(POWER, 0.25, saturated=False) == 0.6  # u = 0.42
    assert span_level(POWER, 0.35, saturated=False) == 0.8  # 0.6 would be busy 58% of the time
    assert span_level(POWER, 0.45, saturated=False) == 1.0
    assert span_level(POWER, 0.9, saturated=False) == 1.0  # none keeps up with headroom: full clock
    assert span_level(POWER, 0.0, saturated=True) == 1.0  # steps waited for a batch: full clock
    capped = PowerModel(idle_w=60.0, max_w=400.0, alpha=2.5, cap_w=300.0, levels=(0.6, 0.8, 1.0))
    assert span_level(capped, 0.9, saturated=True) == 0.8  # the fastest level under the cap
    # a linear curve saves nothing by slowing down: the tie goes to the faster level
    assert span_level(PowerModel(idle_w=10.0, max_w=100.0, alpha=1.0, levels=(0.5, 1.0)), 0.1, saturated=False) == 1.0
    # the chosen level's mean power is never above full clock's
    for d in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5):
        f = span_level(POWER, d, saturated=False)
        mean = lambda x: d / x * POWER.power(x) + (1 - d / x) * POWER.idle_w  # noqa: E731
        assert mean(f) <= mean(1.0) + 1e-9


def test_serving_core_chooses_its_level_from_demand_and_waiting_steps():
    lim = ServerLimits(max_batch=1)
    c = make(lim)
    c.power = POWER
    c.level_every_s = 2.0
    assert c.poll(0.0) == [SetSpanLevel(0.6)] and c.level == 0.6  # idle: the lowest level
    assert c.energy_state(0.0)["level"] == 0.6 and c.next_deadline() == 2.0
    assert c.poll(1.0) == []  # not yet time to decide again
    for t in range(2, 32):  # forwards that keep the device 70% busy at full clock
        c.record_forward(float(t), 0.7)
    assert 0.4 < c.demand(32.0) < 0.7  # decayed over LEVEL_TAU_S (30 s): 0.435
    assert c.poll(32.0) == [SetSpanLevel(1.0)]
    # idle again for long: back down, unless steps waited for a batch since the last decision
    assert c.poll(300.0) == [SetSpanLevel(0.6)]
    k = (("a", b"s" * 16, 0, 2))
    for i in range(3):
        c.enqueue(f"step{i}", k, 1)
    assert c.take_batch() == ["step0"]
    c.batch_done()
    while c.take_batch():
        c.batch_done()
    out = c.poll(302.0)
    assert out == [SetSpanLevel(1.0)] and c.level_changes == 4
    # without a power model the level stays put and no effect comes out
    plain = make()
    assert plain.poll(0.0) == [] and plain.level == 1.0


def test_a_move_for_throughput_that_would_leave_no_chain_is_not_made():
    """Moving 2-4 onto 0-2 would lift the bottleneck (block 0: 10 -> 110
    tokens/s) and keep every block held, but no span would start at 2."""
    pol = PlacementPolicy(n_blocks=2, tick_s=1.0)
    swarm = [SpanAd("a", 0, 2, 10.0), SpanAd("b", 1, 3, 100.0), SpanAd("c", 3, 4, 100.0)]
    me = make(spans=((2, 4),), policy=pol, layers=4)
    for t in (100.0, 110.0):  # not now, and not after waiting its turn either
        assert not [e for e in me.poll(t, [*swarm, SpanAd("me", 2, 4, 100.0)]) if isinstance(e, LoadSpan)]
    # with a span from 2 to 3 as well the same move keeps a chain (0-2, 2-3,
    # 3-4) and is made, once b (whose move would be better) had its turn
    me2 = make(spans=((2, 4),), policy=pol, layers=4)
    swarm2 = [*swarm, SpanAd("d", 2, 3, 100.0), SpanAd("me", 2, 4, 100.0)]
    assert not [e for e in me2.poll(100.0, swarm2) if isinstance(e, LoadSpan)]
    assert LoadSpan(0, 2) in me2.poll(110.0, swarm2)
