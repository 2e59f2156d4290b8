"""ClientCore: the sans-IO side of a tenant that submits jobs.

Theory of operation
-------------------
A job is split into shards. Open shards are auctioned in *rounds*: the
client picks about twice as many candidates as shards (Sparrow's d) from
its view (see below), sends each a ``CallForBids`` carrying the
tenant-signed ``JobSpec``, and collects ``Bid``s until every invitee
answered, or for ``bid_window_s`` at most (less when it has heard from every
invitee before: the slowest one's retransmission timeout, from the round
trips of its earlier bids, late ones included, and of its view pulls). It
then awards each shard to the bid minimising

    weight * (estimated_finish + transit) + lam * (energy_j + carbon_weight * carbon_g)

where a peer's finish for a shard with k more ahead of it than its bid
counted (this round's earlier ones, awards the bid could not know of) is
the k-th of the waits the bid lists (``next_s``) plus ``run_s``, and
``transit`` is the peer's smoothed round trip (award out, result back)
(the award rule). A winner holds a lease:
it renews it with ``LeaseRenew``; the client answers ``LeaseAck`` and keeps
the lease alive for ``lease_s`` after each renewal. A lapsed lease, a decline
or a failed result reopens the shard with the next attempt number; a shard
that failed ``max_attempts`` times fails the job.

Checkpoints: a running shard's peer may send ``ShardCheckpoint``s (its
task saved its progress). The client keeps the latest of the current
attempt (from a trusted peer, or any peer with ``verify = "none"``; see
``ClientConfig.resume``), and the next attempt, should the shard reopen,
goes on from it: its call for bids says how much of the work is left
(``CallForBids.left``, which the bids price) and its award carries the
state (``Award.resume``). Shards that resume are auctioned in rounds of
their own, one share of work left per round. A failed result forgets the
checkpoint (the run may have failed on it).

Invitations go to the peers with the earliest estimated finish in the
client's view (``Forecaster.eta``, plus twice the transit: the call and its bid,
the award and its result), a share of them
(``explore_ratio``) swapped for random others. The view is tens of seconds
old, so bids are fresh news: each bid's start time is remembered for that
peer until a newer state of it arrives, and when the best bid of a round
finishes far later than the view promises elsewhere (``rebid_gain``;
at least ``rebid_min_s``, or ``rebid_min_runs`` runs of the shard if that
is less), the round is run again with the next-ranked peers, keeping
its bids, at most ``max_rebids`` times. Every bid also teaches the client how
far off states of its age were (``Forecaster.learn_stale``, ``stale_gain``); such a second
look ranks by the view so corrected, fresh states before old ones.

View pulls: every ``gossip_interval_s`` the client asks one peer for
``pull_entries`` entries of its view; an answer of which at least
``pull_again_share`` were peers new to the view is followed by another pull
at once (a large swarm is learnt in a burst). With ``idle_pull=False`` it does so
only while some job has a shard open or being auctioned, plus once when a
job is submitted (unless a pull went out within the interval), so a tenant
with nothing to place costs the swarm nothing; the rate per client never
depends on how many tenants there are. *Quiet pulls* (``pull_quiet_max``, 8
by default; 1: off): while the client has no job unfinished and its view
shows no busy slot and no model span served, each pull doubles the interval to the next, up to
``pull_quiet_max`` times ``gossip_interval_s``; a submit brings it back to
the base interval and pulls at once (unless a pull went out within the
interval). On a busy swarm an idle client pulls at the base interval: its
pulls are how it learns which peers went free, since idle peers gossip
quietly.

Silent invitees: an invitee that did not bid in a round that others did
bid in is not invited again (once a whole bid window or its timeout has
passed) until a bid of its arrives or a state it signed after the call
does. An idle peer's state lives ``state_ttl_s * gossip_quiet_max``; one
that crashed looks free, and would rank first all that time.

Exactly-once delivery: a shard may *run* more than once (an attempt thought
lost may still finish), but the first result for a shard is delivered and
every later one is acknowledged and dropped; other holders are cancelled.
Results are accepted only from the peer that holds (or held) that attempt.

Chain jobs open one shard at a time: shard k+1 is auctioned when shard k's
result is in, so the job competes again at every shard boundary.

Shard states::

    OPEN --invite--> BIDDING --award--> AWARDED --result--> DONE
    BIDDING --no bid--> OPEN     AWARDED --lapse|decline|failure--> OPEN
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Iterable, Iterator, Mapping

from ..errors import LocalProtocolError, RemoteProtocolError
from .config import ClientConfig
from .events import (
    TOPIC_ACCUSATIONS,
    CancelJob,
    Effect,
    Input,
    JobRequest,
    JobAccepted,
    JobFinished,
    MessageReceived,
    Publish,
    Send,
    ShardDelivered,
    Submit,
)
from .fairness import deadline_left, run_time
from .identity import Identity
from .forecast import Forecaster, position
from .verdict import FAIL, WAIT, Candidate, settle
from .node import Node, replies_invited
from .view import ViewEntry
from .wire import (
    Accusation,
    Award,
    AwardDecline,
    Bid,
    CallForBids,
    Cancel,
    Gossip,
    JobSpec,
    LeaseAck,
    LeaseAckBatch,
    LeaseRenew,
    LeaseRenewBatch,
    PeerState,
    ResultAck,
    ShardCheckpoint,
    ShardResult,
    Signed,
    VerifyCache,
    pack_params,
)

__all__ = ["ClientCore", "JobRequest", "ShardState"]


class ShardState:
    OPEN: Final = "open"
    BIDDING: Final = "bidding"
    AWARDED: Final = "awarded"
    DONE: Final = "done"



#: rounds a job may start early on late bids between two of its awards
MAX_REARMS = 8

_TRANSITIONS: dict[tuple[str, str], str] = {
    (ShardState.OPEN, "invite"): ShardState.BIDDING,
    (ShardState.BIDDING, "award"): ShardState.AWARDED,
    (ShardState.BIDDING, "no-bid"): ShardState.OPEN,
    (ShardState.AWARDED, "reopen"): ShardState.OPEN,
    (ShardState.AWARDED, "verify"): ShardState.OPEN,  # held result awaits a second opinion
    (ShardState.AWARDED, "speculate"): ShardState.OPEN,  # a straggler gets a backup; it keeps running
    # a queued shard is offered elsewhere (``_Rescue``); no better offer: it stays queued where it was
    (ShardState.AWARDED, "rescue"): ShardState.OPEN,
    (ShardState.OPEN, "keep"): ShardState.AWARDED,
    (ShardState.BIDDING, "keep"): ShardState.AWARDED,
    (ShardState.AWARDED, "result"): ShardState.DONE,
    # a result from an earlier attempt may land while the shard is re-auctioned
    (ShardState.OPEN, "result"): ShardState.DONE,
    (ShardState.BIDDING, "result"): ShardState.DONE,
}


@dataclass(slots=True)
class _Rescue:
    """A shard queued far behind other work at its holder, while the view
    shows a peer that should finish it much sooner, is auctioned again with
    its queued attempt kept: the first of the two to start runs it, and the
    other is cancelled then. Should the auction find nothing that finishes
    sooner, the queued attempt stays the shard's."""
    attempt: int  # the queued attempt
    peer: str
    finish: float  # when it should finish there, as its holder's renewal said
    until: float  # its lease, kept up to date by its renewals meanwhile
    running: bool = False
    moved_finish: float = math.inf  # when the new attempt should finish, once awarded


@dataclass(slots=True)
class _Shard:
    index: int
    state: str = ShardState.OPEN
    attempt: int = 0
    peer: str = ""
    lease_until: float = 0.0
    failures: int = 0
    holders: dict[int, str] = field(default_factory=dict)  # attempt -> peer
    round: int = -1
    counts: dict[str, int] = field(default_factory=dict)  # the job's shards per state (shared)
    # attempts allowed to go on (the current one, plus a straggler that got a backup)
    live: set[int] = field(default_factory=set)
    backups: int = 0
    # verification: results held until a quorum of distinct peers agrees
    candidates: list[Candidate] = field(default_factory=list)
    exclude: set[str] = field(default_factory=set)
    award: Award | None = None  # the current attempt's award, until a renewal confirms it
    resend_s: float = 0.0  # how long that award may go unconfirmed before it is sent again
    # the last checkpoint taken (``ShardCheckpoint``): the next attempt goes
    # on from ``resume`` with ``left`` of the work to do (1, b"": from the start)
    left: float = 1.0
    resume: bytes = b""
    rescue: _Rescue | None = None
    rescued: bool = False  # a shard is offered elsewhere at most once


