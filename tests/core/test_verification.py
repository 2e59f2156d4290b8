"""Results from untrusted peers are verified by redundant execution."""

from __future__ import annotations

import pytest

from fedswarm.core import client_core
from fedswarm.core.client_core import JobRequest
from fedswarm.core.config import ClientConfig
from fedswarm.core.identity import Identity
from fedswarm.core.membership import check_membership, issue_membership
from helpers import MiniSwarm


def run(s: MiniSwarm, shards: int, **client_kw) -> tuple[str, object]:
    c = s.add_client(**client_kw)
    s.step_until(s.now + 5)
    jid = s.submit(c, JobRequest("sim", shards, work_s=2.0))
    s.step_until(s.now + 5000, stop=lambda: jid in s.finished)
    return jid, c


@pytest.mark.parametrize("rate", [0.2, 1.0])
def test_liar_is_caught_and_no_wrong_result_is_delivered(rate: float) -> None:
    s = MiniSwarm(8, seed=11, liars={3: rate}, trusted=(0,))
    s.step_until(s.now + 10)
    jid, c = run(s, 160, verify="always")
    assert s.finished[jid].ok
    results = {d.shard: d.result for d in s.delivered if d.job_id == jid}
    assert results == {i: b"r%d" % i for i in range(160)}
    liar = [p for p in s.peers if s.liar_ids.get(p)][0]
    # the liar runs about 20 of 160 shards: at 0.2, no lie at all has odds
    # of about 1 in 100 for a placement (80 shards gave it 10 and no lie)
    assert s.lies >= 1
    assert liar in c.banned
    assert c.stats["liars_caught"] >= 1


def test_accusation_with_trusted_witness_spreads_the_ban() -> None:
    s = MiniSwarm(8, seed=12, liars={3: 1.0}, trusted=(0, 1))
    s.step_until(s.now + 10)
    jid, c = run(s, 30, verify="always")
    assert s.finished[jid].ok
    liar = [p for p in s.peers if s.liar_ids.get(p)][0]
    assert c.stats["liars_caught"] == 1  # caught once, however many shards it held
    honest = [p for p in s.peers if p != liar]
    assert all(liar in s.peers[p].banned for p in honest)
    assert all(s.peers[p].stats["accusations_accepted"] == 1 for p in honest)


def test_accusation_without_a_trusted_witness_is_not_believed() -> None:
    # a tenant and its sybils could frame an honest peer: no trusted witness, no ban
    s = MiniSwarm(6, seed=15, liars={2: 1.0}, trusted=())
    s.step_until(s.now + 10)
    jid, c = run(s, 20, verify="always")
    assert s.finished[jid].ok
    liar = [p for p in s.peers if s.liar_ids.get(p)][0]
    assert liar in c.banned  # the tenant saw it lie against a quorum
    honest = [p for p in s.peers if p != liar]
    assert not any(liar in s.peers[p].banned for p in honest)
    assert sum(s.peers[p].stats["accusations_unwitnessed"] for p in honest) >= 1


def test_trusted_peers_are_not_double_checked() -> None:
    s = MiniSwarm(5, seed=13, trusted=(0, 1, 2, 3, 4))
    s.step_until(s.now + 10)
    jid, c = run(s, 20, verify="always")
    assert s.finished[jid].ok
    assert c.stats["verifications"] == 0


def test_reputation_lowers_the_check_rate() -> None:
    s = MiniSwarm(4, seed=14)
    s.step_until(s.now + 10)
    jid, c = run(s, 120, verify="auto", verify_trust_after=10.0, verify_min_rate=0.1)
    assert s.finished[jid].ok
    # early results are all checked, later ones mostly not
    assert 0 < c.stats["verifications"] < 120
    assert c.stats["results_unchecked"] > 0


def test_membership_certificates() -> None:
    fed = Identity.from_seed(b"f" * 32)
    peer = Identity.from_seed(b"p" * 32)
    other = Identity.from_seed(b"o" * 32)
    cert = issue_membership(fed, peer.peer_id, expiry=100.0)
    feds = frozenset({fed.peer_id})
    assert check_membership(cert, peer.peer_id, 50.0, feds)
    assert not check_membership(cert, peer.peer_id, 150.0, feds)  # expired
    assert not check_membership(cert, other.peer_id, 50.0, feds)  # someone else's
    assert not check_membership(cert, peer.peer_id, 50.0, frozenset())  # unknown federation
    assert not check_membership(cert[:-1] + b"x", peer.peer_id, 50.0, feds)
    assert not check_membership(b"\xc1garbage", peer.peer_id, 50.0, feds)
    assert not check_membership(issue_membership(other, peer.peer_id, 100.0), peer.peer_id, 50.0, feds)


