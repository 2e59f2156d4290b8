"""The pure verification rule (core.verdict.settle)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.verdict import ACCEPT, FAIL, WAIT, Candidate, settle
from fedswarm.core.wire import ShardResult


def _cand(peer: str, value: bytes, attempt: int = 0) -> Candidate:
    msg = ShardResult("j", 0, attempt, True, value, "", 1.0, 0.0, 0.0)
    return Candidate(peer, attempt, msg, b"raw-" + peer.encode())


def test_a_quorum_of_equal_results_wins_and_the_others_are_liars() -> None:
    cands = [_cand("a", b"x", 0), _cand("b", b"y", 1), _cand("c", b"x", 2)]
    v = settle(cands, set(), quorum=2, max_replicas=4)
    assert v.outcome == ACCEPT
    assert [c.peer for c in v.winner] == ["a", "c"] and [c.peer for c in v.liars] == ["b"]
    assert v.agreeing == ["a", "c"]


def test_a_trusted_peer_wins_alone_and_without_a_winner_the_shard_waits_then_fails() -> None:
    cands = [_cand("a", b"x"), _cand("t", b"y", 1)]
    v = settle(cands, {"t"}, quorum=2, max_replicas=3)
    assert v.outcome == ACCEPT and v.winner[0].peer == "t" and [c.peer for c in v.liars] == ["a"]
    assert settle(cands, set(), quorum=2, max_replicas=3).outcome == WAIT
    assert settle(cands, set(), quorum=2, max_replicas=2).outcome == FAIL
    assert settle(cands, set(), quorum=2, max_replicas=2).winner == ()


def test_of_two_winning_groups_the_larger_wins_then_the_first() -> None:
    cands = [_cand("a", b"x"), _cand("t", b"y", 1), _cand("b", b"x", 2)]
    assert settle(cands, {"t"}, quorum=2, max_replicas=5).winner[0].msg.result == b"x"
    tie = [_cand("t", b"y"), _cand("a", b"x", 1)]
    assert settle(tie, {"t", "a"}, quorum=9, max_replicas=5).winner[0].peer == "t"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([b"x", b"y", b"z"])), min_size=1, max_size=7),
       st.sets(st.sampled_from("abcdef")), st.integers(1, 4), st.integers(1, 8))
def test_a_verdict_splits_the_candidates_by_the_winning_value(
        picks: list[tuple[str, bytes]], trusted: set[str], quorum: int, max_replicas: int) -> None:
    cands = [_cand(p, v, i) for i, (p, v) in enumerate(picks)]
    v = settle(cands, trusted, quorum=quorum, max_replicas=max_replicas)
    if v.outcome != ACCEPT:
        assert v.winner == () and v.liars == ()
        assert v.outcome == (FAIL if len(cands) >= max_replicas else WAIT)
        return
    value = v.winner[0].msg.result
    assert len(v.winner) >= quorum or any(c.peer in trusted for c in v.winner)
    assert all(c.msg.result == value for c in v.winner)
    assert sorted(v.winner + v.liars, key=lambda c: c.attempt) == cands  # a partition, order kept
    assert all(c.msg.result != value for c in v.liars)
