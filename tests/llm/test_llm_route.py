"""The client's sans-IO routing core (fedswarm.core.llm_route): routes, bans,
and one step's walk along a chain, driven here without torch or trio."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.llm_route import (
    Chain,
    Done,
    GiveUp,
    Hop,
    HopOutput,
    NeedRoute,
    RouteBook,
    Send,
    StepPlan,
    find_route,
)

L = 4


def reachable(hops, start, end, exclude):
    seen, todo = {start}, [start]
    while todo:
        b = todo.pop()
        for h in hops:
            if h.start == b and h.peer not in exclude and h.end <= end and h.end not in seen:
                seen.add(h.end)
                todo.append(h.end)
    return end in seen


hop_lists = st.lists(
    st.builds(lambda p, a, n, thr: Hop(f"p{p}", a, min(L, a + n), thr),
              st.integers(0, 5), st.integers(0, L - 1), st.integers(1, L), st.floats(0.5, 100.0)),
    max_size=10,
)


@settings(max_examples=200, deadline=None)
@given(hop_lists, st.sets(st.sampled_from([f"p{i}" for i in range(6)]), max_size=3))
def test_route_is_a_contiguous_chain_without_excluded_peers(hops, exclude):
    r = find_route(hops, 0, L, exclude=exclude)
    assert (r is not None) == reachable(hops, 0, L, exclude)
    if r is not None:
        assert r[0].start == 0 and r[-1].end == L
        assert all(a.end == b.start for a, b in zip(r, r[1:]))
        assert not {h.peer for h in r} & exclude
        assert find_route(list(reversed(hops)), 0, L, exclude=exclude) == r  # deterministic


def test_bans_expire_and_round_trips_steer_routes():
    a, b = Hop("a", 0, L, 10.0), Hop("b", 0, L, 10.0)
    book = RouteBook(ban_s=5.0)
    assert book.route([a, b], 0, L, now=0.0) == [a]  # a tie: peer ids decide
    book.observe("a", 0.5)
    book.observe("b", 0.01)
    assert book.route([a, b], 0, L, now=0.0) == [b]
    book.ban("b", now=1.0)
    assert book.route([a, b], 0, L, now=5.9) == [a]
    assert "b" not in book.rtt  # a banned peer's round trip is forgotten
    # the ban is over; unmeasured again, b costs 1/throughput + 2 ms (0.102 s) < a's 0.5 s
    assert book.route([a, b], 0, L, now=6.0) == [b] and book.excluded(6.0) == set()


def test_a_forwarded_step_feeds_every_hop_of_its_chain():
    """The last peer's answer covers the chain: the first hop is measured by
    its own answer, the rest of the time is split over the later hops in
    proportion to what the book expected of them."""
    a, b, c = Hop("a", 0, 1, 100.0), Hop("b", 1, 3, 100.0), Hop("c", 3, L, 100.0)
    book = RouteBook()
    book.observe("b", 0.010)
    book.observe("c", 0.030)
    book.observe_chain([a, b, c], 0.050, first=0.012)
    assert book.rtt["a"] == pytest.approx(0.012)  # unmeasured before: the answer itself
    # 38 ms left, split 1:3 as b and c were expected (10 and 30 ms), each an EWMA step
    assert book.rtt["b"] == pytest.approx(0.8 * 0.010 + 0.2 * 0.0095)
    assert book.rtt["c"] == pytest.approx(0.8 * 0.030 + 0.2 * 0.0285)
    # unmeasured hops are expected at 1/throughput + the default latency: an even split here
    fresh = RouteBook()
    fresh.observe_chain([a, b], 0.030)
    assert fresh.rtt == {"a": pytest.approx(0.015), "b": pytest.approx(0.015)}
    # an output that came no later than the first hop's answer: the whole time is split
    late = RouteBook()
    late.observe_chain([a, b], 0.020, first=0.025)
    assert late.rtt == {"a": pytest.approx(0.010), "b": pytest.approx(0.010)}
    # nothing measured, nothing learnt
    late.observe_chain([a, b], 0.0, first=0.0)
    assert late.rtt == {"a": pytest.approx(0.010), "b": pytest.approx(0.010)}


def drive(plan, answer):
    """Run a plan to the end; ``answer(act)`` says how each Send goes:
    "ok", ("resync", length) or "fail". Returns the actions seen."""
    seen = []
    for _ in range(1000):
        act = plan.next()
        seen.append(act)
        if isinstance(act, Done):
            return seen
        if isinstance(act, NeedRoute):
            r = plan.book.route(plan.hops(), act.start, L, now=0.0)
            assert r is not None
            plan.chain.set_tail(act.start, r)
        elif isinstance(act, Send):
            how = answer(act)
            if how == "ok":
                plan.sent(act.hop, act.hi - act.lo)
            elif how == "fail":
                plan.failed(act.hop, "gone", now=0.0)
            else:
                plan.resync(act.hop, how[1], have=act.lo, now=0.0)
        else:
            assert isinstance(act, HopOutput)
            plan.accept(act.hop)
    raise AssertionError("the plan did not finish")


def test_a_step_walks_every_hop_in_chunks():
    hops = [Hop("a", 0, 2, 1.0), Hop("b", 2, L, 1.0)]
    chain = Chain(L)
    plan = StepPlan(chain, RouteBook(), lambda: hops, 0, 5, max_chunk=2)
    seen = drive(plan, lambda act: "ok")
    sends = [(a.hop.hop.peer, a.lo, a.hi) for a in seen if isinstance(a, Send)]
    assert sends == [("a", 0, 2), ("a", 2, 4), ("a", 4, 5), ("b", 0, 2), ("b", 2, 4), ("b", 4, 5)]
    assert [h.pos for h in chain.hops] == [5, 5] and [h.pos_before for h in chain.hops] == [0, 0]
    # the next step sends only the new position
    plan = StepPlan(chain, plan.book, lambda: hops, 5, 6, max_chunk=2)
    sends = [(a.hop.hop.peer, a.lo, a.hi) for a in drive(plan, lambda act: "ok") if isinstance(a, Send)]
    assert sends == [("a", 5, 6), ("b", 5, 6)]
    assert [h.pos_before for h in chain.hops] == [5, 5]


def test_a_failed_hop_gets_a_detour_over_its_blocks_and_later_hops_keep_their_caches():
    hops = [Hop("a", 0, 2, 1.0), Hop("b", 2, L, 1.0), Hop("c", 0, 2, 0.5)]
    chain = Chain(L)
    book = RouteBook()
    drive(StepPlan(chain, book, lambda: hops, 0, 3, max_chunk=8), lambda act: "ok")
    assert [h.hop.peer for h in chain.hops] == ["a", "b"]
    b_state = chain.hops[1]
    plan = StepPlan(chain, book, lambda: hops, 3, 4, max_chunk=8)
    seen = drive(plan, lambda act: "fail" if act.hop.hop.peer == "a" else "ok")
    assert [h.hop.peer for h in chain.hops] == ["c", "b"] and chain.hops[1] is b_state
    # the replacement is replayed from position 0; b only gets the new position
    sends = [(a.hop.hop.peer, a.lo, a.hi) for a in seen if isinstance(a, Send)]
    assert sends == [("a", 3, 4), ("c", 0, 4), ("b", 3, 4)]
    assert "a" in book.excluded(0.0) and plan.recoveries[0]["failed"] == "a"
    assert [h.hop.peer for h in chain.take_stale()] == ["a"]


def test_a_failed_hop_without_a_detour_restarts_from_an_earlier_boundary():
    hops = [Hop("a", 0, 2, 1.0), Hop("b", 2, L, 1.0), Hop("c", 0, L, 0.1)]
    chain = Chain(L)
    book = RouteBook()
    book.observe("c", 9.0)  # c is slow: the first chain is a -> b
    drive(StepPlan(chain, book, lambda: hops, 0, 2, max_chunk=8), lambda act: "ok")
    assert [h.hop.peer for h in chain.hops] == ["a", "b"]
    plan = StepPlan(chain, book, lambda: hops, 2, 3, max_chunk=8)
    seen = drive(plan, lambda act: "fail" if act.hop.hop.peer == "b" else "ok")
    # nobody else starts at block 2, so the chain restarts at 0 on c (replaying every position)
    assert [h.hop.peer for h in chain.hops] == ["c"]
    sends = [(a.hop.hop.peer, a.lo, a.hi) for a in seen if isinstance(a, Send)]
    assert sends == [("a", 2, 3), ("b", 2, 3), ("c", 0, 3)]
    assert not any(isinstance(a, NeedRoute) for a in seen)
    # with nobody at all, the shell is asked to wait for a chain from the failed hop
    plan = StepPlan(Chain(L), RouteBook(), lambda: [], 0, 1, max_chunk=8)
    assert plan.next() == NeedRoute(0)


def test_resync_rewinds_to_what_the_peer_and_the_session_hold():
    hops = [Hop("a", 0, L, 1.0)]
    chain = Chain(L)
    drive(StepPlan(chain, RouteBook(), lambda: hops, 0, 6, max_chunk=8), lambda act: "ok")
    plan = StepPlan(chain, RouteBook(), lambda: hops, 6, 7, max_chunk=8)
    answers = iter([("resync", 0), "ok"])  # the peer lost the session: replay from 0
    seen = drive(plan, lambda act: next(answers))
    sends = [(a.lo, a.hi) for a in seen if isinstance(a, Send)]
    assert sends == [(6, 7), (0, 7)]
    assert [a.lo for a in seen if isinstance(a, HopOutput)] == [0]


def test_resyncs_and_failures_are_bounded():
    hops = [Hop("a", 0, L, 1.0), Hop("b", 0, L, 1.0)]
    chain = Chain(L)
    drive(StepPlan(chain, RouteBook(), lambda: hops, 0, 2, max_chunk=8), lambda act: "ok")
    plan = StepPlan(chain, RouteBook(), lambda: hops, 2, 3, max_chunk=8)
    # a peer that always says it holds 1 position: after 3 resyncs it counts as failed
    answers = iter([("resync", 1)] * 4 + ["ok"] * 10)
    drive(plan, lambda act: next(answers))
    assert plan.recoveries and "cannot resync" in plan.recoveries[0]["reason"]
    plan = StepPlan(Chain(L), RouteBook(ban_s=0.0), lambda: hops, 0, 1, max_chunk=8, max_attempts=3)
    with pytest.raises(GiveUp):
        drive(plan, lambda act: "fail")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["ok", "ok", "ok", "fail", "r0", "r1"]), min_size=1, max_size=40),
       st.integers(1, 6), st.integers(1, 4))
def test_any_mix_of_answers_ends_with_every_block_covered(script, t, chunk):
    """Whatever the peers answer, a plan that finishes leaves a contiguous
    chain 0 -> L whose every hop holds every position of the step, and it
    never asks for positions outside [0, upto)."""
    hops = [Hop("a", 0, 2, 1.0), Hop("b", 2, L, 1.0), Hop("c", 0, 2, 1.0), Hop("d", 0, L, 1.0)]
    chain = Chain(L)
    drive(StepPlan(chain, RouteBook(ban_s=0.0), lambda: hops, 0, 2, max_chunk=chunk), lambda act: "ok")
    plan = StepPlan(chain, RouteBook(ban_s=0.0), lambda: hops, 2, 2 + t, max_chunk=chunk, max_attempts=10**6)
    answers = iter(script)

    def answer(act):
        assert 0 <= act.lo < act.hi <= 2 + t and act.hi - act.lo <= chunk
        how = next(answers, "ok")
        return {"r0": ("resync", 0), "r1": ("resync", 1)}.get(how, how)

    drive(plan, answer)
    assert chain.hops[0].hop.start == 0 and chain.hops[-1].hop.end == L
    assert all(x.hop.end == y.hop.start for x, y in zip(chain.hops, chain.hops[1:]))
    assert all(h.pos == 2 + t for h in chain.hops)


def test_a_peer_that_moved_loses_that_span_only():
    """wrong-span (the peer moved to other blocks) retires that hop, not the
    peer: its new span stays usable while the view still shows the old one."""
    old, new, other = Hop("a", 0, 2, 9.0), Hop("a", 2, L, 9.0), Hop("c", 0, 2, 1.0)
    hops = [old, new, other]
    chain = Chain(L)
    book = RouteBook()
    plan = StepPlan(chain, book, lambda: hops, 0, 1, max_chunk=8)
    act = plan.next()
    assert act == NeedRoute(0)
    chain.set_tail(0, book.route(hops, 0, L, now=0.0))
    assert [h.hop for h in chain.hops] == [old, new]
    act = plan.next()
    plan.failed(act.hop, "wrong-span", now=0.0, moved=True)
    assert [h.hop for h in chain.hops] == [other, new]  # a detour over 0:2; a keeps serving 2:4
    assert book.excluded(0.0) == set() and ("a", 0, 2) in book.retired
    assert book.route(hops, 0, L, now=book.ban_s + 1.0) == [old, new]  # retired until the view caught up