@dataclass(slots=True, init=False)
class _Round:
    id: int
    shards: tuple[int, ...]
    invited: set[str]
    close_at: float
    called_at: float
    bids: dict[str, Bid] = field(init=False)
    # per bidder: awards this client sent it before the call that it had not
    # confirmed when its bid came (they may have been in flight)
    unconfirmed: dict[str, int] = field(init=False)
    # per invitee ranked from its state alone: (staleness class, the wait
    # that state predicted), to learn from its bid how far off states are
    predicted: dict[str, tuple[int, float]] = field(init=False)
    # the sampled candidates the round ranked (None: the whole view)
    ranked: tuple[str, ...] | None = field(init=False)

    # (a written ``__init__``, not the dataclass's: compiled by mypyc, the
    # generated one runs as Python, about 5x slower, on a hot path)
    def __init__(self, id: int, shards: tuple[int, ...], invited: set[str], close_at: float,
                 called_at: float) -> None:
        self.id = id
        self.shards = shards
        self.invited = invited
        self.close_at = close_at
        self.called_at = called_at
        self.bids = {}
        self.unconfirmed = {}
        self.predicted = {}
        self.ranked = None


@dataclass(slots=True)
class _Job:
    spec: JobSpec
    raw: bytes
    shards: list[_Shard]
    submitted_at: float
    done: int = 0
    finished: bool = False
    round: _Round | None = None
    next_round_at: float = 0.0
    backoff: float = 0.0
    rearms: int = 0  # backoffs lifted by late bids since the last award (``MAX_REARMS``)
    next_round_id: int = 0
    finished_at: float = 0.0
    # a second look: bids kept from the rounds re-run, and who was asked
    carried: dict[str, tuple[Bid, float, int]] = field(default_factory=dict)
    # the last round closed before every invitee bid (early, or when its
    # window ran out): (id, when its call went out, who had not bid), to
    # learn round trips from late bids
    closed: tuple[int, float, frozenset[str]] | None = None
    asked: set[str] = field(default_factory=set)
    rebids: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    resumable: int = 0  # shards holding a checkpoint (``_Shard.resume``)
    # peers that holders named when they moved a queued shard of this job
    # ("moved" declines): invited to its next round besides the ranked picks
    moved_to: set[str] = field(default_factory=set)


