"""Seeded mini swarms of cores: view convergence and the auction under faults."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fedswarm.core.client_core import ClientCore, JobRequest
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.events import Send, Submit
from fedswarm.core.peer import PeerCore
from helpers import MiniSwarm


def live_ids(s: MiniSwarm) -> set[str]:
    return {p for p in s.peers if p not in s.dead}


@pytest.mark.parametrize("quiet_max", [1, PeerConfig().gossip_quiet_max])
def test_views_converge_and_forget_crashed_peers(quiet_max: int) -> None:
    # a crashed peer leaves every view within state_ttl_s with quiet gossip
    # off (1), within state_ttl_s * gossip_quiet_max with it on (the
    # default): an idle peer's state advertises that TTL from its start
    cfg = PeerConfig(gossip_quiet_max=quiet_max)
    s = MiniSwarm(30, seed=3, peer_config=lambda i: cfg)
    s.step_until(s.now + 20)
    ids = live_ids(s)
    for p in ids:
        assert {e.peer for e in s.peers[p].view.live(s.now)} == ids
    victim = sorted(ids)[5]
    s.crash(victim)
    ttl = cfg.state_ttl_s * cfg.gossip_quiet_max
    s.step_until(s.now + ttl + 2)
    for p in live_ids(s):
        assert victim not in {e.peer for e in s.peers[p].view.live(s.now)}


def test_gossip_bandwidth_does_not_grow_with_swarm_size() -> None:
    per_peer = []
    for n in (20, 80):
        s = MiniSwarm(n, seed=1)
        s.step_until(s.now + 10)  # join phase
        b0 = s.bytes_sent
        s.step_until(s.now + 30)
        per_peer.append((s.bytes_sent - b0) / n / 30)
    assert per_peer[1] < per_peer[0] * 1.5, per_peer


def run_job(s: MiniSwarm, shards: int, work_s: float = 3.0, chain: bool = False, until: float = 2000) -> str:
    c = s.add_client()
    s.step_until(s.now + 5)
    jid = s.submit(c, JobRequest("sim", shards, work_s=work_s, chain=chain))
    s.step_until(s.now + until, stop=lambda: jid in s.finished)
    return jid


def delivered_once(s: MiniSwarm, jid: str, shards: int) -> None:
    got = sorted(d.shard for d in s.delivered if d.job_id == jid)
    assert got == list(range(shards)), got


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_auction_under_loss_and_duplication(seed: int) -> None:
    s = MiniSwarm(12, seed=seed, loss=0.05, dup=0.05)
    s.step_until(s.now + 10)
    jid = run_job(s, 40)
    assert s.finished[jid].ok
    delivered_once(s, jid, 40)


def test_auction_survives_crashes_mid_job() -> None:
    s = MiniSwarm(10, seed=7)
    s.step_until(s.now + 10)
    c = s.add_client()
    s.step_until(s.now + 5)
    jid = s.submit(c, JobRequest("sim", 30, work_s=10.0))
    s.step_until(s.now + 3)
    holders = sorted(p for p, core in s.peers.items() if core.leases)
    for p in holders[:3]:
        s.crash(p)
    s.step_until(s.now + 3000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    delivered_once(s, jid, 30)
    assert c.stats["leases_lapsed"] >= 3


def test_chain_jobs_run_in_order() -> None:
    s = MiniSwarm(6, seed=4)
    s.step_until(s.now + 10)
    jid = run_job(s, 5, work_s=2.0, chain=True)
    order = [d.shard for d in s.delivered if d.job_id == jid]
    assert order == list(range(5))


def test_cancel_stops_work_everywhere() -> None:
    s = MiniSwarm(5, seed=5)
    s.step_until(s.now + 10)
    c = s.add_client()
    s.step_until(s.now + 5)
    jid = s.submit(c, JobRequest("sim", 10, work_s=50.0))
    s.step_until(s.now + 5)
    assert any(p.leases for p in s.peers.values())
    s.cancel(c, jid)
    s.step_until(s.now + 5)
    assert not any(p.leases for p in s.peers.values())
    assert s.finished[jid].error == "cancelled"


def test_abandoned_work_is_garbage_collected_when_client_vanishes() -> None:
    s = MiniSwarm(4, seed=6)
    s.step_until(s.now + 10)
    c = s.add_client()
    s.step_until(s.now + 5)
    jid = s.submit(c, JobRequest("sim", 8, work_s=5000.0))
    s.step_until(s.now + 5)
    assert any(p.leases for p in s.peers.values())
    s.crash(c.id)
    # a long shard holds a lease of up to max_lease_s; it is abandoned after
    # twice the granted lease (or lease_grace_s, if longer) without an ack
    from fedswarm.core.config import ClientConfig

    s.step_until(s.now + max(PeerConfig().lease_grace_s, 2 * ClientConfig().max_lease_s) + 5)
    assert not any(p.leases for p in s.peers.values())
    assert sum(p.stats["leases_abandoned"] for p in s.peers.values()) >= 1


def test_forged_and_misdirected_messages_are_counted_not_fatal() -> None:
    from fedswarm.core.events import MessageReceived
    from fedswarm.core.wire import Award, JobSpec, ShardResult, encode
    from helpers import ident

    s = MiniSwarm(3, seed=8)
    s.step_until(s.now + 5)
    victim_id, victim = sorted(s.peers.items())[0]
    other_id = sorted(s.peers)[1]
    mallory = ident(666)
    job = encode(JobSpec("j", "sim", 2, False, 1.0, 1, 0, None, 1.0, 0.0, s.now, b"\x80"), mallory, issued_at=s.now, nonce=1)
    # an award naming another peer
    eff = victim.handle(s.now, MessageReceived(mallory.peer_id, encode(Award(job, other_id, 0, 0, 5.0, 1.0), mallory, issued_at=s.now, nonce=2)))
    assert eff == [] and victim.rejected["not-for-us"] == 1
    # an award for a shard that does not exist
    victim.handle(s.now, MessageReceived(mallory.peer_id, encode(Award(job, victim_id, 7, 0, 5.0, 1.0), mallory, issued_at=s.now, nonce=3)))
    assert victim.rejected["no-such-shard"] == 1
    # a result for a shard never leased, sent to a client
    c = s.add_client()
    c.handle(s.now, MessageReceived(mallory.peer_id, encode(ShardResult("j", 0, 0, True, b"", "", 1.0, 1.0, 1.0), mallory, issued_at=s.now, nonce=4)))
    assert c.rejected["unsolicited-result"] == 1
    # a replay of an accepted message
    raw = encode(Award(job, victim_id, 1, 0, 5.0, 1.0), mallory, issued_at=s.now, nonce=5)
    victim.handle(s.now, MessageReceived(mallory.peer_id, raw))
    victim.handle(s.now, MessageReceived(mallory.peer_id, raw))
    assert victim.rejected["replayed"] == 1
    assert not victim.leases or len(victim.leases) == 1


def _twelve_shards_two_slow_peers(straggler_factor: float, decline_late_s: float) -> tuple[float, MiniSwarm, ClientCore]:
    """Twelve 5 s shards on six single-slot peers, two of which run ten
    times slower than they bid; each peer gets two shards."""
    s = MiniSwarm(6, seed=21, slow={1: 10.0, 2: 10.0}, peer_config=lambda i: PeerConfig(decline_late_s=decline_late_s))
    s.step_until(s.now + 10)
    c = s.add_client(verify="none", straggler_factor=straggler_factor)
    s.step_until(s.now + 5)
    t0 = s.now
    jid = s.submit(c, JobRequest("sim", 12, work_s=5.0))
    s.step_until(s.now + 5000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    delivered_once(s, jid, 12)
    return s.now - t0, s, c


def test_a_shard_queued_behind_an_overrunning_one_is_handed_back() -> None:
    # no backups: the second shard on a slow peer would start after 50 s.
    # Its start slips as the first one overruns, so the peer hands it back
    # and a fast peer runs it
    def run(decline_late_s: float) -> tuple[float, int]:
        took, s, _ = _twelve_shards_two_slow_peers(0.0, decline_late_s)
        return took, sum(p.stats["shards_handed_back_late"] for p in s.peers.values())

    kept, handed_kept = run(0.0)
    back, handed = run(30.0)
    assert handed_kept == 0 and kept > 95.0
    assert handed == 2 and back < 55.0


def test_stragglers_get_a_backup_and_the_first_result_wins() -> None:
    # peers keep a queued shard however late it starts (decline_late_s=0):
    # the slow peers' second shards would otherwise be handed back once
    # their start slipped, and this test is about backups alone
    slow_jct, _, c_off = _twelve_shards_two_slow_peers(0.0, 0.0)
    fast_jct, s, c_on = _twelve_shards_two_slow_peers(3.0, 0.0)
    assert c_off.stats["backups"] == 0 and c_on.stats["backups"] >= 1
    assert fast_jct < 0.6 * slow_jct, (fast_jct, slow_jct)
    # the losing copies are cancelled once the cancels arrive, not left running
    s.step_until(s.now + 1)
    assert not any(p.leases for p in s.peers.values())


def _first(kind: str) -> Callable[[str, Send], bool]:
    """A drop rule that loses the first message of ``kind`` and no other."""
    seen: list[Send] = []

    def drop(src: str, e: Send) -> bool:
        if e.kind == kind and not seen:
            seen.append(e)
            return True
        return False

    return drop


def _one_shard(drop: Callable[[str, Send], bool], resend_s: float, work_s: float,
               renew_s: float = 2.0) -> tuple[float, MiniSwarm, ClientCore]:
    s = MiniSwarm(1, seed=4, drop=drop, client_config=ClientConfig(verify="none", award_resend_s=resend_s),
                  peer_config=lambda i: PeerConfig(renew_interval_s=renew_s))
    s.step_until(s.now + 5)
    c = s.add_client()
    s.step_until(s.now + 5)
    t0 = s.now
    jid = s.submit(c, JobRequest("sim", 1, work_s=work_s))
    s.step_until(s.now + 120, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    return s.now - t0, s, c


def test_a_lost_award_is_sent_again() -> None:
    # without resending, the shard waits for its lease to lapse (8 s) and a new auction
    slow, _, _ = _one_shard(_first("Award"), 0.0, 1.0)
    assert slow > 8.0
    fast, _, c = _one_shard(_first("Award"), 2.0, 1.0)
    assert fast < 4.0 and c.stats["awards_resent"] == 1


def test_a_repeated_award_is_answered_with_a_renewal_and_runs_once() -> None:
    # the award arrived but the peer's first renewal was lost: the client
    # sends the award again, the peer renews instead of running it twice
    # (its own next renewal is 30 s away: only the answer confirms the award)
    took, s, c = _one_shard(_first("LeaseRenew"), 2.0, 10.0, renew_s=30.0)
    (peer,) = s.peers.values()
    assert c.stats["awards_resent"] == 1 and peer.stats["awards_duplicate"] == 1
    assert peer.stats["shards_started"] == 1 and took < 12.0


def test_a_lost_result_is_sent_again_after_the_clients_round_trip_timeout() -> None:
    # the peer timed the client's round trip on its renewals' acks (20 ms
    # here), so a lost result goes again after about that timeout, not the
    # whole result_retry_s (1 s)
    clean, _, _ = _one_shard(lambda src, e: False, 2.0, 5.0)
    lost, s, _ = _one_shard(_first("ShardResult"), 2.0, 5.0)
    (peer,) = s.peers.values()
    assert peer.stats["results_resent"] == 1
    assert lost - clean < 0.25  # 1.0 s before the peer timed its clients


def _cut_off_run(who: str) -> tuple[ClientCore, str]:
    """A 20 s shard runs on one of 3 peers; for 30 s either the client or the
    holder is cut off from everyone, so the lease (10 s) lapses at the client."""
    s = MiniSwarm(3, seed=4, client_config=ClientConfig(verify="none"))
    window = [float("inf"), float("inf")]
    holder = [""]

    def cut(src: str, e: Send) -> bool:
        if not window[0] <= s.now < window[1]:
            return False
        node = c.id if who == "client" else holder[0]
        return node in (src, e.to)

    s.drop = cut
    s.step_until(s.now + 10)
    c = s.add_client()
    s.step_until(s.now + 10)
    jid = s.submit(c, JobRequest("sim", 1, work_s=20.0))
    s.step_until(s.now + 5)  # awarded and running
    holder[0] = c.jobs[jid].shards[0].peer
    assert holder[0] and any(s.peers[holder[0]].leases)
    window[:] = [s.now, s.now + 30.0]
    s.step_until(s.now + 30.0)
    assert c.stats["leases_lapsed"] >= 1
    return c, holder[0]


def test_a_client_cut_off_itself_does_not_blame_the_holders() -> None:
    c, holder = _cut_off_run("client")
    assert holder not in c._suspect and c.stats["leases_lapsed_cut_off"] >= 1
    # the same lapse with the client's own link fine: the holder went quiet
    c, holder = _cut_off_run("peer")
    assert holder in c._suspect and c.stats["leases_lapsed_cut_off"] == 0


def test_an_idle_client_pulls_no_views_and_a_submit_pulls_once() -> None:
    # idle_pull=False (issue 23): no view pulls while no shard waits to be
    # placed; one on submit, more while the job's shards are being placed,
    # none again once they are all placed; idle_pull=True with quiet pulls
    # off (pull_quiet_max=1) pulls every interval all along
    s = MiniSwarm(4, seed=3, client_config=ClientConfig(verify="none", idle_pull=False))
    s.step_until(s.now + 20)
    c = s.add_client(0)
    old = s.add_client(1, idle_pull=True, pull_quiet_max=1)
    s.step_until(s.now + 30)
    assert c.stats["pulls"] == 0
    assert old.stats["pulls"] >= 10
    acc, *eff = c.handle(s.now, Submit(JobRequest("sim", 2, work_s=60.0)))
    jid = acc.job_id
    assert c.stats["pulls"] == 1
    assert any(isinstance(e, Send) and e.kind == "Gossip" for e in eff)
    s.perform(c.id, eff)
    s.step_until(s.now + 10, stop=lambda: not c._placing())
    assert not c._placing() and jid not in s.finished
    placed = c.stats["pulls"]
    s.step_until(s.now + 30)  # both shards run; nothing to place
    assert c.stats["pulls"] == placed
    s.step_until(s.now + 200, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok


def test_an_idle_client_stretches_its_pulls_and_a_submit_brings_them_back() -> None:
    # quiet pulls (pull_quiet_max=8, the default, issue 23): while no job is
    # unfinished, each pull doubles the interval to the next, up to 8x
    # gossip_interval_s (2 s here); a submit pulls at once and brings the
    # interval back to the base while the job is unfinished; once it is
    # done the intervals stretch again, but not while the swarm is busy
    s = MiniSwarm(4, seed=3, client_config=ClientConfig(verify="none"))
    s.step_until(s.now + 20)
    c = s.add_client(0)
    base = c.config.gossip_interval_s
    assert c.config.pull_quiet_max == 8

    def pull_times(until: float) -> list[float]:
        times: list[float] = []
        while s.now < until - 1e-9:
            s.step_until(min(s.now + 0.5, until))
            if c._last_pull_at not in times and c._last_pull_at > -1.0:
                times.append(c._last_pull_at)
        return times

    times = pull_times(s.now + 200)
    gaps = [round(y - x, 3) for x, y in zip(times, times[1:])]
    # no answer was news (4 peers), so no bursts: 4, 8, 16, then 16 s apart
    assert gaps[:3] == [2 * base, 4 * base, 8 * base], gaps
    assert set(gaps[3:]) == {8 * base}, gaps
    pulls = c.stats["pulls"]
    acc, *eff = c.handle(s.now, Submit(JobRequest("sim", 2, work_s=30.0)))
    assert c.stats["pulls"] == pulls + 1  # the last pull was more than an interval ago
    assert any(isinstance(e, Send) and e.kind == "Gossip" for e in eff)
    s.perform(c.id, eff)
    t0 = s.now
    times = pull_times(s.now + 20)
    assert [round(y - x, 3) for x, y in zip(times, times[1:])] == [base] * (len(times) - 1) and len(times) >= 9
    s.step_until(s.now + 200, stop=lambda: acc.job_id in s.finished)
    assert s.finished[acc.job_id].ok and s.now - t0 < 100
    times = pull_times(s.now + 100)
    gaps = [round(y - x, 3) for x, y in zip(times, times[1:])]
    # quiet again: the pull on the job's last interval came at the base
    # interval, the next ones stretch up to 8x (4, 8, 16 s)
    assert gaps == sorted(gaps) and gaps[0] <= 2 * base and gaps[-3:] == [8 * base] * 3, gaps
    # another tenant's work keeps the swarm busy: once our view shows a busy
    # slot, our pulls go back to the base interval, idle as we are (they
    # are how we learn which peers go free for our next job)
    other = s.add_client(1)
    busy = s.submit(other, JobRequest("sim", 2, work_s=200.0))
    times = pull_times(s.now + 60)
    assert c.view.capacity(s.now)[2] > 0 and not c._active and busy not in s.finished
    gaps = [round(y - x, 3) for x, y in zip(times, times[1:])]
    assert len(gaps) >= 10 and gaps[-10:] == [base] * 10, gaps


def test_a_client_learns_a_large_swarm_in_a_burst_of_pulls_and_then_stops() -> None:
    # 300 peers whose views hold 64 entries each: one pull of 64 teaches a
    # client at most 64 peers. An answer that was mostly news is followed by
    # another pull at once (pull_again_share), so within a second of its
    # first pull the client knows most of the swarm; the burst ends when the
    # answers are mostly peers it knows, and pulls go back to one per interval
    s = MiniSwarm(300, seed=4, peer_config=lambda i: PeerConfig(max_view=64, gossip_interval_s=1.0))
    s.step_until(s.now + 30)
    assert max(len(p.view) for p in s.peers.values()) <= 64
    cfg = dict(pull_entries=64, gossip_interval_s=5.0)
    burst = s.add_client(0, **cfg)
    single = s.add_client(1, pull_again_share=0.0, **cfg)
    t0 = s.now
    s.step_until(t0 + 6.0)  # the interval's first pull went out at t0 + 5
    assert single.stats["pulls"] == 1 and single.stats["pulls_again"] == 0
    assert len(single.view) <= 2 * 65  # the bootstrap's answer and one pull
    assert burst.stats["pulls_again"] >= 5
    assert len(burst.view) >= 200, len(burst.view)
    again = burst.stats["pulls_again"]
    s.step_until(t0 + 26.0)  # four more intervals: the view is known now
    assert burst.stats["pulls_again"] <= again + 2
    assert burst.stats["pulls"] <= 1 + again + 2 + 4


def test_batched_renewals_send_one_message_per_peer_and_client() -> None:
    # renew_batch: a peer renews all of a client's shards it holds in one
    # LeaseRenewBatch per round, answered by one LeaseAckBatch; every shard
    # is still delivered once, with far fewer lease messages
    from collections import Counter

    kinds: dict[bool, Counter[str]] = {}
    for batch in (False, True):
        cnt = kinds[batch] = Counter()
        s = MiniSwarm(2, seed=5, peer_config=lambda i, b=batch: PeerConfig(slots=8, renew_interval_s=1.0,
                                                                            renew_batch=b))
        s.drop = lambda src, e, cnt=cnt: bool(cnt.update([e.kind]))
        s.step_until(s.now + 10)
        c = s.add_client()
        s.step_until(s.now + 5)
        jid = s.submit(c, JobRequest("sim", 16, work_s=30.0))
        s.step_until(s.now + 600, stop=lambda: jid in s.finished)
        assert s.finished[jid].ok
        assert sorted(d.shard for d in s.delivered if d.job_id == jid) == list(range(16))
    plain, batched = kinds[False], kinds[True]
    assert plain["LeaseRenewBatch"] == 0 and batched["LeaseRenewBatch"] > 0
    assert batched["LeaseAckBatch"] == batched["LeaseRenewBatch"]
    assert batched["LeaseRenew"] + batched["LeaseRenewBatch"] < plain["LeaseRenew"] / 3, (plain, batched)


def _every_lease_scanned(p: PeerCore) -> float:
    """``PeerCore.next_deadline`` as a scan of every lease (its lazy heap's oracle)."""
    t = p._next_gossip
    if p._quiet > 1 and not p._idle_now():
        t = min(t, p._last_gossip_at + p.config.gossip_interval_s)
    for lease in p.leases.values():
        t = min(t, lease.next_renew_at, lease.last_ack_at + p._grace(lease) + 1e-6)
    if p._may_offer():
        t = min(t, p._next_offer)  # an idle slot's next offer
    return min([t, *(ob.next_at for ob in p.outbox.values())])


def test_a_peers_next_deadline_is_the_earliest_of_all_its_leases() -> None:
    # under loss, duplicates, a crash and a revoking client, with leases
    # renewed, acked, lapsing, handed back and finished all the while
    s = MiniSwarm(6, seed=5, loss=0.05, dup=0.05, client_config=ClientConfig(verify="none", lease_s=4.0))
    s.step_until(s.now + 10)
    c = s.add_client()
    s.step_until(s.now + 5)
    jobs = [s.submit(c, JobRequest("sim", 40, work_s=w)) for w in (0.5, 3.0, 9.0)]
    checks = 0
    for k in range(2000):
        if all(j in s.finished for j in jobs):
            break
        s.step_until(s.now + 0.25)
        if k == 40:
            s.crash(sorted(s.peers)[2])
        for pid, p in s.peers.items():
            if pid not in s.dead:
                assert p.next_deadline() == _every_lease_scanned(p)
                checks += bool(p.leases)
    assert all(j in s.finished for j in jobs) and checks > 500
