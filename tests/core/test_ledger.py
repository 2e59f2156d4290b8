"""The tenant ledger is a CRDT: merge is commutative, associative, idempotent."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.ledger import Ledger

events = st.lists(
    st.tuples(st.sampled_from(["p1", "p2", "p3"]), st.sampled_from(["t1", "t2"]), st.floats(0.001, 1e4), st.floats(0, 1e5)),
    max_size=12,
)


def build(evts) -> Ledger:
    led = Ledger(tau_s=3600)
    for peer, tenant, w, t in evts:
        led.add(peer, tenant, w, t)
    return led


def merged(*ls: Ledger) -> Ledger:
    out = Ledger(tau_s=3600)
    for led in ls:
        out.merge(led)
    return out


@settings(max_examples=200)
@given(events, events, events)
def test_merge_laws(a, b, c) -> None:
    # each peer only writes its own entries: split the events by peer
    A, B, C = build(a), build(b), build(c)
    assert merged(A, B) == merged(B, A)
    assert merged(merged(A, B), C) == merged(A, merged(B, C))
    assert merged(A, A) == merged(A)


@settings(max_examples=100)
@given(events)
def test_rows_replicate_the_whole_ledger(evts) -> None:
    src = build(evts)
    dst = Ledger(tau_s=3600)
    for peer in ("p1", "p2", "p3"):
        dst.merge_row(peer, src.row(peer, limit=100))
        dst.merge_row(peer, src.row(peer, limit=100))  # duplicates are harmless
    assert dst == src


def test_decay_and_shares() -> None:
    led = Ledger(tau_s=100.0)
    led.add("p", "a", 10.0, now=0.0)
    led.add("q", "b", 10.0, now=100.0)
    u = led.usage(now=100.0)
    assert math.isclose(u["a"], 10.0 * math.exp(-1.0), rel_tol=1e-9)
    assert math.isclose(u["b"], 10.0, rel_tol=1e-9)
    s = led.shares(now=100.0)
    assert math.isclose(s["a"] + s["b"], 1.0)
    assert s["b"] > s["a"]


def test_unix_time_does_not_overflow() -> None:
    led = Ledger(tau_s=3600.0)
    now = 1.8e9
    led.add("p", "a", 5.0, now)
    led.add("p", "a", 5.0, now)
    assert math.isclose(led.usage(now)["a"], 10.0, rel_tol=1e-6)
