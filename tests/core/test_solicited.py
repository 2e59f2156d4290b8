"""Replies a node asked for pass its rate limit, and no more than that."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.node import SOLICITED_TTL_S, Solicited, replies_invited
from fedswarm.core.wire import Bid, LeaseAck, LeaseAckBatch

SENDERS = ("a", "b", "c")
ops = st.lists(
    st.tuples(st.sampled_from(("grant", "take")), st.sampled_from(SENDERS), st.integers(0, 7),
              st.floats(0.0, 2 * SOLICITED_TTL_S)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_a_sender_never_gets_past_more_than_it_was_asked_for(script: list[tuple[str, str, int, float]]) -> None:
    cap = 10
    s = Solicited(cap, max_senders=2)
    now = 0.0
    owed = {p: 0 for p in SENDERS}  # the model: replies asked for, not yet had, not expired
    until = {p: -1.0 for p in SENDERS}
    for op, who, n, dt in script:
        now += dt
        for p in SENDERS:
            if until[p] < now:
                owed[p] = 0
        if op == "grant":
            s.grant(who, n, now)
            if n > 0:
                owed[who] = min(owed[who] + n, cap)
                until[who] = now + SOLICITED_TTL_S
        else:
            took = s.take(who, now)
            # forgetting a sender (max_senders) may only refuse, never admit more
            assert took <= (owed[who] > 0)
            if took:
                owed[who] -= 1
        assert all(s.owed(p, now) <= owed[p] for p in SENDERS)


def test_credit_expires_and_is_capped() -> None:
    s = Solicited(3)
    s.grant("a", 5, 0.0)
    assert [s.take("a", 1.0) for _ in range(4)] == [True, True, True, False]
    s.grant("a", 2, 1.0)
    assert not s.take("a", 1.0 + SOLICITED_TTL_S + 0.1) and s.owed("a", 2.0) == 2
    assert not s.take("b", 0.0)


def test_what_each_message_asks_for() -> None:
    bid = Bid("j", 0, (1, 2, 3), 0.0, 1.0, 1, 1.0, 1.0, 0.0, "")
    assert replies_invited(bid) == 3
    assert replies_invited(LeaseAck("j", 0, 0, True, 8.0)) == 1
    assert replies_invited(LeaseAck("j", 0, 0, False, 0.0)) == 0
    assert replies_invited(LeaseAckBatch((LeaseAck("j", 0, 0, True, 8.0), LeaseAck("j", 1, 0, False, 0.0)))) == 1
