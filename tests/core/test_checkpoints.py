"""Checkpointed re-runs: a shard whose peer is lost goes on elsewhere from
the last checkpoint its peer sent (``ShardProgress`` -> ``ShardCheckpoint``
-> ``CallForBids.left`` / ``Award.resume`` -> ``RunShard.resume``)."""

from __future__ import annotations

import math

import pytest

from fedswarm.core.client_core import ClientCore, JobRequest
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.events import RunShard, Send, ShardFinished, ShardProgress
from fedswarm.core.peer import PeerCore
from fedswarm.core.wire import Bid, decode
from helpers import MiniSwarm

WORK_S = 100.0


def start_one_shard(s: MiniSwarm, **client_kw: object) -> tuple[ClientCore, str, str, RunShard]:
    """A one-shard job of ``WORK_S`` seconds, running on its holder."""
    s.step_until(s.now + 10)
    c = s.add_client(**client_kw)
    s.step_until(s.now + 5)
    jid = s.submit(c, JobRequest("sim", 1, work_s=WORK_S))
    s.step_until(s.now + 60, stop=lambda: any(s.runs[p] for p in s.peers))
    holder = next(p for p in sorted(s.peers) if s.runs[p])
    run = s.runs[holder].get(next(iter(s.runs[holder])))
    assert run is not None
    return c, jid, holder, run.effect


def save(s: MiniSwarm, holder: str, e: RunShard, done: float, state: bytes = b"state") -> None:
    """The holder's executor reports a checkpoint now; its message goes out."""
    core = s.peers[holder]
    s.perform(holder, core.handle(s.now, ShardProgress(e.tenant, e.job_id, e.shard, e.attempt, done, state)))


def resumed_runs(s: MiniSwarm, jid: str) -> list[RunShard]:
    return [ended.effect for _, ended in s.ended if ended.effect.job_id == jid and ended.effect.resume]