class ClientCore(Node):
    """A tenant's auction and lease bookkeeping. See the module docstring."""

    def __init__(
        self,
        identity: Identity,
        config: ClientConfig,
        rng: random.Random,
        *,
        verify_cache: VerifyCache | None = None,
    ) -> None:
        super().__init__(
            identity,
            rng,
            max_view=config.max_view,
            max_skew_s=config.max_skew_s,
            max_message_bytes=config.max_message_bytes,
            verify_cache=verify_cache,
            rate_per_s=config.rate_per_s,
            rate_burst=config.rate_burst,
            federations=config.federations,
        )
        self._config = config
        self.jobs: dict[str, _Job] = {}
        self._suspect: dict[str, float] = {}
        #: invitees that left a call unanswered while others answered it ->
        #: when that call went out: not invited again until a bid of theirs
        #: or a state issued after the call comes (``_iter_eligible``)
        self._silent: dict[str, float] = {}
        self._last_heard = -math.inf  # when a valid message last arrived
        #: agreed results per untrusted peer (drives how often it is checked)
        self.reputation: dict[str, float] = {}
        self._accused: set[str] = set()  # peers accused with a trusted witness
        self._active: dict[str, _Job] = {}  # unfinished jobs
        # (lease_until, job_id, shard, attempt); stale entries are skipped
        self._lease_heap: list[tuple[float, str, int, int]] = []
        # (when the attempt counts as a straggler, job_id, shard, attempt)
        self._straggle_heap: list[tuple[float, str, int, int]] = []
        # (when to send the award again, job_id, shard, attempt, lease_until then, resends so far)
        self._award_heap: list[tuple[float, str, int, int, float, int]] = []
        self._next_gossip = 0.0
        #: quiet pulls: the factor (1, 2, 4, ... pull_quiet_max) by which the
        #: interval after our last pull (at ``_last_pull_at``) was stretched
        self._pull_quiet = 1
        self._last_pull_at = -math.inf
        #: the peer asked by our last pull, and when (its answer times a round trip)
        self._pulled: tuple[str, float] | None = None
        self._counter = 0
        #: round trips, bids as news, staleness, awards not yet in states, ties
        self.forecast = Forecaster(config, self.view, zlib.crc32(identity.peer_id.encode()))
        #: the peers that lately won awards, oldest first: ranked in every sample
        self._good: dict[str, None] = {}

    # ------------------------------------------------------------------
    # public API

    @property
    def config(self) -> ClientConfig:
        return self._config

    @config.setter
    def config(self, config: ClientConfig) -> None:
        self._config = config
        self.forecast.config = config

    @property
    def suspects(self) -> Mapping[str, float]:
        """Peers this client skips for now (a lease of theirs lapsed): peer
        id -> until when (read only)."""
        return MappingProxyType(self._suspect)

    def start(self, now: float) -> list[Effect]:
        self._next_gossip = now + self.config.gossip_interval_s
        want = self.config.pull_entries
        return [self._gossip_to(now, b, reply=True, entries=0, want=want) for b in self.config.bootstrap]

    @property
    def topics(self) -> tuple[str, ...]:
        return (TOPIC_ACCUSATIONS,)

    @property
    def idle(self) -> bool:
        """No job unfinished."""
        return not self._active

    def _submit(self, now: float, req: JobRequest) -> tuple[str, list[Effect]]:
        """``Submit(req)``: sign and open a job; its id and first effects."""
        if req.shards < 1:
            raise LocalProtocolError("bad-job", "a job needs at least one shard")
        self._counter += 1
        job_id = req.job_id or f"{self.id[-8:]}-{self._counter}-{self.rng.getrandbits(32):08x}"
        if job_id in self.jobs:
            raise LocalProtocolError("bad-job", f"job id {job_id} already used")
        spec = JobSpec(
            job_id=job_id,
            task=req.task,
            shards=req.shards,
            chain=req.chain,
            work_s=float(req.work_s),
            gpus=req.gpus,
            mem_bytes=req.mem_bytes,
            deadline_s=None if req.deadline_s is None else float(req.deadline_s),
            weight=float(req.weight),
            lam=float(req.lam),
            submitted_at=float(now),
            params=pack_params(req.params),
        )
        raw = self._encode(spec, now)
        counts = {ShardState.OPEN: req.shards, ShardState.BIDDING: 0, ShardState.AWARDED: 0, ShardState.DONE: 0}
        shards = [_Shard(i, counts=counts) for i in range(req.shards)]
        job = self.jobs[job_id] = _Job(spec, raw, shards, now, next_round_at=now, counts=counts)
        self._active[job_id] = job
        self.stats["jobs_submitted"] += 1
        # a fresh job should not wait on a view gone stale while idle: one
        # pull now (unless one went out within the last interval)
        quiet = self._pull_quiet > 1
        if quiet:
            self._pull_quiet = 1
            self._next_gossip = min(self._next_gossip, self._last_pull_at + self.config.gossip_interval_s)
        pull = self._pull(now) if (quiet or not self.config.idle_pull) and now >= self._next_gossip else []
        return job_id, pull + self._advance(now, self.jobs[job_id])

    def _cancel(self, now: float, job_id: str) -> list[Effect]:
        """``CancelJob(job_id)``."""
        job = self.jobs.get(job_id)
        if job is None or job.finished:
            return []
        self._finish(job, now)
        holders = sorted({s.peer for s in job.shards if s.state == ShardState.AWARDED and s.peer})
        out: list[Effect] = [self._send(p, Cancel(job_id, ()), now) for p in holders]
        out.append(JobFinished(job_id, False, "cancelled"))
        return out

    def handle(self, now: float, inp: Input) -> list[Effect]:
        if not isinstance(inp, MessageReceived):
            if isinstance(inp, Submit):
                job_id, effects = self._submit(now, inp.req)
                return [JobAccepted(job_id), *effects]
            if isinstance(inp, CancelJob):
                return self._cancel(now, inp.job_id)
            raise LocalProtocolError("bad-input", type(inp).__name__)
        signed = self._receive(now, inp.sender, inp.data)
        if signed is None:
            return []
        self._last_heard = now
        msg = signed.msg
        try:
            if isinstance(msg, Gossip):
                pulled = self._pulled
                if pulled is not None and pulled[0] == inp.sender and not msg.reply:
                    # the answer to our last pull: a round trip to that peer
                    # (and its region) before any call for bids goes there
                    self._pulled = None
                    self.forecast.sample_rtt(inp.sender, now, now - pulled[1])
                    known = len(self.view)
                    out = self._handle_gossip(now, inp.sender, msg)
                    return out + self._pull_again(now, len(msg.entries), len(self.view) - known)
                return self._handle_gossip(now, inp.sender, msg)
            if isinstance(msg, PeerState):
                self._merge_state(now, inp.data, signed)
                return []
            if isinstance(msg, Bid):
                return self._on_bid(now, signed, msg)
            if isinstance(msg, LeaseRenew):
                return self._on_renew(now, signed, msg)
            if isinstance(msg, LeaseRenewBatch):
                return self._on_renew_batch(now, signed, msg)
            if isinstance(msg, ShardResult):
                return self._on_result(now, signed, msg)
            if isinstance(msg, AwardDecline):
                return self._on_decline(now, signed, msg)
            if isinstance(msg, ShardCheckpoint):
                self._on_checkpoint(signed, msg)
                return []
            if isinstance(msg, Accusation):
                self._handle_accusation(now, signed, msg)
                return []
            raise RemoteProtocolError("unexpected-kind", type(msg).__name__)
        except RemoteProtocolError as exc:
            self.rejected[exc.reason] += 1
            return []

    def poll(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if now >= self._next_gossip and (self.config.idle_pull or self._placing()):
            out.extend(self._pull(now))
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            found = self._held(heapq.heappop(heap), lease=True)
            if found is not None:
                job, sh = found
                self.stats["leases_lapsed"] += 1
                if now - self._last_heard < self.config.lease_s / 2:
                    # others still reach us: the holder, not our link, went quiet
                    self._suspect[sh.peer] = now + self.config.suspect_s
                else:
                    self.stats["leases_lapsed_cut_off"] += 1
                self._reopen(job, sh)
        aheap = self._award_heap
        while aheap and aheap[0][0] <= now:
            _, jid, idx, attempt, until, tries = heapq.heappop(aheap)
            found = self._held((until, jid, idx, attempt), lease=True)
            award = found[1].award if found is not None else None
            if found is None or award is None:
                continue  # renewed (so the award arrived), settled or reopened
            sh = found[1]
            # no renewal yet: the award (or the peer's first renewal) may be
            # lost; a peer that holds it answers a repeat with a renewal
            self.stats["awards_resent"] += 1
            out.append(self._send(sh.peer, award, now))
            if tries + 1 < self.config.award_resends:
                sh.resend_s = min(2.0 * (sh.resend_s or self.config.award_resend_s), self.config.award_resend_s)
                heapq.heappush(aheap, (now + sh.resend_s, jid, idx, attempt, until, tries + 1))
        sheap = self._straggle_heap
        while sheap and sheap[0][0] <= now:
            found = self._held(heapq.heappop(sheap), lease=False)
            if found is not None and found[1].backups < self.config.max_backups:
                job, sh = found
                # run a backup elsewhere; the first result wins, the other is cancelled
                self.stats["backups"] += 1
                sh.backups += 1
                sh.exclude.add(sh.peer)
                self._move(sh, "speculate")
                sh.attempt = max(sh.holders, default=-1) + 1
                sh.peer = ""
                job.next_round_at = -math.inf
        for job in list(self._active.values()):
            out.extend(self._advance(now, job))
        return out

    def next_deadline(self) -> float:
        t = self._next_gossip if self.config.idle_pull or self._placing() else math.inf
        heap = self._lease_heap
        aheap = self._award_heap
        while aheap:
            _, jid, idx, attempt, until, _ = aheap[0]
            if self._held((until, jid, idx, attempt), lease=True) is not None:
                t = min(t, aheap[0][0])
                break
            heapq.heappop(aheap)
        for h, lease in ((heap, True), (self._straggle_heap, False)):
            while h:
                if self._held(h[0], lease=lease) is not None:
                    t = min(t, h[0][0])
                    break
                heapq.heappop(h)  # stale: renewed, settled or finished
        for job in self._active.values():
            if job.round is not None:
                t = min(t, job.round.close_at)
            elif job.counts[ShardState.OPEN] and (not job.spec.chain or self._openable(job)):
                # (an open shard of a job that is not a chain is openable:
                # no list of them per job and call, which cost O(shards))
                t = min(t, job.next_round_at)
        return t

    def _held(self, entry: tuple[float, str, int, int], *, lease: bool) -> tuple[_Job, _Shard] | None:
        """The job and shard a lease- or straggler-heap entry still refers to
        (the attempt is still awarded, and for a lease, not renewed since)."""
        when, jid, idx, attempt = entry
        job = self._active.get(jid)
        if job is None:
            return None
        sh = job.shards[idx]
        if sh.state != ShardState.AWARDED or sh.attempt != attempt or (lease and sh.lease_until != when):
            return None
        return job, sh

    def _placing(self) -> bool:
        """Whether some job has a shard to place (open or being auctioned):
        only then does the client pull views."""
        for job in self._active.values():
            c = job.counts
            if job.spec.chain:
                nxt = job.done
                if nxt < len(job.shards) and job.shards[nxt].state in (ShardState.OPEN, ShardState.BIDDING):
                    return True
            elif c[ShardState.OPEN] or c[ShardState.BIDDING]:
                return True
        return False

    def _pull(self, now: float) -> list[Effect]:
        """Ask one peer of the view (a bootstrap peer if none) for a large
        slice of its view: a client has no state to push, it only needs to
        know most candidates for its jobs."""
        cfg = self.config
        # idle (no job unfinished) on an idle swarm (our view shows no busy
        # slot): the next pull comes twice as late as the last, up to
        # pull_quiet_max times the interval; a submit resets it. On a busy
        # swarm the pulls are how a client learns which peers just went
        # free (peers that are idle gossip quietly), and an idle client's
        # next job needs that (eval-philly at 200 peers, seed 2: max rho
        # 4.1 with quiet pulls there, 2.7 without)
        quiet = not self._active and self._swarm_idle(now)
        self._pull_quiet = min(2 * self._pull_quiet, cfg.pull_quiet_max) if quiet else 1
        self._last_pull_at = now
        self._next_gossip = now + cfg.gossip_interval_s * self._pull_quiet
        self.view.expire(now)
        peers = self.view.peers_but(self.id) or list(self.config.bootstrap)
        if not peers:
            return []
        to = self.rng.choice(peers)
        self._pulled = (to, now)
        self.stats["pulls"] += 1
        return [self._gossip_to(now, to, reply=True, entries=0, want=self.config.pull_entries)]

    def _swarm_idle(self, now: float) -> bool:
        """Whether the swarm looks idle from our view: no busy slot, and no
        model span served (an LLM client's routes follow the spans in this
        view, which move while no shard runs anywhere)."""
        if self.view.capacity(now)[2]:
            return False
        return not any(e.state.spans for e in self.view.live(now))

    def _pull_again(self, now: float, got: int, new: int) -> list[Effect]:
        """After the answer to a pull (``got`` entries, ``new`` of them peers
        the view lacked): another pull at once if enough of it was news
        (``pull_again_share``), so the view catches up with a large swarm in
        a burst of pulls, each one justified by the answer to the last."""
        cfg = self.config
        want = cfg.pull_entries
        if not cfg.pull_again_share or not want or new < cfg.pull_again_share * min(want, got):
            return []
        if not (cfg.idle_pull or self._placing()):
            return []
        self.stats["pulls_again"] += 1
        return self._pull(now)

    def _set_lease(self, sh: _Shard, job_id: str, until: float) -> None:
        sh.lease_until = until
        heapq.heappush(self._lease_heap, (until, job_id, sh.index, sh.attempt))

    def _finish(self, job: _Job, now: float) -> None:
        job.finished = True
        job.finished_at = now
        self._active.pop(job.spec.job_id, None)

    def job_status(self, job_id: str) -> dict[str, Any]:
        job = self.jobs[job_id]
        counts: dict[str, int] = {}
        for s in job.shards:
            counts[s.state] = counts.get(s.state, 0) + 1
        return {"job_id": job_id, "shards": len(job.shards), "done": job.done, "finished": job.finished, **counts}

    def forget(self, job_id: str) -> None:
        """Drop a finished job's bookkeeping (late messages are then refused)."""
        job = self.jobs.get(job_id)
        if job is not None and job.finished:
            del self.jobs[job_id]

    def __repr__(self) -> str:
        active = sum(1 for j in self.jobs.values() if not j.finished)
        return f"<ClientCore {self.id[:16]}… view={len(self.view)} jobs={len(self.jobs)} active={active}>"

    # ------------------------------------------------------------------
    # auction rounds

    def _move(self, sh: _Shard, event: str) -> None:
        new = _TRANSITIONS.get((sh.state, event))
        if new is None:
            raise LocalProtocolError("bad-transition", f"shard {sh.index}: {sh.state} --{event}-->")
        sh.counts[sh.state] -= 1
        sh.counts[new] += 1
        sh.state = new

    def _openable(self, job: _Job) -> list[_Shard]:
        if job.spec.chain:
            nxt = job.done
            return [job.shards[nxt]] if nxt < len(job.shards) and job.shards[nxt].state == ShardState.OPEN else []
        return [s for s in job.shards if s.state == ShardState.OPEN]

    def _eligible(self, job: JobSpec, now: float, entries: list[ViewEntry] | None = None) -> list[ViewEntry]:
        return list(self._iter_eligible(job, now, entries))

    def _iter_eligible(self, job: JobSpec, now: float, entries: list[ViewEntry] | None = None) -> Iterator[ViewEntry]:
        # (per round over hundreds of entries: the loop's lookups are bound once)
        me, banned, suspect, silent = self.id, self.banned, self._suspect.get, self._silent
        gpus, task, mem, min_trust = job.gpus, job.task, job.mem_bytes, self.config.min_trust
        window = self.config.bid_window_s
        for e in self.view.live(now) if entries is None else entries:
            st = e.state
            peer = e.peer
            if peer == me or peer in banned or suspect(peer, 0.0) > now:
                continue
            if silent:
                quiet_since = silent.get(peer)
                if quiet_since is not None:
                    if e.issued_at > quiet_since:
                        del silent[peer]  # it signed a state since: alive
                    elif now - quiet_since > max(window, self.forecast.rto(peer) or 0.0):
                        continue  # a bid of its is not coming now (its call was not answered in a whole window)
            if st.slots < gpus:
                continue
            tp = st.throughput
            if task not in tp and "*" not in tp:
                continue
            if mem and all(d.mem_total < mem for d in st.devices):
                continue
            if min_trust and st.trust != min_trust:
                continue
            yield e

    def _candidates(self, spec: JobSpec, now: float, want: int) -> tuple[list[ViewEntry], bool]:
        """Whom a round may rank, and whether that is a sample: the eligible
        peers of the whole live view when it holds at most ``rank_max``;
        else those of a seeded random sample of live entries plus the peers
        that lately won this client's awards (``_good``), the whole view
        again when fewer than ``want`` of them are eligible (a gang few
        peers can host). The sample holds ``rank_per_probe`` entries per
        invitation the round wants, at most ``rank_max``; a sample smaller
        than ``rank_max`` adds only the newest quarter-sample's worth of
        winners. So a round costs O(want), at most O(rank_max), not
        O(view), as in Sparrow's (d probes per task) and Megha's sampling."""
        cap = self.config.rank_max
        live = self.view.live(now)
        if not cap or len(live) <= cap:
            return self._eligible(spec, now), False
        per = self.config.rank_per_probe
        size = min(cap, per * want) if per else cap
        picked = [live[i] for i in sorted(self.rng.sample(range(len(live)), size))]
        have = {e.peer for e in picked}
        good: Iterable[str] = self._good
        if size < cap:  # the newest winners, in proportion to the sample
            good = list(self._good)[-max(size // 4, 1):]
        for p in good:
            e = self.view.get(p)
            if e is not None and p not in have and e.expires_at > now and not e.state.leaving:
                picked.append(e)
        out = self._eligible(spec, now, picked)
        if len(out) < want:
            self.stats["rank_whole_view"] += 1
            return self._eligible(spec, now), False
        return out, True

    def _note_good(self, peer: str) -> None:
        """``peer`` won an award: rank it in later samples (the newest
        ``rank_max // 4`` such peers are kept)."""
        good = self._good
        good.pop(peer, None)
        good[peer] = None
        if len(good) > max(self.config.rank_max // 4, 1):
            del good[next(iter(good))]

    def _advance(self, now: float, job: _Job) -> list[Effect]:
        out: list[Effect] = []
        if job.round is not None and now >= job.round.close_at:
            out.extend(self._close_round(now, job))
        if job.finished or job.round is not None or now < job.next_round_at or not job.counts[ShardState.OPEN]:
            return out
        open_ = self._openable(job)
        if not open_:
            return out
        cfg = self.config
        need = len(open_) * max(job.spec.gpus, 1)
        cands, sampled = self._candidates(job.spec, now, min(max(int(math.ceil(cfg.probe_ratio * need)),
                                                                 cfg.probe_min), cfg.probe_max))
        if job.asked:
            # a second look: peers not asked yet (all of them again if none is left)
            cands = [e for e in cands if e.peer not in job.asked] or cands
        if not cands:
            for sh in open_:
                if sh.rescue is not None:
                    self._keep_rescued(job, sh)
            self._backoff(job, now)
            self.stats["rounds_no_candidates"] += 1
            return out
        if job.resumable:
            # a round's shards share one share of work left (its bids price
            # that): shards that resume from a checkpoint go one such group
            # at a time, before the others
            left = min(s.left for s in open_)
            open_ = [s for s in open_ if s.left == left]
        else:
            left = 1.0
        excluded = max((len(s.exclude) for s in open_), default=0)
        # d probes per slot needed: a gang of g GPUs asks like g tasks would,
        # since few peers can host it and their queues differ widely
        # a second look asks twice as many: the view has just proved stale
        want = max(int(math.ceil(cfg.probe_ratio * need)), cfg.probe_min) << job.rebids
        want = min(want + excluded, cfg.probe_max, len(cands))
        invited = self._pick(job.spec, cands, want, now, stale=job.rebids > 0)
        if job.moved_to:
            # the holder saw these idle: they bid beside the usual picks, and
            # the bids decide (one may have filled up meanwhile)
            invited.extend(p for p in sorted(job.moved_to) if p not in invited and p not in self.banned)
            job.moved_to.clear()
        if any(s.candidates for s in open_):
            # a second opinion from a trusted peer settles a shard at once and
            # makes a caught liar's accusation believable to the whole swarm
            trusted = [e.peer for e in cands if e.trusted and e.peer not in invited]
            invited.extend(trusted[:2])
        shards = tuple(s.index for s in open_[:4096])
        rid = job.next_round_id
        job.next_round_id += 1
        job.round = rnd = _Round(rid, shards, set(invited), now + self.forecast.bid_window(invited), now)
        if sampled:
            rnd.ranked = tuple(e.peer for e in cands)
        for p in invited:
            e = self.view.get(p)
            if e is not None and self.forecast.news_wait(job.spec, e, now) is None:
                w = self.forecast.view_wait(job.spec, e, now)
                rnd.predicted[p] = (self.forecast.stale_class(job.spec, e, now, w), w)
        for i in shards:
            sh = job.shards[i]
            self._move(sh, "invite")
            sh.round = rid
        cfb = CallForBids(job.raw, shards, rid, left)
        data = self._encode(cfb, now)
        for p in invited:  # encoded once for all, so not through _send: the same credit
            self.solicited.grant(p, replies_invited(cfb), now)
        out.extend(Send(p, data, "CallForBids", self._addrs_of(p)) for p in invited)
        self.stats["cfb_sent"] += len(invited)
        self.stats["rounds"] += 1
        return out

    def _pick(self, spec: JobSpec, cands: list[ViewEntry], want: int, now: float, *, stale: bool = False
              ) -> list[str]:
        """Whom to invite: the ``want`` candidates with the earliest estimated
        finish, a share of them (``explore_ratio``) swapped for random others.
        A finish through a peer counts two of its round trips: the call and
        its bid, then the award and the result (for a sub-second shard a
        near peer that runs it slower can finish first).

        The view is free to consult but seconds old; the bids say the truth.
        Ranking the whole view finds the fast peers a random sample misses on
        a heterogeneous swarm; the random picks keep stale entries honest and
        spread load when many clients share one view. ``stale`` (a second
        look, after the view proved wrong): estimates from states alone are
        corrected by how far off states of their age have lately been, so
        fresh states rank above old ones that say the same.
        """
        if len(cands) <= want:
            return [e.peer for e in cands]
        n_explore = min(int(want * self.config.explore_ratio), want - 1)
        top = self.forecast.rank(spec, cands, want - n_explore, now, stale=stale)
        chosen = {e.peer for e in top}
        rest = [e for e in cands if e.peer not in chosen]
        return [e.peer for e in top] + [e.peer for e in self.rng.sample(rest, n_explore)]

    def _backoff(self, job: _Job, now: float) -> None:
        cfg = self.config
        job.backoff = min(max(job.backoff * 2, cfg.retry_backoff_s), cfg.retry_backoff_max_s)
        job.next_round_at = now + job.backoff * (0.5 + self.rng.random())

    def _on_bid(self, now: float, signed: Signed, bid: Bid) -> list[Effect]:
        self._silent.pop(signed.author, None)
        job = self.jobs.get(bid.job_id)
        if job is None or job.finished:
            self.stats["bids_late"] += 1
            return []
        rnd = job.round
        if rnd is None or rnd.id != bid.round:
            self.stats["bids_late"] += 1
            late = job.closed
            if late is not None and late[0] == bid.round and signed.author in late[2]:
                self.forecast.sample_rtt(signed.author, now, now - late[1])
            if rnd is None and now < job.next_round_at and job.counts[ShardState.OPEN] and job.rearms < MAX_REARMS:
                # the backoff is for a swarm that does not answer; this peer
                # did, after the window. A peer busy with a burst of awards
                # and acks bids late like this, and the doubled backoff had
                # left verification replicas waiting 11 s after it was free.
                # Bounded: a bidder always later than any window gets
                # MAX_REARMS rounds more per award, then the backoff again.
                return self._rearm(now, job)
            return []
        if signed.author not in rnd.invited:
            raise RemoteProtocolError("uninvited-bid", signed.author[:16])
        if not set(bid.shards) <= set(rnd.shards):
            raise RemoteProtocolError("no-such-shard", bid.job_id)
        rnd.bids[signed.author] = bid
        rnd.unconfirmed[signed.author] = self._unconfirmed(signed.author, rnd.called_at)
        self.forecast.sample_rtt(signed.author, now, now - rnd.called_at)
        self.stats["bids_received"] += 1
        if len(rnd.bids) >= len(rnd.invited) or self._rest_would_lose(now, job, rnd):
            return self._close_round(now, job) + self._advance(now, job)
        return []

    def _rearm(self, now: float, job: _Job) -> list[Effect]:
        """Lift a job's backoff and auction its open shards now."""
        self.stats["rounds_rearmed"] += 1
        job.rearms += 1
        job.backoff = 0.0
        job.next_round_at = now
        return self._advance(now, job)

    def _rest_would_lose(self, now: float, job: _Job, rnd: _Round) -> bool:
        """Whether a one-shard round may close before every invitee bid:
        the best bid in hand finishes sooner than each missing invitee
        could, by the view, were its bid to come when its round trip says
        (a bid still on its way delays the award by the time left to its
        arrival). "Could": past the invitee's running work only, since its
        queue is ordered by fairness and the shard may pass what waits
        there (a peer whose state showed minutes of queued work bid a start
        in 62 s for a tenant with the worst rho, and a round that counted
        the queue gave the shard to a finish 6 minutes later). Waiting for
        them, up to the bid window, would most likely change nothing but
        the award's time: a far peer's bid arrives after a near one's, a
        peer that crashed or is busy for minutes never wins. "Sooner": by
        more than ``close_margin_s``; an invitee that could at best tie is
        not waited for (a lost bid from one of four idle peers alike, 1 ms
        nearer by its round trip, kept a 0.35 s task's round open for the
        whole 0.5 s window). Not for shards awaiting a trusted second
        opinion or jobs that price energy (neither is ranked by finish
        alone)."""
        if len(rnd.shards) != 1 or job.spec.lam > 0:
            return False
        sh = job.shards[rnd.shards[0]]
        if sh.candidates:
            return False
        spec = job.spec
        best = math.inf
        for p, (b, at, early) in self._bids_in_hand(job, rnd).items():
            if p in sh.exclude or p in self.banned:
                continue
            best = min(best, position(b, self.forecast.awarded_since(p, at) + early) + b.run_s + self.forecast.transit(p))
        for p in sorted(rnd.invited):  # a fixed order: forecasts have side effects
            if p in rnd.bids or p in sh.exclude or p in self.banned:
                continue
            e = self.view.get(p)
            if e is None:
                return False
            rtt = self.forecast.transit(p, e)
            arrives = max(rnd.called_at + rtt - now, 0.0)
            soonest = self.forecast.view_wait(spec, e, now, queued=False) + run_time(spec, e.state.throughput)
            if arrives + soonest + rtt < best - self.config.close_margin_s:
                return False
        self.stats["rounds_closed_early"] += 1
        return True

    @staticmethod
    def _bids_in_hand(job: _Job, rnd: _Round) -> dict[str, tuple[Bid, float, int]]:
        """Per bidder, the round's bids and those a second look carried over:
        (bid, when its call went out, awards sent before the call that it
        had not confirmed). Awards sent since the call may not be in it."""
        return {**job.carried, **{p: (b, rnd.called_at, rnd.unconfirmed.get(p, 0)) for p, b in rnd.bids.items()}}

    @staticmethod
    def _left(job: _Job, shards: tuple[int, ...], now: float) -> float:
        """Time left to the deadline for a round's shards (inf: none)."""
        left = deadline_left(job.spec, min(shards), now)
        return math.inf if left is None else left

    def _unconfirmed(self, peer: str, t: float) -> int:
        """Awards sent to ``peer`` before ``t`` that it has not confirmed
        (no renewal yet): a bid it made may not count them, since a small
        call for bids can overtake a large award on the wire."""
        n = 0
        for _, _, when, jid, idx, attempt in self.forecast.pending(peer):
            if when >= t:
                continue
            job = self._active.get(jid)
            if job is None:
                continue
            sh = job.shards[idx]
            if sh.award is not None and sh.attempt == attempt and sh.peer == peer and sh.state == ShardState.AWARDED:
                n += 1
        return n

    def _second_look(self, now: float, job: _Job, rnd: _Round, seen: dict[str, tuple[float, float]],
                     left: float) -> bool:
        """Whether the best bid finishes so much later than the view promises
        elsewhere that the round is worth running again with others.

        ``seen``: per bidder, (the start the award rule credits its bid with,
        its run at full clock): a bid made before awards it could not count
        is floored by this client's replay, here as in the award. ``left``:
        time to the round's deadline (inf: none)."""
        cfg = self.config
        if job.rebids >= cfg.max_rebids or not seen:
            return False
        # compare at full clock: a bid slowed down to save energy is not late
        best_w, best_r = min(seen.values(), key=lambda wr: wr[0] + wr[1])
        best = best_w + best_r
        # the least gain worth a second round: rebid_min_s, or rebid_min_runs
        # runs of the shard if fewer (a sub-second shard that would wait 2 s
        # is worth a look at the free peers the view lists)
        floor = cfg.rebid_min_s
        if cfg.rebid_min_runs > 0:
            floor = min(floor, cfg.rebid_min_runs * best_r)
        # a finish within that floor of now is good enough if it meets the
        # deadline (a bid that starts at once but runs slowly is not: a free
        # volunteer GPU where the view lists faster ones)
        if best < floor and best <= left:
            return False
        spec = job.spec
        asked = job.asked | rnd.invited
        if rnd.ranked is None:
            pool = self._eligible(spec, now)
        else:  # the sample the round ranked: a second look must not cost a whole view either
            pool = self._eligible(spec, now, [e for e in map(self.view.get, rnd.ranked)
                                              if e is not None and e.expires_at > now and not e.state.leaving])
        margin = max(cfg.rebid_gain * best, floor)
        return self._sooner_elsewhere(spec, [e for e in pool if e.peer not in asked], now, best, left, margin)

    def _sooner_elsewhere(self, spec: JobSpec, pool: list[ViewEntry], now: float, finish: float, left: float,
                          margin: float) -> bool:
        """Whether the view says some peer of ``pool`` finishes ``spec``'s
        shard more than ``margin`` before ``finish`` (seconds from now), or
        within ``left`` (the deadline; inf: none) where ``finish`` is not."""
        late = finish > left

        def wins(alt: float) -> bool:  # monotone: a sooner finish wins too
            return (late and left >= alt) or finish - alt > margin

        return self.forecast.beats(spec, pool, now, wins)

    def _close_round(self, now: float, job: _Job) -> list[Effect]:
        rnd = job.round
        assert rnd is not None
        job.round = None
        missing = rnd.invited - rnd.bids.keys()
        if missing:
            # closed early or when its window ran out: a bid that comes
            # later is still a round trip (a longer one than the timeout
            # assumed), and is sampled as one
            job.closed = (rnd.id, rnd.called_at, frozenset(missing))
            if rnd.bids:
                # others answered, so our link works: an invitee that never
                # bids may be gone. An idle peer's state lives for
                # state_ttl_s * gossip_quiet_max, and one that crashed looks
                # free and ranks first all that time (eval-philly: 10% of
                # calls went to such peers); it is asked again once it bids
                # late or a state of it issued after this call arrives (and
                # is still asked until its bid could not be merely late)
                silent = self._silent
                for p in sorted(missing):
                    silent.setdefault(p, rnd.called_at)
                if len(silent) > 2 * self.config.max_view:
                    self._silent = {p: t for p, t in silent.items() if p in self.view}
        spec = job.spec
        out: list[Effect] = []
        for peer, bid in rnd.bids.items():
            self.forecast.remember(now, peer, bid, spec.deadline_s is not None)
        bids = self._bids_in_hand(job, rnd)
        # shards this client gave a bidder (for other jobs) that its bid may
        # not count: those sent after the call, and those sent before it
        # that the bidder had not confirmed when it bid
        unseen = {p: self.forecast.awarded_since(p, at) + early for p, (_, at, early) in bids.items()}
        for peer, bid in rnd.bids.items():
            if not unseen[peer]:
                self.forecast.learn_stale(rnd.predicted.get(peer), bid)
        left = self._left(job, rnd.shards, now)
        # per bidder with unseen awards: the wait this client's own replay of
        # its queue says (it changes only when a shard is awarded there)
        floor: dict[str, float] = {}

        def finish_on(peer: str, bid: Bid, k: int) -> float:
            # k shards ahead that the bid did not count: at the start the
            # bid lists for a (k+1)-th shard (its free slots go first), past
            # those spread on all its slots
            finish = position(bid, k) + bid.run_s
            if unseen[peer]:
                # the bid's start is for the slots free when it was made;
                # unseen awards may take exactly those. This client's own
                # replay of the peer's queue (view + its awards since) is
                # the floor.
                wait = floor.get(peer)
                if wait is None:
                    e = self.view.get(peer)
                    wait = -math.inf
                    if e is not None:
                        wait = self.forecast.eta(spec, e, now) - run_time(spec, e.state.throughput)
                    floor[peer] = wait
                finish = max(finish, wait + bid.run_s)
            return finish

        # what each bid is worth to the award rule: its first position,
        # after the awards it may not count
        seen = {p: (finish_on(p, v[0], unseen[p]) - v[0].run_s, v[0].run_s * v[0].level) for p, v in bids.items()}
        if self._second_look(now, job, rnd, seen, left):
            job.carried = bids
            job.asked |= rnd.invited
            job.rebids += 1
            for i in rnd.shards:
                sh = job.shards[i]
                if sh.state == ShardState.BIDDING and sh.round == rnd.id:
                    self._move(sh, "no-bid")
            job.next_round_at = now
            self.stats["rebids"] += 1
            return out
        job.carried = {}
        job.asked = set()
        job.rebids = 0
        assigned: dict[str, int] = {}
        # per shard, the bids that list it, in bidder order: a round of 100
        # shards and 100 bidders scanned every bid's shard tuple per shard
        # (with what does not change while the round's shards are awarded:
        # the bidder's transit, its bid's energy term, whether it is trusted)
        bidders: dict[int, list[tuple[str, Bid, float, float, bool]]] = {}
        carbon_w = self.config.carbon_weight
        for p, v in sorted(bids.items()):
            b = v[0]
            row = (p, b, self.forecast.transit(p), spec.lam * (b.energy_j + carbon_w * b.carbon_g), self.is_trusted(p))
            for s in b.shards:
                bidders.setdefault(s, []).append(row)
        banned = self.banned
        awarded_any = False
        for i in rnd.shards:
            sh = job.shards[i]
            if sh.state != ShardState.BIDDING or sh.round != rnd.id:
                continue
            # order: a trusted second opinion (settles a shard at once), then
            # bids that meet the deadline, then weighted finish + lam * energy
            best: tuple[tuple[bool, bool, float, str], Bid, float] | None = None
            exclude, second = sh.exclude, bool(sh.candidates)
            for peer, bid, transit, energy, trusted in bidders.get(i, ()):
                if peer in exclude or peer in banned:
                    continue
                finish = finish_on(peer, bid, assigned.get(peer, 0) + unseen[peer])
                cost = spec.weight * (finish + transit) + energy
                key = (not (second and trusted), finish > left, cost, peer)
                if best is None or key < best[0]:
                    best = (key, bid, finish)
            r = sh.rescue
            if r is not None:
                if best is None or best[2] >= r.finish - now - self.config.rebid_min_s:
                    self._keep_rescued(job, sh)  # nothing sooner than where it waits
                    continue
                r.moved_finish = now + best[2]
            if best is None:
                self._move(sh, "no-bid")
                continue
            peer, bid, expect = best[0][3], best[1], best[2]
            assigned[peer] = assigned.get(peer, 0) + 1
            floor.pop(peer, None)  # its queue has one more shard
            self.forecast.note_award(peer, now, (bid.run_s, max(spec.gpus, 1), now, spec.job_id, i, sh.attempt))
            self._move(sh, "award")
            sh.peer = peer
            self._note_good(peer)
            sh.holders[sh.attempt] = peer
            sh.live.add(sh.attempt)
            self._set_lease(sh, job.spec.job_id, now + self.config.lease_s + self.config.bid_window_s)
            if self.config.straggler_factor > 0 and sh.backups < self.config.max_backups:
                late = now + self.config.straggler_factor * expect + self.config.straggler_min_s
                heapq.heappush(self._straggle_heap, (late, job.spec.job_id, sh.index, sh.attempt))
            awarded_any = True
            self.stats["awards_sent"] += 1
            award = Award(job.raw, peer, i, sh.attempt, self.config.lease_s, bid.level, sh.left, sh.resume)
            if sh.resume:
                self.stats["awards_resumed"] += 1
            out.append(self._send(peer, award, now))
            sh.award = award
            if self.config.award_resend_s > 0:
                sh.resend_s = self.forecast.resend_after(left - expect, expect, peer)
                heapq.heappush(self._award_heap, (now + sh.resend_s, job.spec.job_id, i, sh.attempt,
                                                  sh.lease_until, 0))
        if awarded_any:
            job.backoff = 0.0
            job.rearms = 0
            job.next_round_at = now
        else:
            self._backoff(job, now)
            self.stats["rounds_no_bids"] += 1
        return out

    def _holder(self, job_id: str, shard: int, attempt: int, author: str) -> tuple[_Job, _Shard] | None:
        job = self.jobs.get(job_id)
        if job is None or shard >= len(job.shards):
            return None
        sh = job.shards[shard]
        if sh.holders.get(attempt) != author:
            return None
        return job, sh

    def _on_renew(self, now: float, signed: Signed, msg: LeaseRenew) -> list[Effect]:
        out: list[Effect] = []
        out.insert(0, self._send(signed.author, self._renew_ack(now, signed.author, msg, out), now))
        return out

    def _on_renew_batch(self, now: float, signed: Signed, msg: LeaseRenewBatch) -> list[Effect]:
        out: list[Effect] = []
        acks = tuple(self._renew_ack(now, signed.author, r, out) for r in msg.renewals)
        out.insert(0, self._send(signed.author, LeaseAckBatch(acks), now))
        return out

    def _renew_ack(self, now: float, peer: str, msg: LeaseRenew, out: list[Effect]) -> LeaseAck:
        """Extend (or revoke) ``peer``'s lease that ``msg`` renews; a rescue
        that this settles appends its cancel to ``out``."""
        found = self._holder(msg.job_id, msg.shard, msg.attempt, peer)
        if found is None:
            self.stats["renewals_unknown"] += 1
            return LeaseAck(msg.job_id, msg.shard, msg.attempt, False, 0.0)
        job, sh = found
        current = not job.finished and sh.state != ShardState.DONE and msg.attempt in sh.live
        # a shard with a long way to go gets a longer lease (fewer renewals);
        # one close to done keeps the short one, so a crash is noticed fast
        cfg = self.config
        granted = min(max(cfg.lease_s, 0.5 * msg.eta_s), cfg.max_lease_s)
        if cfg.short_lease_factor > 0:
            # its result is due within eta_s: silence well past that is a
            # crash (the peer renews at a third of the lease it holds)
            granted = min(granted, max(cfg.short_lease_min_s, cfg.short_lease_factor * msg.eta_s))
        if current and sh.state == ShardState.AWARDED and sh.attempt == msg.attempt:
            self._set_lease(sh, job.spec.job_id, now + granted)
            sh.award = None
            if msg.running:
                if sh.rescue is not None:
                    out.extend(self._drop_rescued(now, job, sh))
            elif cfg.rescue_gain > 0 and not sh.rescued and self._worth_rescue(now, job, sh, msg.eta_s):
                self._rescue(now, job, sh, msg.eta_s)
        elif current and sh.rescue is not None and sh.rescue.attempt == msg.attempt:
            r = sh.rescue
            r.until = now + granted
            if msg.running and not r.running:
                r.running = True
                if sh.state == ShardState.AWARDED and r.moved_finish < now + msg.eta_s - cfg.rebid_min_s:
                    # the new attempt should still finish well before: both
                    # go on, the first result wins and cancels the other
                    sh.rescue = None
                    self.stats["rescues_raced"] += 1
                else:  # the queued attempt started first: it keeps the shard
                    out.extend(self._keep_rescued(job, sh, now))
        self.stats["renewals"] += 1
        return LeaseAck(msg.job_id, msg.shard, msg.attempt, current, granted)

    def _worth_rescue(self, now: float, job: _Job, sh: _Shard, eta: float) -> bool:
        """Whether a shard queued at its holder, due to finish in ``eta``
        seconds, should finish so much sooner elsewhere, as the view says,
        that it is worth an auction (``rescue_gain`` of ``eta`` sooner, and
        ``rebid_min_s``; or in time for a deadline it would miss there)."""
        cfg = self.config
        spec = job.spec
        if eta <= cfg.rebid_min_s or spec.chain or sh.candidates:
            return False
        cands, _ = self._candidates(spec, now, cfg.probe_min)
        banned = self.banned
        pool = [e for e in cands if e.peer != sh.peer and e.peer not in sh.exclude and e.peer not in banned]
        return self._sooner_elsewhere(spec, pool, now, eta, self._left(job, (sh.index,), now),
                                      max(cfg.rescue_gain * eta, cfg.rebid_min_s))

    def _rescue(self, now: float, job: _Job, sh: _Shard, eta: float) -> None:
        """Auction ``sh`` again with its queued attempt kept (``_Rescue``)."""
        self.stats["rescues"] += 1
        sh.rescued = True
        sh.rescue = _Rescue(sh.attempt, sh.peer, now + eta, sh.lease_until)
        sh.exclude.add(sh.peer)
        self._move(sh, "rescue")
        sh.attempt = max(sh.holders, default=-1) + 1
        sh.peer = ""
        job.next_round_at = -math.inf

    def _keep_rescued(self, job: _Job, sh: _Shard, now: float | None = None) -> list[Effect]:
        """The queued attempt stays the shard's: the auction found nothing
        sooner, the new attempt was lost, or the queued one started first
        (then a new attempt already awarded is cancelled, at ``now``)."""
        r = sh.rescue
        assert r is not None
        sh.rescue = None
        self.stats["rescues_kept"] += 1
        out: list[Effect] = []
        if sh.state == ShardState.AWARDED:
            sh.live.discard(sh.attempt)
            self.forecast.unpend(sh.peer, job.spec.job_id, sh.index, sh.attempt)
            if now is not None:
                out.append(self._send(sh.peer, Cancel(job.spec.job_id, (sh.index,)), now))
        else:
            self._move(sh, "keep")
        sh.attempt = r.attempt
        sh.peer = r.peer
        sh.award = None
        sh.exclude.discard(r.peer)
        self._set_lease(sh, job.spec.job_id, r.until)
        return out

    def _drop_rescued(self, now: float, job: _Job, sh: _Shard) -> list[Effect]:
        """The new attempt runs: the queued one is cancelled (unless it runs
        too, as far as we know; then the first result wins)."""
        r = sh.rescue
        assert r is not None
        sh.rescue = None
        if r.running:
            return []
        self.stats["rescues_moved"] += 1
        sh.live.discard(r.attempt)
        self.forecast.unpend(r.peer, job.spec.job_id, sh.index, r.attempt)
        return [self._send(r.peer, Cancel(job.spec.job_id, (sh.index,)), now)]

    def _on_decline(self, now: float, signed: Signed, msg: AwardDecline) -> list[Effect]:
        found = self._holder(msg.job_id, msg.shard, msg.attempt, signed.author)
        if found is None:
            raise RemoteProtocolError("unknown-lease", msg.job_id)
        job, sh = found
        self.forecast.unpend(signed.author, msg.job_id, msg.shard, msg.attempt)
        self.stats["declines"] += 1
        sh.live.discard(msg.attempt)
        if sh.rescue is not None and sh.rescue.attempt == msg.attempt:
            sh.rescue = None  # the queued attempt was handed back: the auction goes on without it
        if not job.finished and sh.state == ShardState.AWARDED and sh.attempt == msg.attempt:
            if msg.reason == "moved" and msg.to and msg.to != signed.author:
                job.moved_to.add(msg.to)
                self.stats["declines_moved"] += 1
            self._reopen(job, sh)
            return self._advance(now, job)
        return []

    def _on_checkpoint(self, signed: Signed, msg: ShardCheckpoint) -> None:
        """Keep the latest checkpoint of a shard's current attempt: should
        its peer be lost, the next attempt goes on from there (``_advance``
        and ``_close_round`` put it in the call for bids and the award)."""
        found = self._holder(msg.job_id, msg.shard, msg.attempt, signed.author)
        if found is None:
            raise RemoteProtocolError("unknown-lease", msg.job_id)
        job, sh = found
        cfg = self.config
        if job.finished or sh.state != ShardState.AWARDED or sh.attempt != msg.attempt or msg.done <= 1.0 - sh.left:
            self.stats["checkpoints_stale"] += 1  # a later attempt runs, or it is no further on
            return
        if not cfg.resume or (cfg.verify != "none" and not self.is_trusted(signed.author)):
            self.stats["checkpoints_ignored"] += 1
            return
        if not sh.resume:
            job.resumable += 1
        sh.left = 1.0 - msg.done
        sh.resume = msg.state
        self.stats["checkpoints"] += 1

    def _forget_checkpoint(self, job: _Job, sh: _Shard) -> None:
        if sh.resume:
            job.resumable -= 1
        sh.left = 1.0
        sh.resume = b""

    def _reopen(self, job: _Job, sh: _Shard) -> None:
        r = sh.rescue
        if r is not None and r.attempt in sh.live:
            self._keep_rescued(job, sh)  # the new attempt was lost: the queued one still waits
            return
        sh.rescue = None
        sh.live.discard(sh.attempt)
        self._move(sh, "reopen")
        sh.attempt = max(sh.holders, default=-1) + 1
        sh.peer = ""
        job.next_round_at = -math.inf  # auction it at the next opportunity

    def _on_result(self, now: float, signed: Signed, msg: ShardResult) -> list[Effect]:
        found = self._holder(msg.job_id, msg.shard, msg.attempt, signed.author)
        if found is None:
            raise RemoteProtocolError("unsolicited-result", msg.job_id)
        job, sh = found
        self.forecast.unpend(signed.author, msg.job_id, msg.shard, msg.attempt)
        ack = self._send(signed.author, ResultAck(msg.job_id, msg.shard, msg.attempt), now)
        if job.finished or sh.state == ShardState.DONE or any(c.attempt == msg.attempt for c in sh.candidates):
            self.stats["results_duplicate"] += 1
            return [ack]
        out: list[Effect] = [ack]
        current = sh.state == ShardState.AWARDED and sh.attempt == msg.attempt
        if not msg.ok:
            self.stats["results_failed"] += 1
            if current:
                sh.failures += 1
                # the run may have failed on the state it resumed from
                self._forget_checkpoint(job, sh)
                if sh.failures >= self.config.max_attempts:
                    out.extend(self._fail(now, job, sh, f"shard {sh.index} failed: {msg.error}"))
                    return out
                self._reopen(job, sh)
                out.extend(self._advance(now, job))
            return out
        author = signed.author
        if not sh.candidates:
            if not self._wants_check(author):
                self.stats["results_unchecked"] += 1
                return out + self._accept(now, job, sh, author, msg)
            # hold the result and ask another peer for the same shard
            sh.candidates.append(Candidate(author, msg.attempt, msg, signed.raw))
            sh.exclude.add(author)
            self.stats["verifications"] += 1
            return out + self._ask_another(now, job, sh, current)
        sh.candidates.append(Candidate(author, msg.attempt, msg, signed.raw))
        sh.exclude.add(author)
        return out + self._settle(now, job, sh, current)

    def _wants_check(self, peer: str) -> bool:
        cfg = self.config
        if cfg.verify == "none" or self.is_trusted(peer):
            return False
        if cfg.verify == "always":
            return True
        rep = self.reputation.get(peer, 0.0)
        rate = max(cfg.verify_min_rate, 1.0 - rep / cfg.verify_trust_after)
        return self.rng.random() < rate

    def _ask_another(self, now: float, job: _Job, sh: _Shard, current: bool) -> list[Effect]:
        """Hold the shard's results and auction it again for another opinion.

        When no peer in the view but those that already answered can run the
        shard, waiting would last until the job's timeout: with ``verify``
        ``auto`` (a spot check) a lone result is accepted unverified
        (``results_unverifiable``); with ``always``, or results that disagree,
        the job fails at once and says why."""
        # one other eligible peer is enough to know: a lazy scan, not a list
        # of the whole view per verified result (O(view) at 10,000 peers)
        others = any(e.peer not in sh.exclude for e in self._iter_eligible(job.spec, now))
        if not others:
            if self.config.verify == "auto" and len(sh.candidates) == 1:
                self.stats["results_unverifiable"] += 1
                first = sh.candidates[0]
                return self._accept(now, job, sh, first.peer, first.msg)
            self.stats["verify_no_peer"] += 1
            have = len({c.peer for c in sh.candidates})
            return self._fail(now, job, sh, f"shard {sh.index}: no other peer can verify its result "
                                            f"({have} peer(s) answered, none else in the view can run it; "
                                            "verification needs one more peer, or --verify none)")
        if current:
            self._move(sh, "verify")
            sh.attempt = max(sh.holders, default=-1) + 1
            sh.peer = ""
            job.next_round_at = -math.inf
        return self._advance(now, job)

    def _settle(self, now: float, job: _Job, sh: _Shard, current: bool) -> list[Effect]:
        """Decide a shard from the results collected for it, if they allow
        (``verdict.settle``), and apply the verdict."""
        cfg = self.config
        trusted = {c.peer for c in sh.candidates if self.is_trusted(c.peer)}
        verdict = settle(sh.candidates, trusted, quorum=cfg.quorum, max_replicas=cfg.max_replicas)
        if verdict.outcome == FAIL:
            self.stats["verify_inconclusive"] += 1
            return self._fail(now, job, sh, f"shard {sh.index}: {len(sh.candidates)} results, no quorum")
        if verdict.outcome == WAIT:
            return self._ask_another(now, job, sh, current)
        out: list[Effect] = []
        for peer in verdict.agreeing:
            self.reputation[peer] = self.reputation.get(peer, 0.0) + 1.0
        for cand in verdict.liars:
            out.extend(self._caught(now, job, sh, cand, verdict.winner))
        first = verdict.winner[0]
        self.stats["results_verified"] += 1
        return out + self._accept(now, job, sh, first.peer, first.msg)

    def _caught(self, now: float, job: _Job, sh: _Shard, liar: Candidate, winner: tuple[Candidate, ...]) -> list[Effect]:
        peer = liar.peer
        witnessed = any(self.is_trusted(c.peer) for c in winner)
        if peer not in self.banned:
            self.stats["liars_caught"] += 1
            self.reputation[peer] = -math.inf
            self.ban(peer)
        elif peer in self._accused or not witnessed:
            return []  # results it returned before we caught it add nothing
        if witnessed:
            self._accused.add(peer)
        evidence = (liar.raw,) + tuple(c.raw for c in winner)
        acc = Accusation(job.spec.job_id, sh.index, peer, evidence)
        self.stats["accusations_published"] += 1
        return [Publish(TOPIC_ACCUSATIONS, self._encode(acc, now), "Accusation")]

    def _fail(self, now: float, job: _Job, sh: _Shard, error: str) -> list[Effect]:
        self._finish(job, now)
        out: list[Effect] = [JobFinished(job.spec.job_id, False, error)]
        out.extend(self._cancel_others(now, job, sh, None))
        return out

    def _accept(self, now: float, job: _Job, sh: _Shard, peer: str, msg: ShardResult) -> list[Effect]:
        """Deliver a shard's result (exactly once) and move the job on."""
        others = {a for a in sh.live if a != msg.attempt}
        if sh.state == ShardState.AWARDED and sh.attempt != msg.attempt:
            others.add(sh.attempt)
        self._move(sh, "result")
        sh.live.clear()
        sh.peer = peer
        self._forget_checkpoint(job, sh)
        job.done += 1
        self.stats["shards_delivered"] += 1
        out: list[Effect] = [
            ShardDelivered(msg.job_id, msg.shard, peer, msg.attempt, msg.result, msg.energy_j, msg.carbon_g, msg.gpu_s)
        ]
        peers = sorted({sh.holders[a] for a in others if a in sh.holders})
        out.extend(self._send(p, Cancel(job.spec.job_id, (sh.index,)), now) for p in peers)
        if job.done == len(job.shards):
            self._finish(job, now)
            self.stats["jobs_finished"] += 1
            out.append(JobFinished(job.spec.job_id, True))
        else:
            job.next_round_at = min(job.next_round_at, now)
            out.extend(self._advance(now, job))
        return out

    def _cancel_others(self, now: float, job: _Job, sh: _Shard, keep_attempt: int | None) -> list[Effect]:
        peers = sorted({p for a, p in sh.holders.items() if a != keep_attempt})
        return [self._send(p, Cancel(job.spec.job_id, (sh.index,)), now) for p in peers]
