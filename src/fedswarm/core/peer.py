"""PeerCore: the sans-IO agent of a peer that offers compute.

Theory of operation
-------------------
A peer does six things, all driven by ``handle(now, input)`` and
``poll(now)``, all returning effects:

1. **Gossip.** Every ``gossip_interval_s`` it sends ``gossip_fanout`` peers
   from its view its own signed ``PeerState`` plus ``gossip_entries`` others
   (``core.view``). It re-signs its state when it changes noticeably or every
   ``state_refresh_s``. On start it sends its state to its bootstrap peers
   and asks each for ``join_pull`` entries of their view (rumour gossip
   spreads the join from there, so a join costs a constant number of
   messages); on leave it publishes its state on ``TOPIC_PEERS`` so a
   leave is known at once.
   *Quiet gossip* (``gossip_quiet_max`` > 1; 8 by default, 1 turns it
   off): from one ``state_ttl_s`` after its start (so a swarm's views
   converge at the base interval), while the peer is idle (no lease, no
   undelivered result, not leaving) and a push round found its state's
   content unchanged, the next round comes twice as late, up to
   ``gossip_quiet_max`` times the interval, and goes to one peer with
   ``2 * gossip_fanout * gossip_entries`` entries instead of
   ``gossip_fanout`` peers with ``gossip_entries``. The state an idle peer
   signs (from its start) advertises ``state_ttl_s * gossip_quiet_max`` and
   is refreshed every ``state_refresh_s * gossip_quiet_max``; one that holds
   work signs the base TTL and refresh, and a change between the two is
   re-signed at once. Work arriving (an award), or a setting that changes
   what the state says (throughput, spans), brings the interval back to
   ``gossip_interval_s`` counted from the last push. Bounds: a crashed peer
   leaves every view within ``state_ttl_s * gossip_quiet_max`` of its crash
   if it was idle, ``state_ttl_s`` if it held work (running shards are
   caught by lease lapses anyway); a quiet peer cannot tell that a split it
   never saw has healed, so its state crosses a healed split with its next
   stretched refresh (``docs/netsim.md``).
2. **Bidding.** On a ``CallForBids`` whose tenant-signed ``JobSpec`` it can
   serve (task kind, devices, memory, tenant policy, not leaving), it answers
   with a ``Bid``: the wait before the shards would start here given its
   fairness-ordered queue, the run time at the frequency level chosen by
   ``core.energy.choose_level``, and the energy and carbon per shard (with
   ``rerun_room``, a level below the top one must leave room, should this
   peer crash at the end of the run, to notice it after the lease the last
   award granted and re-run the shard at the top level by its deadline). A
   second of run time is priced at ``_time_weight``: dearer with a queue
   behind the slot and on a busy swarm, so it slows down only when idle.
3. **Leases.** An ``Award`` signed by the job's tenant and naming this peer
   puts the shard in the local queue (state ``queued``). The queue is ordered
   by ``core.fairness.priority``; when slots are free the head starts
   (``RunShard``, state ``running``). While shards wait, every running
   shard below full clock is raised to it (``SetLevel``). Every
   ``renew_interval_s`` the peer
   sends ``LeaseRenew``; the client answers ``LeaseAck``. With
   ``renew_batch`` the renewals due for one client go in one
   ``LeaseRenewBatch`` (with that client's leases due within half an
   interval, so they stay in step), answered by one ``LeaseAckBatch``. A revoked lease
   (``ok=False``) or a ``Cancel`` from the tenant drops the shard
   (``CancelShard`` if it runs); a lease with no ack for ``lease_grace_s``
   is abandoned (its client is gone), which garbage-collects orphaned work.
4. **Checkpoints.** ``ShardProgress`` from the executor (a running
   shard's task saved its progress) goes to the client as a
   ``ShardCheckpoint``, at most one per ``checkpoint_min_s`` per shard. An
   award with ``resume`` state runs only the work it says is left, from
   that state (``RunShard.resume``).
5. **Results.** ``ShardFinished`` from the executor becomes a
   ``ShardResult`` to the client, resent until a ``ResultAck`` (at most
   ``result_retries`` times): first after the client's retransmission
   timeout (its round trip as timed on renewals and result acks, plus four
   deviations), doubling up to ``result_retry_s``. The GPU-seconds go into
   the tenant ledger, whose own row rides in the next ``PeerState``.
6. **Slot offers** (``offer_interval_s`` > 0; off by default). With a free
   slot and nothing queued, a peer sends ``SlotOffer`` to the view's peer
   with the most queued work per slot: at once when a slot frees, then
   every ``offer_interval_s`` times a factor that doubles per offer (up to
   ``offer_backoff_max``) until an award or a freed slot resets it; no
   peer is offered twice within four intervals, nor (with
   ``offer_max_ratio``) one that many times faster than us, and a view
   with no queue in it sends nothing. On an offer, the peer hands back the queued shards
   that would finish sooner at the offerer than here by more than
   ``move_margin_s`` plus ``move_margin_ratio`` of the run there, up to
   the slots offered (``AwardDecline`` "moved", ``to`` the offerer), and
   the client invites the offerer to their next round.

Lease states per (tenant, job, shard, attempt)::

    (award) -> QUEUED -> RUNNING -> (finished: result outbox) -> gone
               QUEUED/RUNNING --(revoked | cancel | abandoned | leave)--> gone
               QUEUED --(its start slipped far past the promise: handed back)--> gone
               QUEUED --(an idle peer's slot offer would finish it sooner: handed back)--> gone

``_TRANSITIONS`` below is the table; ``_move`` is the only place a lease
changes state, and an illegal move is a ``LocalProtocolError`` (a bug).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import LocalProtocolError, RemoteProtocolError
from .config import PeerConfig
from .energy import choose_level, meets_deadline
from .events import (
    TOPIC_ACCUSATIONS,
    TOPIC_PEERS,
    CancelShard,
    Effect,
    HandBackRunning,
    Input,
    Leave,
    MessageReceived,
    Publish,
    RunShard,
    Send,
    SetLevel,
    SetPower,
    SetSpans,
    SetThroughput,
    ShardFinished,
    ShardProgress,
)
from .fairness import alone_time, deadline_left, estimate_rho, priority, run_time
from .identity import Identity
from .membership import check_membership
from .node import Node, forget_oldest, smooth_rtt
from .slots import queue_starts, starts_after
from .wire import (
    MAX_BID_NEXT,
    MAX_CHECKPOINT_BYTES,
    Accusation,
    Award,
    AwardDecline,
    Bid,
    CallForBids,
    Cancel,
    Gossip,
    JobSpec,
    MAX_BATCH,
    LeaseAck,
    LeaseAckBatch,
    LeaseRenew,
    LeaseRenewBatch,
    PeerState,
    PowerInfo,
    ResultAck,
    ShardCheckpoint,
    SlotOffer,
    ShardResult,
    Signed,
    VerifyCache,
    decode,
)

__all__ = ["PeerCore", "LeaseState"]


class LeaseState:
    QUEUED: Final = "queued"
    RUNNING: Final = "running"
    DONE: Final = "done"
    DROPPED: Final = "dropped"


_TRANSITIONS: dict[tuple[str, str], str] = {
    (LeaseState.QUEUED, "start"): LeaseState.RUNNING,
    (LeaseState.QUEUED, "drop"): LeaseState.DROPPED,
    (LeaseState.RUNNING, "finish"): LeaseState.DONE,
    (LeaseState.RUNNING, "drop"): LeaseState.DROPPED,
}

LeaseKey = tuple[str, str, int, int]  # tenant, job_id, shard, attempt


@dataclass(slots=True, init=False)
class _Lease:
    key: LeaseKey
    job: JobSpec
    job_raw: bytes
    level: float
    run_s: float
    energy_j: float  # estimate, reported when the executor measures none
    accepted_at: float
    last_ack_at: float
    next_renew_at: float
    state: str
    started_at: float
    granted_s: float  # lease length the client last granted
    start_by: float  # when it was expected to start on acceptance
    renew_sent_at: float  # when the renewal its next ack answers went out (0: none out)
    left: float  # the share of the shard's work this run does (below 1: it resumes)
    resume: bytes  # the checkpoint it resumes from (b"": a fresh run)
    checkpoint_at: float  # when its last checkpoint went to the client
    checkpoint_done: float  # the share of the shard's work behind that checkpoint

    # (a written ``__init__``, not the dataclass's: compiled by mypyc, the
    # generated one runs as Python, about 5x slower, on a hot path)
    def __init__(self, key: LeaseKey, job: JobSpec, job_raw: bytes, level: float, run_s: float, energy_j: float,
                 accepted_at: float, last_ack_at: float, next_renew_at: float, state: str = LeaseState.QUEUED,
                 started_at: float = 0.0, granted_s: float = 0.0, start_by: float = math.inf,
                 renew_sent_at: float = 0.0, left: float = 1.0, resume: bytes = b"") -> None:
        self.key = key
        self.job = job
        self.job_raw = job_raw
        self.level = level
        self.run_s = run_s
        self.energy_j = energy_j
        self.accepted_at = accepted_at
        self.last_ack_at = last_ack_at
        self.next_renew_at = next_renew_at
        self.state = state
        self.started_at = started_at
        self.granted_s = granted_s
        self.start_by = start_by
        self.renew_sent_at = renew_sent_at
        self.left = left
        self.resume = resume
        self.checkpoint_at = -math.inf
        self.checkpoint_done = 1.0 - left

    @property
    def tenant(self) -> str:
        return self.key[0]


@dataclass(slots=True, init=False)
class _Outbox:
    client: str
    msg: ShardResult
    next_at: float
    left: int
    sent_at: float  # the first send (an ack of a resent result times nothing)
    wait_s: float  # until the next resend (doubles up to result_retry_s)

    # (a written ``__init__``, not the dataclass's: compiled by mypyc, the
    # generated one runs as Python, about 5x slower, on a hot path)
    def __init__(self, client: str, msg: ShardResult, next_at: float, left: int, sent_at: float,
                 wait_s: float) -> None:
        self.client = client
        self.msg = msg
        self.next_at = next_at
        self.left = left
        self.sent_at = sent_at
        self.wait_s = wait_s


@dataclass(slots=True, init=False)
class _PrioContext:
    """Not frozen: a frozen dataclass cannot have a written ``__init__``.
    Nothing assigns to it after that."""

    now: float
    shares: dict[str, float]
    swarm_slots: float
    tenants: int
    util: float  # busy share of the swarm's slots, as the view reports them
    #: priorities computed at ``now``, by (tenant, job id, shard, seconds ahead),
    #: with the job they are for: a queue replayed for each of its leases asks
    #: for each of theirs again
    prio: dict[tuple[str, str, int, float], tuple[JobSpec, tuple[float, float, float]]] = field(init=False)

    # (a written ``__init__``, not the dataclass's: compiled by mypyc, the
    # generated one runs as Python, about 5x slower, on a hot path)
    def __init__(self, now: float, shares: dict[str, float], swarm_slots: float, tenants: int,
                 util: float = 0.0) -> None:
        self.now = now
        self.shares = shares
        self.swarm_slots = swarm_slots
        self.tenants = tenants
        self.util = util
        self.prio = {}


@dataclass(slots=True)
class _JobCache:
    spec: JobSpec
    raw: bytes
    seen_at: float
    extras: dict[str, Any] = field(default_factory=dict)


class PeerCore(Node):
    """The peer agent's decision logic. See the module docstring."""

    def __init__(
        self,
        identity: Identity,
        config: PeerConfig,
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
            ledger_tau_s=config.ledger_tau_s,
            verify_cache=verify_cache,
            rate_per_s=config.rate_per_s,
            rate_burst=config.rate_burst,
            federations=config.federations,
            # a full view's newcomer issued more than 10 push rounds ago is
            # churn, not news (core.view)
            rumour_age_s=10 * config.gossip_interval_s,
        )
        self.config = config
        self.leases: dict[LeaseKey, _Lease] = {}
        self.outbox: dict[LeaseKey, _Outbox] = {}
        #: (due time, key) of leases, lazily: entries whose lease is gone or moved are skipped (``_touch``)
        self._lease_times: list[tuple[float, LeaseKey]] = []
        self.leaving = False
        self.started = False
        self._seq = 0
        self._own_raw: bytes | None = None
        self._own_signed_at = -math.inf
        self._own_fingerprint: tuple[Any, ...] = ()
        self._next_gossip = 0.0
        self._last_gossip_at = -math.inf
        #: quiet gossip: the factor (1, 2, 4, ... gossip_quiet_max) by which
        #: the push interval, the state refresh and the advertised TTL are
        #: stretched while the peer is idle and its state unchanged
        self._quiet = 1
        self._own_quiet = 1  # the factor our signed state was issued with
        self._changed = False  # our state's content changed since the last round
        #: no quiet rounds before this (one TTL after the start): the views
        #: of a swarm that starts converge at the base interval
        self._loud_until = math.inf
        self._busy_slots = 0
        self._tenant_load: dict[str, float] = {}
        #: (tenant, job_id) -> when our last bid said its shard would start
        self._promised: dict[tuple[str, str], float] = {}
        # slot offers: when the next may go, the factor its interval grows
        # by while offers bring no award, and when each peer was last offered
        self._next_offer = 0.0
        self._offer_backoff = 1
        self._offered: dict[str, float] = {}
        #: the lease the last award granted (``Award.lease_s``): how long a
        #: crash of ours would go unnoticed near the end of a run, reserved
        #: by the level rule (``rerun_room``); 0 until the first award
        self._award_lease_s = 0.0
        #: client -> (smoothed round trip, mean deviation), from renewals
        #: and results and their acks; it times the resend of a result
        self._client_rtt: dict[str, tuple[float, float]] = {}
        self.throughput = dict(config.throughput)
        self.spans: tuple[Any, ...] = ()
        self.now_w = config.power.idle_w

    # ------------------------------------------------------------------
    # public driving API

    def start(self, now: float) -> list[Effect]:
        self.started = True
        self._loud_until = now + self.config.state_ttl_s
        self._next_gossip = now + self.rng.uniform(0, self.config.gossip_interval_s)
        # a new peer's view holds only itself: its first offer is due one
        # interval on, the next two later (as after an offer that found no
        # taker)
        self._next_offer = now + self.config.offer_interval_s
        self._offer_backoff = 2
        self._refresh_state(now, force=True)
        # A join is told to the bootstrap peers only, who answer with up to
        # ``join_pull`` entries of their view; rumour gossip carries it on
        # from there. Publishing it on TOPIC_PEERS would cost every peer up
        # a message per join: O(N^2) when a whole swarm starts at once.
        want = self.config.join_pull
        return [
            self._gossip_to(now, b, reply=True, entries=self.config.gossip_entries, want=want)
            for b in self.config.bootstrap
            if b != self.id
        ]

    @property
    def topics(self) -> tuple[str, ...]:
        return (TOPIC_PEERS, TOPIC_ACCUSATIONS)

    def handle(self, now: float, inp: Input) -> list[Effect]:
        if isinstance(inp, MessageReceived):
            return self._on_message(now, inp)
        if isinstance(inp, ShardFinished):
            return self._on_finished(now, inp)
        if isinstance(inp, ShardProgress):
            return self._on_progress(now, inp)
        if isinstance(inp, (SetThroughput, SetPower, SetSpans)):
            self._on_setting(inp)
            return []
        if isinstance(inp, Leave):
            return self._on_leave(now)
        if isinstance(inp, HandBackRunning):
            return self._hand_back_running(now)
        raise LocalProtocolError("bad-input", type(inp).__name__)

    def poll(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        cfg = self.config
        if self._quiet > 1 and not self._idle_now():
            # work arrived: back to the base interval (counted from the last push)
            self._quiet = 1
            self._next_gossip = min(self._next_gossip, self._last_gossip_at + cfg.gossip_interval_s)
        if now >= self._next_gossip:
            self._last_gossip_at = now
            self.view.expire(now)
            self._changed = False
            out.extend(self._gossip_round(now))
            if self._changed or not self._idle_now() or now < self._loud_until:
                self._quiet = 1
            else:
                self._quiet = min(2 * self._quiet, cfg.gossip_quiet_max)
            self._next_gossip = now + cfg.gossip_interval_s * self._quiet
        etas: dict[LeaseKey, float] | None = None
        ctx: _PrioContext | None = None
        waits: dict[LeaseKey, float] | None = None  # _wait_estimate of each queued lease (None after a drop)
        batch: dict[str, list[LeaseRenew]] | None = None
        early, due = -math.inf, set()  # batching: a client's leases due by this go with one due now
        if cfg.renew_batch:
            batch = {}
            due = {lease.tenant for lease in self.leases.values() if now >= lease.next_renew_at}
            early = now + cfg.renew_interval_s / 2.0
        for lease in list(self.leases.values()):
            if now - lease.last_ack_at > self._grace(lease):
                self.stats["leases_abandoned"] += 1
                out.extend(self._drop(lease))
                etas = waits = None
            elif now >= lease.next_renew_at or (batch is not None and lease.next_renew_at <= early
                                                 and lease.tenant in due):
                if lease.state == LeaseState.QUEUED:
                    ctx = ctx or self._context(now)
                    if waits is None:
                        waits = self._queued_waits(ctx)
                    start = now + waits[lease.key]
                    if self._late(lease.job, lease.tenant, lease.key[2], now, start, lease.start_by, lease.key):
                        # later work kept outranking it here: another peer may start it sooner
                        self.stats["shards_handed_back_late"] += 1
                        out.extend(self._hand_back(lease, "late", now))
                        etas = waits = None
                        continue
                if etas is None:
                    etas = self._etas(now)
                lease.next_renew_at = now + self.config.renew_interval_s
                self._touch(lease)
                msg = self._renew_msg(lease, now, etas.get(lease.key))
                if batch is None:
                    out.append(self._send(lease.tenant, msg, now))
                else:
                    batch.setdefault(lease.tenant, []).append(msg)
        for tenant, msgs in (batch or {}).items():
            # one message per client for all of its shards renewed this round
            for i in range(0, len(msgs), MAX_BATCH):
                part = msgs[i : i + MAX_BATCH]
                out.append(self._send(tenant, part[0] if len(part) == 1 else LeaseRenewBatch(tuple(part)), now))
                self.stats["renew_batches"] += len(part) > 1
        for key, ob in list(self.outbox.items()):
            if now >= ob.next_at:
                if ob.left <= 0:
                    self.stats["results_undelivered"] += 1
                    del self.outbox[key]
                    continue
                ob.left -= 1
                ob.wait_s = min(2.0 * ob.wait_s, self.config.result_retry_s)
                ob.next_at = now + ob.wait_s
                out.append(self._send(ob.client, ob.msg, now))
                self.stats["results_resent"] += 1
        out.extend(self._schedule(now))
        if cfg.offer_interval_s > 0 and now >= self._next_offer:
            out.extend(self._offer_slots(now))
        return out

    # ------------------------------------------------------------------
    # slot offers

    def _may_offer(self) -> bool:
        """A free slot, nothing queued, offers on, not leaving."""
        return (self._busy_slots < self.config.slots and self.config.offer_interval_s > 0 and not self.leaving
                and self._queued == 0)

    def _offer_slots(self, now: float) -> list[Effect]:
        """Offer our free slots to the peer whose state shows the most queued
        work per slot (its backlog less what runs), skipping peers offered
        within the last four intervals. The next offer comes one interval
        later, times a factor that doubles with each offer (up to
        ``offer_backoff_max``) until an award or a freed slot resets it."""
        cfg = self.config
        self._next_offer = now + cfg.offer_interval_s * self._offer_backoff
        if not self._may_offer():
            return []
        self._offer_backoff = min(2 * self._offer_backoff, cfg.offer_backoff_max)
        best, score = "", 0.0
        cool = 4 * cfg.offer_interval_s
        # with offer_max_ratio: none to a peer so much faster than us that
        # its queue would rarely finish sooner here
        faster = cfg.offer_max_ratio * max(self.throughput.values(), default=0.0) if cfg.offer_max_ratio > 0 else 0.0
        for e in self.view.live(now):
            if e.peer == self.id:
                continue
            st = e.state
            queued_s = st.backlog_s * st.slots - sum(st.free_s)  # free_s: what runs, per slot
            if queued_s <= cfg.move_margin_s:
                continue
            if faster and max(st.throughput.values(), default=0.0) > faster:
                continue
            last = self._offered.get(e.peer)
            if last is not None and now - last < cool:
                continue
            per_slot = queued_s / st.slots
            if per_slot > score:
                best, score = e.peer, per_slot
        if not best:
            return []
        self._offered[best] = now
        if len(self._offered) > 4096:
            self._offered = forget_oldest(self._offered, 2048)
        self.stats["slot_offers_sent"] += 1
        return [self._send(best, SlotOffer(cfg.slots - self._busy_slots), now)]

    def _on_offer(self, now: float, author: str, msg: SlotOffer) -> list[Effect]:
        """``author`` has ``msg.free`` idle slots: hand back to their clients,
        in queue order, the queued shards that would finish sooner there
        (its run at its stated throughput, from now) than here (their wait
        in our queue, then their run) by more than the margin, naming
        ``author``. The client's next round invites it beside its usual
        picks, and the bids decide. Nothing is sent back to ``author``."""
        self.stats["slot_offers_received"] += 1
        e = self.view.get(author)
        if e is None or e.state.leaving or self.leaving:
            return []
        queued = [x for x in self.leases.values() if x.state == LeaseState.QUEUED]
        if not queued:
            return []
        cfg = self.config
        ctx = self._context(now)
        waits = self._queued_waits(ctx)
        thr = e.state.throughput
        n = msg.free
        out: list[Effect] = []
        for lease in self._queue_order(queued, ctx):
            if n <= 0:
                break
            job = lease.job
            g = max(job.gpus, 1)
            if g > n or g > e.state.slots or (job.task not in thr and "*" not in thr):
                continue
            there = run_time(job, thr) * lease.left
            here = waits[lease.key] + lease.run_s
            if there + cfg.move_margin_s + cfg.move_margin_ratio * there >= here:
                continue
            out.extend(self._hand_back(lease, "moved", now, author))
            self.stats["shards_moved"] += 1
            n -= g
            waits = self._queued_waits(ctx)
        return out

    def next_deadline(self) -> float:
        t = self._next_gossip
        cfg = self.config
        if self._quiet > 1 and not self._idle_now():
            t = min(t, self._last_gossip_at + cfg.gossip_interval_s)
        # the leases' earliest renewal or abandonment (see _touch)
        heap, leases = self._lease_times, self.leases
        while heap:
            when, key = heap[0]
            lease = leases.get(key)
            if lease is not None and self._lease_due(lease) == when:
                t = min(t, when)
                break
            heapq.heappop(heap)  # a lease gone, or a time since moved
        for ob in self.outbox.values():
            t = min(t, ob.next_at)
        if self._may_offer():
            t = min(t, self._next_offer)
        return t

    def _lease_due(self, lease: _Lease) -> float:
        """When ``lease`` next needs the core: its renewal, or its abandonment
        after ``_grace`` of silence from the client (what ``poll`` checks)."""
        return min(lease.next_renew_at, lease.last_ack_at + self._grace(lease) + 1e-6)

    def _touch(self, lease: _Lease) -> None:
        """Record ``lease``'s due time in the lazy heap ``next_deadline``
        reads, after anything that moved it (a scan of every lease after
        every input was a third of a 2-peer, 4,000-shard netsim run)."""
        heap = self._lease_times
        if len(heap) > 4 * len(self.leases) + 64:  # stale entries: start afresh (``lease`` among them)
            heap[:] = [(self._lease_due(x), k) for k, x in self.leases.items()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (self._lease_due(lease), lease.key))

    def _idle_now(self) -> bool:
        """No lease, no undelivered result, not leaving: gossip may go quiet."""
        return not self.leases and not self.outbox and not self.leaving

    def _on_setting(self, inp: SetThroughput | SetPower | SetSpans) -> None:
        """A measurement or setting from the executor or the LLM server (it
        enters the next signed state; no effects). One that changes what the
        state says (``_fingerprint``: not the power draw alone) ends quiet
        gossip: the next push comes at the base interval after the last."""
        before = self._fingerprint() if self._quiet > 1 else None
        if isinstance(inp, SetThroughput):
            self.throughput[inp.kind] = inp.value
        elif isinstance(inp, SetPower):
            self.now_w = inp.now_w
        else:
            self.spans = inp.spans
        if before is not None and self._fingerprint() != before:
            self._quiet = 1
            self._next_gossip = min(self._next_gossip, self._last_gossip_at + self.config.gossip_interval_s)

    def rho_by_tenant(self, now: float) -> dict[str, float]:
        """Each tenant's worst estimated finish-time fairness among the
        shards it has here: time so far plus the work left, over its time
        alone on a fair share of the swarm (rounded to 3 places)."""
        ctx = self._context(now)
        out: dict[str, float] = {}
        for (tenant, _job, _shard, _att), lease in self.leases.items():
            job = lease.job
            t_alone = alone_time(job.work_s, job.shards, job.gpus, job.chain, ctx.swarm_slots, ctx.tenants)
            left = self._remaining(lease, now)
            r = estimate_rho(now - job.submitted_at, left, t_alone)
            out[tenant] = round(max(out.get(tenant, 0.0), r), 3)
        return out

    @property
    def busy_slots(self) -> int:
        """Slots the running shards occupy here."""
        return self._busy_slots

    @property
    def seq(self) -> int:
        """The sequence number of this peer's latest signed state."""
        return self._seq

    @property
    def backlog_s(self) -> float:
        total = sum(self._remaining(lease, None) for lease in self.leases.values())
        return total / self.config.slots

    def __repr__(self) -> str:
        q = sum(1 for lease in self.leases.values() if lease.state == LeaseState.QUEUED)
        r = sum(1 for lease in self.leases.values() if lease.state == LeaseState.RUNNING)
        return (
            f"<PeerCore {self.id[:16]}… view={len(self.view)} queued={q} running={r} "
            f"outbox={len(self.outbox)} leaving={self.leaving}>"
        )

    # ------------------------------------------------------------------
    # own state and gossip

    def _fingerprint(self) -> tuple[Any, ...]:
        backlog = self.backlog_s
        return (
            round(math.log1p(backlog) * 4),
            self.config.slots - self._busy_slots,
            self.leaving,
            tuple(sorted((k, round(v, 2)) for k, v in self.throughput.items())),
            self.spans,
        )

    def _ttl_factor(self) -> int:
        """By how much our state's TTL and refresh are stretched: the whole
        ``gossip_quiet_max`` while we are idle (the bound on noticing an idle
        peer's crash is that anyway), 1 while we hold work. It follows
        idleness, not the gossip rate: a peer that goes loud for a round
        because its state changed keeps its long TTL, so that its loud spell
        does not leave short-lived states in views that expire before the
        next quiet refresh reaches them. An idle peer signs the long TTL from
        its start, so a short split loses it from no view."""
        if self.config.gossip_quiet_max <= 1 or not self._idle_now():
            return 1
        return self.config.gossip_quiet_max

    def _state(self, now: float) -> PeerState:
        c = self.config
        pm = c.power
        return PeerState(
            seq=self._seq,
            ttl_s=c.state_ttl_s * self._ttl_factor(),
            devices=c.devices,
            slots=c.slots,
            throughput=dict(self.throughput),
            backlog_s=self.backlog_s,
            power=PowerInfo(self.now_w, pm.idle_w, pm.max_w, pm.cap_w, pm.alpha, pm.levels),
            energy_price=c.energy_price,
            carbon_g_kwh=c.carbon_g_kwh,
            spans=self.spans,
            trust=c.trust,
            membership=c.membership,
            addrs=c.addrs,
            region=c.region,
            leaving=self.leaving,
            ledger=self.ledger.row(self.id),
            free_s=self._free_times(now),
        )

    @property
    def _queued(self) -> int:
        return sum(1 for lease in self.leases.values() if lease.state == LeaseState.QUEUED)

    def _free_times(self, now: float) -> tuple[float, ...]:
        """Seconds until 1, 2, ... slots are free together (running shards only)."""
        n = min(self.config.slots, 64)
        out = [0.0] * min(self.config.slots - self._busy_slots, n)
        for left, held in sorted(
            (max(lease.run_s - (now - lease.started_at), 0.0), max(lease.job.gpus, 1))
            for lease in self.leases.values()
            if lease.state == LeaseState.RUNNING
        ):
            out.extend([round(left, 3)] * held)
            if len(out) >= n:
                break
        return tuple(out[:n])

    def _refresh_state(self, now: float, *, force: bool = False) -> bytes:
        fp = self._fingerprint()
        ledger_changed = self._own_raw is not None and self._ledger_dirty
        if (
            force
            or self._own_raw is None
            or fp != self._own_fingerprint
            or ledger_changed
            or now - self._own_signed_at >= self.config.state_refresh_s * self._own_quiet
            # idle to busy or back: re-sign with the TTL that advertises
            # (a busy peer's crash is noticed within the base TTL)
            or self._ttl_factor() != self._own_quiet
        ):
            if fp != self._own_fingerprint or ledger_changed:
                self._changed = True
            self._seq += 1
            st = self._state(now)
            self._own_raw = self._encode(st, now)
            self._own_signed_at = now
            self._own_quiet = self._ttl_factor()
            self._own_fingerprint = fp
            self._ledger_dirty = False
            # keep ourselves in our own view, so a client asking us sees us
            own_trust = check_membership(self.config.membership, self.id, now, self.federations)
            self.view.merge(self.id, st, now, self._own_raw, now, trusted=own_trust)
            self.stats["states_signed"] += 1
        return self._own_raw

    _ledger_dirty = False

    def _own_entry(self, now: float) -> bytes | None:
        return self._refresh_state(now)

    def _gossip_round(self, now: float) -> list[Effect]:
        peers = self.view.peers_but(self.id)
        if not peers:
            return [
                self._gossip_to(now, b, reply=True, entries=self.config.gossip_entries)
                for b in self.config.bootstrap
                if b != self.id
            ]
        fanout, entries = self.config.gossip_fanout, self.config.gossip_entries
        if self._quiet > 1:
            # a quiet round (it came late: we are idle and unchanged) pushes
            # to one peer, a ``gossip_fanout``-th of the messages, with twice
            # the entries that a loud round's messages carry together: its
            # rumours go to one peer, not ``gossip_fanout``, and anti-entropy
            # makes up for it (with only as many entries, churn-200's idle
            # views missed 15% more pairs of live peers than the loud
            # protocol's; with twice, 12% fewer; docs/netsim.md)
            entries, fanout = 2 * entries * max(fanout, 1), min(fanout, 1)
        k = min(fanout, len(peers))
        targets = self.rng.sample(peers, k)
        want_reply = len(peers) < 2 * self.config.gossip_entries
        out: list[Effect] = [self._gossip_to(now, t, reply=want_reply, entries=entries) for t in targets]
        # now and then, probe a peer we lost (or a bootstrap peer) and ask for
        # its view: after a partition longer than the TTL both sides have
        # forgotten each other, and this is how they meet again
        if self.rng.random() < self.config.gossip_probe_rate:
            lost = sorted(self.view.graveyard) or [b for b in self.config.bootstrap if b != self.id and b not in self.view]
            if lost:
                out.append(self._gossip_to(now, self.rng.choice(lost), reply=True, entries=self.config.gossip_entries))
                self.stats["gossip_probes"] += 1
        return out

    # ------------------------------------------------------------------
    # messages

    def _on_message(self, now: float, inp: MessageReceived) -> list[Effect]:
        signed = self._receive(now, inp.sender, inp.data)
        if signed is None:
            return []
        msg = signed.msg
        try:
            if isinstance(msg, Gossip):
                return self._handle_gossip(now, inp.sender, msg)
            if isinstance(msg, PeerState):
                self._merge_state(now, inp.data, signed)
                return []
            if isinstance(msg, CallForBids):
                return self._on_cfb(now, signed, msg)
            if isinstance(msg, Award):
                return self._on_award(now, signed, msg)
            if isinstance(msg, LeaseAck):
                return self._on_lease_ack(now, signed, msg)
            if isinstance(msg, LeaseAckBatch):
                out: list[Effect] = []
                for ack in msg.acks:
                    out.extend(self._on_lease_ack(now, signed, ack))
                return out
            if isinstance(msg, ResultAck):
                key = (signed.author, msg.job_id, msg.shard, msg.attempt)
                ob = self.outbox.pop(key, None)
                if ob is not None:
                    self.stats["results_acked"] += 1
                    if ob.left == self.config.result_retries:  # sent once: the ack times it
                        self._sample_rtt(signed.author, now - ob.sent_at)
                else:
                    self.stats["result_acks_unmatched"] += 1
                return []
            if isinstance(msg, Cancel):
                return self._on_cancel(now, signed, msg)
            if isinstance(msg, Accusation):
                self._handle_accusation(now, signed, msg)
                return []
            if isinstance(msg, SlotOffer):
                return self._on_offer(now, signed.author, msg)
            raise RemoteProtocolError("unexpected-kind", type(msg).__name__)
        except RemoteProtocolError as exc:
            self.rejected[exc.reason] += 1
            return []

    def _job_from(self, raw: bytes, now: float) -> tuple[JobSpec, str]:
        signed = decode(raw, max_bytes=self.max_message_bytes, cache=self.verify_cache)
        if not isinstance(signed.msg, JobSpec):
            raise RemoteProtocolError("bad-field", "job is not a JobSpec")
        return signed.msg, signed.author

    def _can_serve(self, job: JobSpec, tenant: str) -> str:
        c = self.config
        if self.leaving:
            return "leaving"
        if c.allowed_tenants is not None and tenant not in c.allowed_tenants:
            return "tenant-not-allowed"
        if c.tasks is not None and job.task not in c.tasks:
            return "task-not-served"
        if job.gpus > c.slots:
            return "too-many-gpus"
        if job.mem_bytes > max((d.mem_total for d in c.devices), default=0):
            return "not-enough-memory"
        if self._tenant_load.get(tenant, 0.0) >= c.tenant_cap_s:
            return "tenant-cap"
        if self.backlog_s > c.max_backlog_s:
            return "backlog"
        return ""

    def _context(self, now: float) -> "_PrioContext":
        """What every priority computed at ``now`` shares (computed once)."""
        # slots, slots whose occupancy the view reports, and how many of them are busy
        slots, known, busy = self.view.capacity(now)
        shares = self.ledger.shares(now)
        tenants = {k[0] for k in self.leases}
        tenants.update(t for t, v in shares.items() if v > 0.01)
        util = busy / known if known else 0.0
        return _PrioContext(now, shares, float(slots) or float(self.config.slots), max(len(tenants), 1), util)

    def _time_weight(self, job: JobSpec, ctx: "_PrioContext") -> float:
        """Price of a second of this shard's run time against ``lam`` joules.

        Running slower delays the shards queued behind it on its slot (one
        per ``slots`` queued), and on a busy swarm it holds a slot that the
        next arrival may need: the delay cost of extra service time grows
        like ``1 / (1 - utilisation)``. So a peer slows down on an idle swarm
        and races when there is a queue or the swarm is busy.
        """
        util = min(ctx.util, 0.95)
        return job.weight * (1.0 + self._queued / self.config.slots) / (1.0 - util)

    def _prio(
        self, job: JobSpec, tenant: str, ctx: "_PrioContext", ahead_s: float, shard: int = 0
    ) -> tuple[float, float, float]:
        memo = ctx.prio
        # the shard matters only to a chain's deadline (deadline_left): the
        # 2,000 queued shards of one job share one priority
        k = (tenant, job.job_id, shard if job.chain and job.deadline_s is not None else -1, ahead_s)
        hit = memo.get(k)
        if hit is not None and hit[0] is job:
            return hit[1]
        c = self.config
        t_alone = alone_time(job.work_s, job.shards, job.gpus, job.chain, ctx.swarm_slots, ctx.tenants)
        rho = estimate_rho(ctx.now - job.submitted_at, ahead_s, t_alone)
        p = priority(
            c.queue_policy,
            rho=rho,
            weight=job.weight,
            share=ctx.shares.get(tenant, 0.0),
            remaining_s=job.work_s,
            arrival=job.submitted_at,
            knob=c.fairness_knob,
            deadline_left_s=deadline_left(job, shard, ctx.now),
            run_s=run_time(job, self.throughput),
        )
        memo[k] = (job, p)
        return p

    def _remaining(self, lease: _Lease, now: float | None) -> float:
        if lease.state == LeaseState.RUNNING and now is not None:
            return max(lease.run_s - (now - lease.started_at), 0.0) * lease.job.gpus
        return lease.run_s * lease.job.gpus

    def _wait_estimate(
        self, job: JobSpec, tenant: str, ctx: "_PrioContext", shard: int = 0, lease: _Lease | None = None
    ) -> float:
        """Seconds before a shard of ``job`` would start here: the queue
        replayed on the slots (``core.slots``), the shards that come before
        it first. A new shard comes after every queued one that outranks it
        or ranks equal; a queued ``lease`` after those before it in
        ``_schedule``'s order (where each shard's rho counts its own run as
        ahead of it)."""
        return self._wait_estimates(job, tenant, ctx, shard, lease=lease)[0]

    def _wait_estimates(self, job: JobSpec, tenant: str, ctx: "_PrioContext", shard: int, run_s: float = 0.0,
                        count: int = 1, lease: _Lease | None = None) -> list[float]:
        """``_wait_estimate`` for ``count`` new shards of ``job`` (``run_s``
        each) placed one after another: the waits a bid lists."""
        now = ctx.now
        mine = self._prio(job, tenant, ctx, lease.run_s if lease is not None else 0.0, shard)
        ahead: list[tuple[tuple[float, float, float], LeaseKey, float, int]] = []
        for other in self.leases.values():
            if other.state != LeaseState.RUNNING and other is not lease:
                p = self._prio(other.job, other.tenant, ctx, other.run_s if lease is not None else 0.0, other.key[2])
                if (p, other.key) < (mine, lease.key) if lease is not None else p <= mine:
                    ahead.append((p, other.key, other.run_s, max(other.job.gpus, 1)))
        ahead.sort(key=lambda a: (a[0], a[1]))
        return starts_after(self._slot_free_times(now), ((a[2], a[3]) for a in ahead), max(job.gpus, 1), run_s, count)

    def _queued_waits(self, ctx: "_PrioContext") -> dict[LeaseKey, float]:
        """``_wait_estimate(lease.job, lease.tenant, ctx, lease.key[2],
        lease)`` of every queued lease, in one replay of the queue in
        ``_schedule``'s order (``slots.queue_starts``)."""
        queued = self._queue_order([x for x in self.leases.values() if x.state != LeaseState.RUNNING], ctx)
        starts = queue_starts(self._slot_free_times(ctx.now), [(q.run_s, max(q.job.gpus, 1)) for q in queued])
        return {q.key: w for q, w in zip(queued, starts)}

    def _slot_free_times(self, now: float) -> list[float]:
        """Seconds until each slot frees: the idle ones, then each running
        lease's (as many as its job holds)."""
        free: list[float] = [0.0] * max(self.config.slots - self._busy_slots, 0)
        for other in self.leases.values():
            if other.state == LeaseState.RUNNING:
                free.extend([max(other.run_s - (now - other.started_at), 0.0)] * max(other.job.gpus, 1))
        return free[: self.config.slots]

    def _queue_order(self, leases: list[_Lease], ctx: "_PrioContext") -> list[_Lease]:
        """``leases`` in the order ``_schedule`` starts them: by priority
        (each counting its own run as ahead of it), then by key."""
        return sorted(leases, key=lambda lease: (self._prio(lease.job, lease.tenant, ctx, lease.run_s, lease.key[2]),
                                                 lease.key))

    def _on_cfb(self, now: float, signed: Signed, cfb: CallForBids) -> list[Effect]:
        job, tenant = self._job_from(cfb.job, now)
        if tenant != signed.author:
            raise RemoteProtocolError("not-tenant", "call for bids not from the job's tenant")
        if any(s >= job.shards for s in cfb.shards) or not cfb.shards:
            raise RemoteProtocolError("no-such-shard", job.job_id)
        why = self._can_serve(job, tenant)
        if why:
            self.stats[f"no_bid_{why}"] += 1
            return []
        ctx = self._context(now)  # one scan of the view serves the wait and the price of time
        gpus = max(job.gpus, 1)
        work = run_time(job, self.throughput) * cfb.left
        # the waits of this shard and of further ones given here (this
        # round's others, or the client's other jobs' that our bid cannot
        # count): enough to cover the free slots and the round
        count = min(max(self.config.slots // gpus, 1) + len(cfb.shards), MAX_BID_NEXT + 1)
        waits = self._wait_estimates(job, tenant, ctx, min(cfb.shards), work, count)
        wait = waits[0]
        deadline = deadline_left(job, min(cfb.shards), now)
        choice = choose_level(
            self.config.power,
            work,
            start_s=wait,
            deadline_s=deadline,
            lam=job.lam,
            carbon_g_kwh=self.config.carbon_g_kwh,
            time_weight=self._time_weight(job, ctx),
            race_to_idle=self.config.race_to_idle,
            rerun_reserve_s=self._rerun_reserve(),
        )
        if choice.run_s != work and count > 1:  # slowed down: the later shards wait for slower ones
            waits = self._wait_estimates(job, tenant, ctx, min(cfb.shards), choice.run_s, count)
        bid = Bid(
            job_id=job.job_id,
            round=cfb.round,
            shards=cfb.shards,
            start_s=wait,
            run_s=choice.run_s,
            slots=max(self.config.slots // gpus, 1),
            level=choice.level,
            energy_j=choice.energy_j * gpus,
            carbon_g=choice.carbon_g * gpus,
            trust=self.config.trust,
            next_s=tuple(waits[1:]),
        )
        self.stats["bids_sent"] += 1
        self._promised[(tenant, job.job_id)] = now + wait
        if len(self._promised) > 4096:
            self._promised = forget_oldest(self._promised, 2048)
        return [self._send(tenant, bid, now)]

    def _on_award(self, now: float, signed: Signed, award: Award) -> list[Effect]:
        job, tenant = self._job_from(award.job, now)
        if tenant != signed.author:
            raise RemoteProtocolError("not-tenant", "award not from the job's tenant")
        if award.peer != self.id:
            raise RemoteProtocolError("not-for-us", "award names another peer")
        if award.shard >= job.shards:
            raise RemoteProtocolError("no-such-shard", job.job_id)
        key: LeaseKey = (tenant, job.job_id, award.shard, award.attempt)
        if key in self.leases or key in self.outbox:
            self.stats["awards_duplicate"] += 1
            lease = self.leases.get(key)
            if lease is not None:
                # the client sends an award again when it heard no renewal:
                # ours may have been lost, so renew now
                return [self._send(tenant, self._renew_msg(lease, now), now)]
            return []
        why = self._can_serve(job, tenant)
        wait = 0.0
        if not why and self.config.decline_late_s > 0:  # else neither the decline nor the hand-back uses it
            wait = self._wait_estimate(job, tenant, self._context(now), award.shard)
            if self._late(job, tenant, award.shard, now, now + wait):
                why = "late"
        if why:
            self.stats["awards_declined"] += 1
            if why == "late":
                self.stats["awards_declined_late"] += 1
            return [self._send(tenant, AwardDecline(job.job_id, award.shard, award.attempt, why), now)]
        work = run_time(job, self.throughput) * award.left
        self._award_lease_s = award.lease_s
        level = award.level
        if award.attempt > 0:
            # a later attempt: the shard has lost time already (its holder
            # was lost, handed it back or straggled, or its result awaits a
            # second opinion); running it slower to save energy would
            # stretch that loss, so it runs at the top allowed clock
            level = self.config.power.allowed_levels()[-1]
        run_s = work / level
        e = self.config.power.energy(work, level) * max(job.gpus, 1)
        lease = _Lease(
            key=key,
            job=job,
            job_raw=award.job,
            level=level,
            run_s=run_s,
            energy_j=e,
            accepted_at=now,
            last_ack_at=now,
            next_renew_at=now,  # tell the client at once that we hold it
            start_by=now + wait,
            left=award.left,
            resume=award.resume,
        )
        self.leases[key] = lease
        self._offer_backoff = 1  # offers found work again
        self._tenant_load[tenant] = self._tenant_load.get(tenant, 0.0) + run_s * max(job.gpus, 1)
        self.stats["shards_won"] += 1
        out: list[Effect] = []
        out.extend(self._schedule(now))
        if lease.next_renew_at <= now:
            lease.next_renew_at = now + self.config.renew_interval_s
            out.append(self._send(tenant, self._renew_msg(lease, now), now))
        self._touch(lease)
        return out

    def _late(
        self, job: JobSpec, tenant: str, shard: int, now: float, start: float, promised: float | None = None,
        key: LeaseKey | None = None,
    ) -> bool:
        """Whether a shard of ``job`` that would start at ``start`` starts
        far later than ``promised`` (by default, what our bid said): awards
        from other clients took the slots between the bid and this award,
        or later work outranked a queued shard; or late enough to miss a
        deadline the promise met. Giving it back lets the client auction it
        again at once, where keeping it would leave it queued until a
        straggler backup."""
        limit = self.config.decline_late_s
        if promised is None:
            promised = self._promised.get((tenant, job.job_id))
        if limit <= 0 or promised is None:
            return False
        run_s = run_time(job, self.throughput)
        # the client may knowingly send more shards of the job than there
        # are slots: those it counted wait for the earlier ones
        held = sum(1 for k in self.leases if k[0] == tenant and k[1] == job.job_id and k != key)
        waves = held // max(self.config.slots // max(job.gpus, 1), 1) + 1
        if start > promised + max(limit, run_s * waves):
            return True
        # a slip that breaks the deadline the promise met: elsewhere it may not
        left = deadline_left(job, shard, now)
        return left is not None and promised - now + run_s <= left < start - now + run_s

    def _etas(self, now: float) -> dict[LeaseKey, float]:
        """Seconds until each lease's shard finishes here. With
        ``queue_etas``, a queued one's start is replayed on the slots in
        ``_schedule``'s order (as a bid's wait is), then its run; else it is
        the work ahead averaged over all slots, which said 88 s for a shard
        this peer's own bid, a moment later, said would start within 4 s (a
        client that moves queued shards elsewhere acts on this figure)."""
        out: dict[LeaseKey, float] = {}
        running: list[_Lease] = []
        queued: list[_Lease] = []
        for lease in self.leases.values():
            if lease.state == LeaseState.RUNNING:
                running.append(lease)
                out[lease.key] = self._remaining(lease, now) / max(lease.job.gpus, 1)
            elif lease.state == LeaseState.QUEUED:
                queued.append(lease)
        if not queued:
            return out
        ctx = self._context(now)
        if self.config.queue_etas:
            waits = self._queued_waits(ctx)
            for lease in queued:
                out[lease.key] = waits[lease.key] + lease.run_s
            return out
        slots = self.config.slots
        ahead = sum(self._remaining(lease, now) for lease in running)
        for lease in self._queue_order(queued, ctx):
            out[lease.key] = ahead / slots + lease.run_s
            ahead += self._remaining(lease, now)
        return out

    def _renew_msg(self, lease: _Lease, now: float, eta: float | None = None) -> LeaseRenew:
        running = lease.state == LeaseState.RUNNING
        lease.renew_sent_at = now  # (a renewal whose ack was lost is timed by its successor)
        if eta is None:
            eta = self._etas(now).get(lease.key, 0.0)
        return LeaseRenew(lease.job.job_id, lease.key[2], lease.key[3], running, eta)

    def _on_lease_ack(self, now: float, signed: Signed, ack: LeaseAck) -> list[Effect]:
        key = (signed.author, ack.job_id, ack.shard, ack.attempt)
        lease = self.leases.get(key)
        if lease is None:
            self.stats["lease_acks_unmatched"] += 1
            return []
        if not ack.ok:
            self.stats["leases_revoked"] += 1
            return self._drop(lease) + self._schedule(now)
        lease.last_ack_at = now
        if lease.renew_sent_at > 0:
            self._sample_rtt(signed.author, now - lease.renew_sent_at)
            lease.renew_sent_at = 0.0
        # the client may grant a longer lease to a shard with a long way to
        # go: renew at a third of it (not more often than configured); or a
        # shorter one to a shard close to done: renew at a third of that
        lease.granted_s = ack.lease_s
        if ack.lease_s >= 3.0 * self.config.renew_interval_s:
            lease.next_renew_at = max(lease.next_renew_at, now + ack.lease_s / 3.0)
        else:
            lease.next_renew_at = min(lease.next_renew_at, now + ack.lease_s / 3.0)
        self._touch(lease)
        return []

    def _sample_rtt(self, client: str, sample: float) -> None:
        """A round trip to ``client`` (RFC 6298's smoothing)."""
        self._client_rtt[client] = smooth_rtt(self._client_rtt.get(client), sample)
        if len(self._client_rtt) > 4096:
            self._client_rtt = forget_oldest(self._client_rtt, 2048)

    def _result_wait(self, client: str) -> float:
        """How long a result to ``client`` goes unacknowledged before it is
        sent again: the client's retransmission timeout (smoothed round trip
        plus four deviations), at least 50 ms, at most ``result_retry_s``
        (also for a client never timed). A result lost on the wire costs a
        sub-second shard one such timeout, not a whole second."""
        r = self._client_rtt.get(client)
        cap = self.config.result_retry_s
        return cap if r is None else min(max(r[0] + 4.0 * r[1], 0.05), cap)

    def _grace(self, lease: _Lease) -> float:
        """Silence from the client after which a lease is abandoned."""
        return max(self.config.lease_grace_s, 2.0 * lease.granted_s)

    def _on_cancel(self, now: float, signed: Signed, cancel: Cancel) -> list[Effect]:
        out: list[Effect] = []
        wanted = set(cancel.shards)
        for key, lease in list(self.leases.items()):
            # only the tenant's own jobs: the key starts with the author
            if key[0] == signed.author and key[1] == cancel.job_id and (not wanted or key[2] in wanted):
                self.stats["shards_cancelled"] += 1
                out.extend(self._drop(lease))
        for key in [k for k in self.outbox if k[0] == signed.author and k[1] == cancel.job_id
                    and (not wanted or k[2] in wanted)]:
            del self.outbox[key]
        return out + self._schedule(now)

    # ------------------------------------------------------------------
    # queue and execution

    def _move(self, lease: _Lease, event: str) -> None:
        new = _TRANSITIONS.get((lease.state, event))
        if new is None:
            raise LocalProtocolError("bad-transition", f"{lease.state} --{event}-->")
        lease.state = new

    def _release(self, lease: _Lease) -> None:
        self.leases.pop(lease.key, None)
        load = self._tenant_load.get(lease.tenant, 0.0) - lease.run_s * max(lease.job.gpus, 1)
        if load <= 1e-9:
            self._tenant_load.pop(lease.tenant, None)
        else:
            self._tenant_load[lease.tenant] = load

    def _drop(self, lease: _Lease) -> list[Effect]:
        was_running = lease.state == LeaseState.RUNNING
        self._move(lease, "drop")
        self._release(lease)
        if was_running:
            self._busy_slots -= max(lease.job.gpus, 1)
            t, j, s, a = lease.key
            return [CancelShard(t, j, s, a)]
        return []

    def _hand_back(self, lease: _Lease, reason: str, now: float, to: str = "") -> list[Effect]:
        """Drop ``lease`` (cancelling its run if it runs) and tell its client
        with an ``AwardDecline`` for ``reason`` (``to``: a peer to invite)."""
        out = self._drop(lease)
        t, j, s, a = lease.key
        out.append(self._send(t, AwardDecline(j, s, a, reason, to), now))
        return out

    def _speed_up(self, now: float) -> list[Effect]:
        """Raise every running shard below the top allowed level to it.

        A level below the top was chosen while the slot had no queue behind
        it (``_time_weight``); once shards wait, the time it costs them
        outweighs the energy saved. The remaining work is done at the new
        clock, and the lease's ETA (what renewals report) follows.
        """
        power = self.config.power
        top = power.allowed_levels()[-1]
        out: list[Effect] = []
        for lease in self.leases.values():
            if lease.state != LeaseState.RUNNING or lease.level >= top:
                continue
            done = min(max(now - lease.started_at, 0.0), lease.run_s)
            # the work done so far at the old clock, the rest at the top
            work_done, work_left = done * lease.level, (lease.run_s - done) * lease.level
            e = (power.energy(work_done, lease.level) + power.energy(work_left, top)) * max(lease.job.gpus, 1)
            self._retime(lease, top, done + (lease.run_s - done) * lease.level / top, e)
            t, j, s, a = lease.key
            out.append(SetLevel(t, j, s, a, top, lease.run_s))
        return out

    def _retime(self, lease: _Lease, level: float, run_s: float, energy_j: float) -> None:
        """A lease's shard runs at ``level``, takes ``run_s`` and draws
        ``energy_j`` in all; the tenant's load here shrinks by the time saved."""
        if lease.tenant in self._tenant_load:
            self._tenant_load[lease.tenant] -= (lease.run_s - run_s) * max(lease.job.gpus, 1)
        lease.level, lease.run_s, lease.energy_j = level, run_s, energy_j
        self.stats["levels_raised"] += 1

    def _rerun_reserve(self) -> float | None:
        """What the level rule reserves for noticing a crash of ours before
        a re-run (``choose_level``'s ``rerun_reserve_s``): the lease our
        clients grant, as the last award said; None with ``rerun_room`` off."""
        return self._award_lease_s if self.config.rerun_room else None

    def _fit_deadline(self, lease: _Lease, now: float) -> None:
        """Before a slowed-down shard with a deadline starts: if its level no
        longer meets the deadline (it waited longer than its bid said), or,
        with ``rerun_room``, no longer leaves room to re-run it at the top
        clock after a crash at the end of its run, take the level that does,
        or the fastest. Checked at the start only: a shard that starts with
        that room keeps it while it runs as planned (the room shrinks with
        what is left of the run), and ``_speed_up`` only raises levels."""
        top = self.config.power.allowed_levels()[-1]
        left = deadline_left(lease.job, lease.key[2], now)
        if left is None or lease.level >= top:
            return
        work = lease.run_s * lease.level
        reserve = self._rerun_reserve()
        if meets_deadline(work, lease.run_s, True, top, start_s=0.0, deadline_s=left, reserve_s=reserve):
            return
        c = choose_level(self.config.power, work, start_s=0.0, deadline_s=left, lam=lease.job.lam,
                         carbon_g_kwh=self.config.carbon_g_kwh, rerun_reserve_s=reserve)
        if c.level <= lease.level:
            return
        self._retime(lease, c.level, c.run_s, c.energy_j * max(lease.job.gpus, 1))

    def _schedule(self, now: float) -> list[Effect]:
        free = self.config.slots - self._busy_slots
        queued = [lease for lease in self.leases.values() if lease.state == LeaseState.QUEUED]
        if not queued:
            return []
        if free <= 0:
            return self._speed_up(now)
        ctx = self._context(now)
        queued = self._queue_order(queued, ctx)
        out: list[Effect] = []
        for lease in queued:
            need = max(lease.job.gpus, 1)
            if need > free:
                # head-of-line: a gang shard is not starved by smaller ones;
                # whatever runs slowed down now holds up a queue: full speed
                out.extend(self._speed_up(now))
                break
            self._fit_deadline(lease, now)
            self._move(lease, "start")
            lease.started_at = now
            if self.config.queue_etas and lease.accepted_at < now:
                # it waited here: tell its client at once that it runs (a
                # client that offered it elsewhere meanwhile cancels the other)
                lease.next_renew_at = min(lease.next_renew_at, now)
                self._touch(lease)
            free -= need
            self._busy_slots += need
            t, j, s, a = lease.key
            self.stats["shards_started"] += 1
            out.append(
                RunShard(
                    tenant=t,
                    job_id=j,
                    shard=s,
                    attempt=a,
                    task=lease.job.task,
                    params=lease.job.params,
                    work_s=lease.job.work_s,
                    gpus=lease.job.gpus,
                    mem_bytes=lease.job.mem_bytes,
                    level=lease.level,
                    run_s=lease.run_s,
                    left=lease.left,
                    resume=lease.resume,
                )
            )
            if lease.resume:
                self.stats["shards_resumed"] += 1
        return out

    def _on_progress(self, now: float, prog: ShardProgress) -> list[Effect]:
        """The executor saved a running shard's progress: tell its client,
        which keeps the latest so that, should this peer be lost, the shard
        goes on elsewhere from there. At most one per ``checkpoint_min_s``
        per shard; one that claims no progress over the last one sent, or
        that no client could take, is dropped and counted."""
        key: LeaseKey = (prog.tenant, prog.job_id, prog.shard, prog.attempt)
        lease = self.leases.get(key)
        if lease is None or lease.state != LeaseState.RUNNING:
            self.stats["checkpoints_unmatched"] += 1  # finished or dropped meanwhile
            return []
        if not (lease.checkpoint_done < prog.done < 1.0) or not 0 < len(prog.state) <= MAX_CHECKPOINT_BYTES:
            self.stats["checkpoints_refused"] += 1
            return []
        if now - lease.checkpoint_at < self.config.checkpoint_min_s:
            self.stats["checkpoints_skipped"] += 1
            return []
        lease.checkpoint_at = now
        lease.checkpoint_done = prog.done
        self.stats["checkpoints_sent"] += 1
        return [self._send(lease.tenant, ShardCheckpoint(prog.job_id, prog.shard, prog.attempt, prog.done,
                                                         prog.state), now)]

    def _on_finished(self, now: float, fin: ShardFinished) -> list[Effect]:
        key: LeaseKey = (fin.tenant, fin.job_id, fin.shard, fin.attempt)
        lease = self.leases.get(key)
        if lease is None or lease.state != LeaseState.RUNNING:
            self.stats["finished_unknown"] += 1  # cancelled meanwhile
            return []
        self._move(lease, "finish")
        self._release(lease)
        self._busy_slots -= max(lease.job.gpus, 1)
        run_s = fin.run_s if fin.run_s > 0 else now - lease.started_at
        gpu_s = run_s * max(lease.job.gpus, 1)
        energy = fin.energy_j if fin.energy_j > 0 else lease.energy_j
        carbon = energy / 3.6e6 * self.config.carbon_g_kwh
        if fin.ok:
            self.ledger.add(self.id, lease.tenant, gpu_s, now)
            self._ledger_dirty = True
            self.stats["shards_run"] += 1
        else:
            self.stats["shards_failed"] += 1
        msg = ShardResult(fin.job_id, fin.shard, fin.attempt, fin.ok, fin.result, fin.error[:1024], gpu_s, energy, carbon)
        wait = self._result_wait(lease.tenant)
        self.outbox[key] = _Outbox(lease.tenant, msg, now + wait, self.config.result_retries, now, wait)
        out: list[Effect] = [self._send(lease.tenant, msg, now)]
        out.extend(self._schedule(now))
        if self.config.offer_interval_s > 0:
            # a slot freed: offer it at once if nothing here takes it
            self._offer_backoff = 1
            self._next_offer = min(self._next_offer, now)
        return out

    def _on_leave(self, now: float) -> list[Effect]:
        """Stop bidding; hand queued shards back; running ones keep going
        (the driver waits for them up to its grace period)."""
        self.leaving = True
        out: list[Effect] = []
        for lease in list(self.leases.values()):
            if lease.state == LeaseState.QUEUED:
                self.stats["shards_handed_back"] += 1
                out.extend(self._hand_back(lease, "leaving", now))
        raw = self._refresh_state(now, force=True)
        out.append(Publish(TOPIC_PEERS, raw, "PeerState"))
        peers = self.view.peers_but(self.id)
        for p in self.rng.sample(peers, min(len(peers), self.config.gossip_fanout * 2)):
            out.append(self._gossip_to(now, p, reply=False, entries=0))
        return out

    def _hand_back_running(self, now: float) -> list[Effect]:
        """Grace period over: give back shards still running."""
        out: list[Effect] = []
        for lease in list(self.leases.values()):
            out.extend(self._hand_back(lease, "leaving", now))
        return out

    @property
    def idle(self) -> bool:
        """No lease held and no result waiting for its ack."""
        return not self.leases and not self.outbox