def test_a_lost_peers_shard_goes_on_elsewhere_from_its_last_checkpoint() -> None:
    s = MiniSwarm(6, seed=3, client_config=ClientConfig(verify="none"))
    c, jid, holder, first = start_one_shard(s)
    assert first.left == 1.0 and first.resume == b""
    s.step_until(s.now + 30)
    save(s, holder, first, 0.3, b"at-30")
    s.step_until(s.now + 15)
    save(s, holder, first, 0.6, b"at-60")  # the later one wins
    s.step_until(s.now + 1)
    assert c.stats["checkpoints"] == 2
    s.crash(holder)
    s.step_until(s.now + 3000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    (again,) = resumed_runs(s, jid)
    assert again.resume == b"at-60"
    assert again.left == pytest.approx(0.4)
    assert again.attempt == 1
    # it ran only what was left (the peers are alike: the same speed)
    assert again.run_s == pytest.approx(0.4 * first.run_s * first.level / again.level)
    other = s.peers[next(p for p, ended in s.ended if ended.effect is again)]
    assert c.stats["awards_resumed"] == 1
    assert other.stats["shards_resumed"] == 1


def test_the_call_for_bids_prices_only_the_work_left() -> None:
    bids: list[Bid] = []

    def spy(sender: str, send: Send) -> bool:  # sees every message sent; drops none
        if send.kind == "Bid":
            msg = decode(send.data).msg
            assert isinstance(msg, Bid)
            bids.append(msg)
        return False

    s = MiniSwarm(6, seed=5, client_config=ClientConfig(verify="none"), drop=spy)
    c, jid, holder, first = start_one_shard(s)
    s.step_until(s.now + 20)
    save(s, holder, first, 0.75)
    s.step_until(s.now + 1)
    s.crash(holder)
    before = len(bids)
    s.step_until(s.now + 3000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    again = bids[before:]
    # the peers are alike: a bid for the last quarter, at the top clock
    assert again and all(b.run_s == pytest.approx(0.25 * first.run_s * first.level / b.level) for b in again)


def test_an_untrusted_peers_checkpoint_is_not_taken_when_results_are_verified() -> None:
    # verify "auto": a re-run from a bad state would agree with that state
    s = MiniSwarm(6, seed=7, client_config=ClientConfig(verify="always"))
    c, jid, holder, first = start_one_shard(s)
    save(s, holder, first, 0.5)
    s.step_until(s.now + 1)
    assert c.stats["checkpoints_ignored"] == 1 and c.stats["checkpoints"] == 0
    s.crash(holder)
    s.step_until(s.now + 5000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    assert resumed_runs(s, jid) == []


def test_a_trusted_peers_checkpoint_is_taken_when_results_are_verified() -> None:
    s = MiniSwarm(6, seed=7, trusted=tuple(range(6)), client_config=ClientConfig(verify="always"))
    c, jid, holder, first = start_one_shard(s)
    save(s, holder, first, 0.5)
    s.step_until(s.now + 1)
    assert c.stats["checkpoints"] == 1


def test_resume_off_starts_every_rerun_over() -> None:
    s = MiniSwarm(6, seed=9, client_config=ClientConfig(verify="none", resume=False))
    c, jid, holder, first = start_one_shard(s)
    save(s, holder, first, 0.5)
    s.step_until(s.now + 1)
    s.crash(holder)
    s.step_until(s.now + 3000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok and resumed_runs(s, jid) == []
    assert c.stats["checkpoints_ignored"] == 1


def test_a_failed_resumed_run_starts_over() -> None:
    s = MiniSwarm(6, seed=11, client_config=ClientConfig(verify="none"))
    c, jid, holder, first = start_one_shard(s)
    save(s, holder, first, 0.5)
    s.step_until(s.now + 1)
    s.crash(holder)
    s.step_until(s.now + 200, stop=lambda: any(r for p, r in s.runs.items() if p not in s.dead))
    runner = next(p for p, r in sorted(s.runs.items()) if p not in s.dead and r)
    key = next(iter(s.runs[runner]))
    run = s.runs[runner].get(key)
    assert run is not None and run.effect.resume == b"state"
    # the resumed run fails (say its task refused the state): the next starts over
    s.runs[runner].end(s.now, key)
    e = run.effect
    s.perform(runner, s.peers[runner].handle(s.now, ShardFinished(e.tenant, e.job_id, e.shard, e.attempt, False,
                                                                   error="bad state")))
    s.step_until(s.now + 3000, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    last = [ended.effect for _, ended in s.ended if ended.effect.job_id == jid][-1]
    assert last.attempt == 2 and last.resume == b"" and last.left == 1.0


def test_a_checkpoint_of_an_earlier_attempt_is_stale() -> None:
    s = MiniSwarm(6, seed=13, client_config=ClientConfig(verify="none"))
    c, jid, holder, first = start_one_shard(s)
    # the client gives up on the holder (its renewals are lost) and re-awards;
    # a checkpoint of the old attempt that comes after is stale
    s.crash(holder)
    s.step_until(s.now + 200, stop=lambda: any(r for p, r in s.runs.items() if p not in s.dead))
    s.dead.discard(holder)
    save(s, holder, first, 0.5)
    s.step_until(s.now + 1)
    assert c.stats["checkpoints_stale"] + s.peers[holder].stats["checkpoints_unmatched"] >= 1
    assert c.stats["checkpoints"] == 0


def test_the_peer_sends_at_most_one_checkpoint_per_interval_and_only_progress() -> None:
    s = MiniSwarm(4, seed=17, client_config=ClientConfig(verify="none"),
                  peer_config=lambda i: PeerConfig(checkpoint_min_s=10.0))
    c, jid, holder, first = start_one_shard(s)
    core: PeerCore = s.peers[holder]
    save(s, holder, first, 0.2)
    save(s, holder, first, 0.3)  # too soon
    s.step_until(s.now + 11)
    save(s, holder, first, 0.2)  # no progress over the last one sent
    save(s, holder, first, 1.0)  # not a checkpoint: done
    save(s, holder, first, 0.4, b"")  # no state
    save(s, holder, first, 0.5)
    s.step_until(s.now + 1)
    assert core.stats["checkpoints_sent"] == 2
    assert core.stats["checkpoints_skipped"] == 1
    assert core.stats["checkpoints_refused"] == 3
    assert c.stats["checkpoints"] == 2
    # one for a shard not running here is counted, not sent
    s.perform(holder, core.handle(s.now, ShardProgress(first.tenant, first.job_id, first.shard, 9, 0.5, b"x")))
    assert core.stats["checkpoints_unmatched"] == 1
    assert math.isfinite(core.next_deadline())