def test_client_config_validates_verification_knobs() -> None:
    with pytest.raises(ValueError):
        ClientConfig(verify="sometimes")
    with pytest.raises(ValueError):
        ClientConfig(quorum=1)


def test_a_lone_peer_answers_verify_auto_unverified_and_verify_always_at_once() -> None:
    """No other peer can give a second opinion: ``auto`` (a spot check)
    delivers the lone results unverified instead of waiting for the job's
    timeout, and ``always`` fails the job at once, saying why."""
    s = MiniSwarm(1, seed=21)
    s.step_until(s.now + 10)
    t0 = s.now
    jid, c = run(s, 12, verify="auto")
    assert s.finished[jid].ok and s.now - t0 < 60
    assert sorted(d.shard for d in s.delivered if d.job_id == jid) == list(range(12))
    # a new peer's results are all checked (no reputation yet), so none could be
    assert c.stats["results_unverifiable"] == 12 and c.stats["results_verified"] == 0
    t0 = s.now
    jid, c = run(s, 3, i=1, verify="always")  # another tenant
    fin = s.finished[jid]
    assert not fin.ok and "no other peer can verify" in fin.error and s.now - t0 < 60
    assert c.stats["verify_no_peer"] == 1


def test_two_peers_that_disagree_fail_the_job_instead_of_waiting_for_a_third() -> None:
    s = MiniSwarm(2, seed=22, liars={1: 1.0})
    s.step_until(s.now + 10)
    t0 = s.now
    jid, c = run(s, 6, verify="always")
    fin = s.finished[jid]
    assert not fin.ok and "no other peer can verify" in fin.error and s.now - t0 < 120
    assert not any(d.result != b"r%d" % d.shard for d in s.delivered if d.job_id == jid)


def test_replies_a_peer_asked_for_pass_its_rate_limit() -> None:
    """One job of 600 short shards on 2 peers, checked by ``auto``: the
    client's awards, lease acks and result acks reach each peer far faster
    than its token bucket (200/s, bursts of 400) refills. Each of them was
    asked for (by a bid, a renewal, a result), so none is dropped; before,
    the dropped awards and acks lapsed leases, and the doubled backoff of
    the verification rounds left the last replicas waiting a minute."""
    s = MiniSwarm(2, seed=22)
    s.step_until(s.now + 10)
    c = s.add_client(verify="auto")
    s.step_until(s.now + 5)
    t0 = s.now
    jid = s.submit(c, JobRequest("sim", 600, work_s=0.01))
    s.step_until(s.now + 600, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    assert sorted(d.shard for d in s.delivered if d.job_id == jid) == list(range(600))
    peers = list(s.peers.values())
    assert sum(p.rejected["rate-limited"] for p in peers) == 0
    assert sum(p.stats["solicited_past_limit"] for p in peers) > 0  # the bucket alone would have refused
    assert c.stats["verifications"] > 0 and c.stats["leases_lapsed"] == 0
    assert s.now - t0 < 10.0


def _late_bids_while_busy(rearms: int, monkeypatch: pytest.MonkeyPatch) -> tuple[float, object]:
    """40 shards checked by ``always`` on 2 peers whose bids come 0.4 s late
    (well past the 50 ms window their first bids taught the client) for the
    first 1.5 s of the job, as from peers busy with a burst of awards."""
    monkeypatch.setattr(client_core, "MAX_REARMS", rearms)
    busy_until = [0.0]
    s = MiniSwarm(2, seed=23, delay=lambda src, e: 0.4 if e.kind == "Bid" and s.now < busy_until[0] else 0.0)
    s.step_until(s.now + 10)
    c = s.add_client(verify="always")
    s.step_until(s.now + 5)
    t0 = s.now
    jid = s.submit(c, JobRequest("sim", 40, work_s=0.05))
    s.step_until(t0 + 0.1)  # the first round's bids come on time
    busy_until[0] = t0 + 1.5
    s.step_until(t0 + 120, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok and c.stats["results_verified"] == 40
    return s.now - t0, c


def test_a_late_bid_lifts_the_backoff_of_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    fast, c = _late_bids_while_busy(client_core.MAX_REARMS, monkeypatch)
    assert c.stats["rounds_rearmed"] > 0 and fast < 4.0
    # without it, the job waits out the backoff its failed rounds doubled
    slow, c = _late_bids_while_busy(0, monkeypatch)
    assert c.stats["rounds_rearmed"] == 0 and slow > 2 * fast
