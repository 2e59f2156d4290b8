"""Configuration of the cores: plain frozen dataclasses, no file access.

``fedswarm.profiles`` builds a ``PeerConfig`` from a TOML peer profile
(``peers/*.toml``); netsim and the daemon both go through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .energy import PowerModel
from .wire import Device

__all__ = ["PeerConfig", "ClientConfig", "QUEUE_POLICIES"]

QUEUE_POLICIES = ("rho", "share", "fifo")


@dataclass(frozen=True)
class PeerConfig:
    # -- hardware and power ------------------------------------------------
    devices: tuple[Device, ...] = (Device("cpu", "cpu", 1, 8 << 30, 8 << 30),)
    slots: int = 1  # devices usable by shards side by side (GPUs)
    throughput: dict[str, float] = field(default_factory=lambda: {"*": 1.0})
    power: PowerModel = PowerModel(idle_w=10.0, max_w=65.0, alpha=2.5, levels=(1.0,))
    energy_price: float = 0.2  # per kWh
    carbon_g_kwh: float = 300.0
    tasks: frozenset[str] | None = None  # task kinds served; None: any known
    # -- identity and membership -------------------------------------------
    trust: str = "volunteer"
    membership: bytes = b""
    region: str = ""
    addrs: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    # -- gossip ------------------------------------------------------------
    gossip_interval_s: float = 1.0
    gossip_fanout: int = 2
    gossip_entries: int = 8
    state_ttl_s: float = 30.0
    state_refresh_s: float = 10.0
    # quiet gossip (issue 23): while idle (no lease, no pending result, not
    # leaving) with an unchanged state, each push round doubles the push
    # interval, up to this factor (1: off), and a quiet round pushes to one
    # peer with 2 * gossip_fanout * gossip_entries entries. An idle peer's
    # state advertises state_ttl_s and is refreshed every state_refresh_s,
    # both times this factor (from its start); a busy peer's, the base ones.
    # Bounds: a crashed idle peer leaves every view within
    # state_ttl_s * gossip_quiet_max (a busy one within state_ttl_s; its
    # shards are caught by their leases); a quiet peer's state crosses a
    # healed split with its next state_refresh_s * gossip_quiet_max refresh.
    # 8 (with the clients' quiet pulls): an idle swarm sends 7.5x fewer
    # messages than with both off (churn-200, idle-10 trace; docs/netsim.md)
    gossip_quiet_max: int = 8
    gossip_probe_rate: float = 0.1  # per round: ask a lost or bootstrap peer for its view
    max_view: int = 1024
    join_pull: int = 255  # view entries asked of each bootstrap peer on start (<= 255)
    # -- auction, leases, results ------------------------------------------
    renew_interval_s: float = 2.0
    # one LeaseRenewBatch per client and renewal round for all of its shards
    # held here (those due within half an interval go along), not one
    # LeaseRenew per shard; off: one message per shard, as before
    renew_batch: bool = False
    lease_grace_s: float = 12.0  # abandon a shard whose client stopped acking
    result_retry_s: float = 1.0  # longest wait before a result is resent (the first: the client's timed RTO)
    result_retries: int = 60
    # decline an award whose shard would now start this much later than our
    # bid said (other clients' awards took the slots in between), and hand
    # back a queued shard whose start slipped this far past what we expected
    # on accepting it, or whose start now misses a deadline the earlier
    # start met; 0: never
    decline_late_s: float = 30.0
    # renewals of queued shards carry their finish with the start replayed on
    # the slots in queue order (as a bid's wait), not the work ahead averaged
    # over all slots, and a shard that waited renews as soon as it starts:
    # what clients' rescues (ClientConfig.rescue_gain) act on. Off by default
    queue_etas: bool = False
    # slot offers (issue 23; PeerCore, "Slot offers"): a peer with a free
    # slot and nothing queued offers it to the view's peer with the most
    # queued work per slot, at once when a slot frees and then every
    # offer_interval_s, doubling while offers bring nothing, up to
    # offer_backoff_max times (one peer is offered again after
    # 4 * offer_interval_s at the soonest); that peer hands back each queued
    # shard that would finish sooner at the offerer by more than
    # move_margin_s plus move_margin_ratio of the run there, naming the
    # offerer to its client. 0: no offers (an offer received is still
    # honoured). Off by default: 2.0 met the max-rho goal on 30 of 48
    # loaded evaluation runs against 25, but sent 12 to 43 offers per shard
    # and made scale-10k some 40% slower (docs/evaluation.md, "Slot offers")
    offer_interval_s: float = 0.0
    offer_backoff_max: int = 16
    # > 0: offer no slot to a peer whose top throughput is more than this
    # many times ours (its queued shards would rarely finish sooner here).
    # 0: no such filter. 2.0, with offer_backoff_max = 64, sent 5x to 9x
    # fewer offers per shard on the evaluation rows it ran (docs/evaluation.md)
    offer_max_ratio: float = 0.0
    move_margin_s: float = 2.0
    move_margin_ratio: float = 0.1
    max_backlog_s: float = math.inf
    queue_policy: str = "rho"
    fairness_knob: float = 1.0  # 1: pure finish-time fairness; 0: shortest first
    race_to_idle: bool = False
    # on: a shard with a deadline runs below the top clock only if, should
    # this peer crash at the very end of that run, the client could notice
    # it (the lease its awards grant) and re-run it once at the top clock
    # within the deadline (core.energy.leaves_rerun_room). Off by default:
    # on docs/evaluation.md's runs it met one goal and missed two others
    # ("A level rule that leaves room for a re-run")
    rerun_room: bool = False
    # a running shard's checkpoints (``ShardProgress`` from the executor) go
    # to its client at most this often; those in between are dropped (the
    # next one carries more progress)
    checkpoint_min_s: float = 10.0
    # -- safety ------------------------------------------------------------
    max_skew_s: float = 60.0
    allowed_tenants: frozenset[str] | None = None
    tenant_cap_s: float = math.inf  # queued + running seconds per tenant
    ledger_tau_s: float = 3600.0
    max_message_bytes: int = 4 * 1024 * 1024
    rate_per_s: float = 200.0  # messages per second accepted from one sender
    rate_burst: float = 400.0
    federations: frozenset[str] = frozenset()  # federation keys whose members we trust

    def __post_init__(self) -> None:
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}")
        if self.slots < 1 or self.gossip_fanout < 0 or self.gossip_interval_s <= 0:
            raise ValueError("bad slots / gossip settings")
        if self.gossip_quiet_max < 1:
            raise ValueError("gossip_quiet_max must be >= 1")
        for name, value in (("offer_interval_s", self.offer_interval_s), ("offer_max_ratio", self.offer_max_ratio),
                            ("move_margin_s", self.move_margin_s), ("move_margin_ratio", self.move_margin_ratio)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.offer_backoff_max < 1:
            raise ValueError(f"offer_backoff_max must be >= 1, got {self.offer_backoff_max}")
        if not 0 <= self.join_pull <= 255:
            raise ValueError("join_pull must be in [0, 255]")


@dataclass(frozen=True)
class ClientConfig:
    bootstrap: tuple[str, ...] = ()
    probe_ratio: float = 2.0  # peers asked per open shard (Sparrow's d)
    probe_min: int = 3
    probe_max: int = 32
    # a round ranks at most this many candidates: a seeded random sample of
    # the live view plus the peers that lately won this client's awards
    # (``ClientCore._candidates``), so its cost does not grow with the swarm;
    # a view of at most this many live peers is ranked whole. 0: always whole
    rank_max: int = 256
    # a round that invites few peers ranks fewer: a sample of this many per
    # invitation (at most rank_max), as Sparrow probes d per task; 0: always
    # rank_max. A view of at most rank_max live peers is still ranked whole
    rank_per_probe: int = 0
    explore_ratio: float = 0.25  # share of invitations sent to random peers, not the best-ranked
    bid_window_s: float = 0.5
    # a round waits less when every invitee answered before: their longest
    # retransmission timeout (see ClientCore._bid_window), never below this
    bid_window_min_s: float = 0.05
    # a one-shard round closes before every invitee has bid unless a missing
    # one could still finish more than this sooner than the best bid in hand
    # (see ClientCore._rest_would_lose): a smaller gain is within the noise of
    # the estimates, and waiting for it costs the whole window when a bid was lost
    close_margin_s: float = 0.01
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 8.0
    lease_s: float = 8.0  # a lease lapses this long after the last renewal
    max_lease_s: float = 120.0  # longest lease granted to a shard with a long ETA
    # a shard close to done gets a lease of this many times its ETA (at least
    # short_lease_min_s) when that is shorter than lease_s: its result is due
    # within the ETA, so silence well past it is a crash, noticed in seconds
    # rather than after lease_s (a 6.6 s shard whose peer crashed 0.7 s into
    # its run waited 29 s of a 30 s lease). 0 (the default): every lease is
    # at least lease_s. docs/evaluation.md measures 1.5
    short_lease_factor: float = 0.0
    short_lease_min_s: float = 2.0
    max_attempts: int = 20
    gossip_interval_s: float = 2.0
    # True: pull a view every gossip_interval_s whether or not a shard waits
    # (the behaviour so far). False: pull only while some shard is open or
    # being auctioned, plus once on submit (unless a pull went out within the
    # interval), so an idle tenant costs the swarm no messages (issue 23)
    idle_pull: bool = True
    # quiet pulls: while no job of ours is unfinished and our view shows no
    # busy slot and no model span served (an idle swarm; an LLM client's
    # routes follow the spans), each pull doubles the interval to the next,
    # up to this factor of gossip_interval_s (1: off); a submit brings it
    # back to the base interval, with a pull at once unless one went out
    # within gossip_interval_s (issue 23: ten idle tenants pulling every
    # interval were a quarter of an idle swarm's messages)
    pull_quiet_max: int = 8
    pull_entries: int = 255  # view entries asked of a peer per gossip pull (<= 255)
    # a pull whose answer held at least this share of peers new to the view
    # (of the entries asked for, or of those sent when the peer had fewer) is
    # followed by another pull at once, to another random peer: a client of a
    # large swarm whose peers' views are partial learns it in a burst of
    # pulls instead of one pull per interval (3,000 peers with views of about
    # 100: 1,200 known after 60 s, 1,930 with the burst), and the burst ends
    # once the answers are mostly peers it knows. 0: one pull per interval
    pull_again_share: float = 0.25
    max_view: int = 1024
    max_skew_s: float = 60.0
    suspect_s: float = 60.0  # a peer whose lease lapsed (while others reached us) is not invited for this long
    min_trust: str = ""  # "datacenter": only trusted peers are invited
    carbon_weight: float = 0.0  # joules-equivalent per gram of CO2 in the award rule
    # -- second looks: the best bid is far worse than the view promised elsewhere
    rebid_gain: float = 0.5  # re-auction when others should finish this share of the best bid's finish sooner
    rebid_min_s: float = 5.0  # ... and at least this many seconds sooner
    # ... or this many runs of the best bid's shard, if fewer: a 0.2 s job is
    # not served well by a finish 2 s away when the view lists a free peer
    # (an absolute 5 s margin is 25 such runs); 0: the seconds alone
    rebid_min_runs: float = 4.0
    max_rebids: int = 2  # re-auctions of one round's shards before the best bid is taken anyway
    # -- rescues: a shard queued at its holder is auctioned again, once, when
    # the view says another peer should finish it this share of the holder's
    # finish sooner (and rebid_min_s); the queued attempt is kept until the
    # new one starts. 0 (the default): a shard waits where it was awarded.
    # Off by default: on scale-10k they ran for 62% of the shards and cost
    # 18% more messages per peer-second for the same mean JCT (docs/
    # evaluation.md, "Rescues"). Peers should set queue_etas
    rescue_gain: float = 0.0
    # -- stale states: weight of each bid in the mean of how much later than
    # its peer's state predicted bids come, per class of state age (an old
    # "free" state is ranked down by that); 0: never learn, trust the view
    stale_gain: float = 0.125
    # -- an award not confirmed by a renewal is sent again (it may be lost)
    award_resend_s: float = 2.0  # 0 disables
    award_resends: int = 3
    max_message_bytes: int = 4 * 1024 * 1024
    rate_per_s: float = 500.0
    rate_burst: float = 1000.0
    federations: frozenset[str] = frozenset()
    # -- verification of results from untrusted peers ----------------------
    verify: str = "auto"  # "none" | "auto" (by reputation) | "always"
    quorum: int = 2  # agreeing results from distinct peers that settle a shard
    verify_min_rate: float = 0.1  # spot-check rate for well-reputed peers
    verify_trust_after: float = 20.0  # agreed results after which checks reach the min rate
    max_replicas: int = 5  # results collected for one shard before giving up
    # -- checkpoints: a shard whose peer is lost goes on elsewhere from the
    # last ``ShardCheckpoint`` its peer sent, instead of from the start. A
    # checkpoint is taken only from a trusted peer, or from any with verify
    # "none": a resumed run builds on the state as given, and re-running the
    # rest from a bad state would agree with it. False: every re-run starts over
    resume: bool = True
    # -- stragglers: a shard running far past its bid gets a backup elsewhere
    straggler_factor: float = 3.0  # 0 disables; backup after factor x (bid wait + run)
    straggler_min_s: float = 10.0
    max_backups: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.pull_entries <= 255:
            raise ValueError("pull_entries must be in [0, 255]")
        if self.pull_quiet_max < 1:
            raise ValueError("pull_quiet_max must be >= 1")
        if not 0.0 <= self.pull_again_share <= 1.0:
            raise ValueError("pull_again_share must be in [0, 1]")
        if self.rank_max < 0:
            raise ValueError("rank_max must be >= 0")
        if self.rank_per_probe < 0:
            raise ValueError("rank_per_probe must be >= 0")
        if self.short_lease_factor < 0 or self.short_lease_min_s <= 0:
            raise ValueError("short_lease_factor must be >= 0 and short_lease_min_s > 0")
        if self.rebid_min_runs < 0:
            raise ValueError("rebid_min_runs must be >= 0")
        if not 0.0 <= self.rescue_gain < 1.0:
            raise ValueError("rescue_gain must be in [0, 1)")
        if not 0.0 <= self.stale_gain <= 1.0:
            raise ValueError("stale_gain must be in [0, 1]")
        if self.verify not in ("none", "auto", "always"):
            raise ValueError("verify must be none, auto or always")
        if self.quorum < 2 or self.max_replicas < self.quorum:
            raise ValueError("quorum >= 2 and max_replicas >= quorum")
