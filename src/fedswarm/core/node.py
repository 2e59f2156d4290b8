"""What peers and clients share: the view, gossip, the guard and counters.

``Node`` is the base of ``PeerCore`` and ``ClientCore``. Its ``_receive``
is the single place where bytes from the network become messages: it
decodes, verifies, checks freshness and replays, and relabels any failure as
a counted rejection, so no peer can crash or stall a core with its input.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

from ..errors import RemoteProtocolError
from .events import Effect, Send
from .identity import Identity
from .ledger import Ledger
from .view import View
from .membership import check_membership
from .wire import (
    MAX_GOSSIP_REPLY,
    Accusation,
    Award,
    Bid,
    CallForBids,
    Gossip,
    LeaseAck,
    LeaseAckBatch,
    LeaseRenew,
    LeaseRenewBatch,
    Message,
    PeerState,
    ShardResult,
    Signed,
    VerifyCache,
    decode,
    encode,
)

__all__ = ["Node", "Guard", "RateLimiter", "Solicited", "SOLICITED_TTL_S", "replies_invited"]


def smooth_rtt(old: tuple[float, float] | None, sample: float) -> tuple[float, float]:
    """Fold a round-trip ``sample`` into ``old`` (smoothed round trip, mean
    deviation; None: the first sample), as RFC 6298 does. The
    retransmission timeout is the smoothed round trip plus four deviations."""
    if old is None:
        return sample, sample / 2.0
    srtt, var = old
    return 0.875 * srtt + 0.125 * sample, 0.75 * var + 0.25 * abs(srtt - sample)


def forget_oldest(d: dict[Any, Any], n: int) -> dict[Any, Any]:
    """``d`` without its first ``n`` entries in insertion order (a bounded
    map that forgets its oldest keys)."""
    return dict(list(d.items())[n:])


class RateLimiter:
    """Token bucket per sender: ``rate`` messages/s, bursts up to ``burst``.

    Bounded memory: when more than ``max_senders`` are tracked, the fullest
    buckets (senders that have been quiet) are forgotten first.
    """

    def __init__(self, rate: float, burst: float, max_senders: int = 4096) -> None:
        self.rate = rate
        self.burst = burst
        self.max_senders = max_senders
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, sender: str, now: float) -> bool:
        tokens, last = self._buckets.get(sender, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[sender] = (tokens, now)
            return False
        self._buckets[sender] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_senders:
            keep = sorted(self._buckets.items(), key=lambda kv: kv[1][0])[: self.max_senders // 2]
            self._buckets = dict(keep)
        return True


#: how long replies invited by one message stay admitted past the rate limit
SOLICITED_TTL_S = 30.0


def replies_invited(msg: Message) -> int:
    """How many messages sending ``msg`` asks its receiver to send back: a
    bid, the awards of its shards; a renewal, its ack; a result, its ack;
    a call for bids, a bid; an award, the first renewal (or a decline) and
    the result; an ack that keeps a lease, the next renewal."""
    if isinstance(msg, Bid):
        return len(msg.shards)
    if isinstance(msg, (LeaseRenew, LeaseRenewBatch, ShardResult, CallForBids)):
        return 1
    if isinstance(msg, Award):
        return 2
    if isinstance(msg, LeaseAck):
        return int(msg.ok)
    if isinstance(msg, LeaseAckBatch):
        return sum(a.ok for a in msg.acks)
    return 0


class Solicited:
    """Replies a node asked each sender for and has not had yet: they are
    admitted when the sender's token bucket is empty.

    The rate limit is for floods nobody asked for. Without this, a client
    that awards one peer 300 shards at once (and acks their renewals and
    results) ran past the peer's bucket, which dropped awards and acks
    whatever their cause, and the resends and lapsed leases that followed
    made one 600-shard job with ``--verify auto`` on a 2-peer swarm take
    72 s in netsim instead of 2.4 s.

    Bounded: at most ``cap`` replies owed per sender, forgotten
    ``SOLICITED_TTL_S`` after the last message that asked for them, and
    at most ``max_senders`` senders (the ones asked longest ago go first).
    The credit is checked before a message is decoded, so it is a count,
    not a match: a sender can spend it on any message, but never on more
    than we asked of it.
    """

    __slots__ = ("cap", "max_senders", "_owed")

    def __init__(self, cap: int, max_senders: int = 4096) -> None:
        self.cap = cap
        self.max_senders = max_senders
        self._owed: dict[str, tuple[int, float]] = {}  # sender -> (replies, admitted until)

    def grant(self, sender: str, n: int, now: float) -> None:
        if n <= 0:
            return
        owed = self._owed.pop(sender, None)  # re-inserted last: the newest ask
        count = owed[0] if owed is not None and owed[1] >= now else 0
        self._owed[sender] = (min(count + n, self.cap), now + SOLICITED_TTL_S)
        if len(self._owed) > self.max_senders:
            self._owed = forget_oldest(self._owed, len(self._owed) - self.max_senders // 2)

    def take(self, sender: str, now: float) -> bool:
        owed = self._owed.get(sender)
        if owed is None or owed[0] < 1 or owed[1] < now:
            return False
        self._owed[sender] = (owed[0] - 1, owed[1])
        return True

    def owed(self, sender: str, now: float) -> int:
        got = self._owed.get(sender)
        return got[0] if got is not None and got[1] >= now else 0


class Guard:
    """Freshness and replay protection for signed direct messages.

    A message is *stale* if its ``issued_at`` is more than ``max_skew_s`` away
    from our clock; it is *replayed* if its ``(author, nonce)`` was seen
    within the window. Entries older than the window are forgotten: a replay
    of them is stale anyway.
    """

    def __init__(self, max_skew_s: float) -> None:
        self.max_skew_s = max_skew_s
        self._seen: dict[tuple[str, int], float] = {}
        self._next_gc = 0.0

    def check(self, author: str, nonce: int, issued_at: float, now: float) -> None:
        if abs(now - issued_at) > self.max_skew_s:
            raise RemoteProtocolError("stale", f"issued {issued_at - now:+.1f}s from now")
        key = (author, nonce)
        if key in self._seen:
            raise RemoteProtocolError("replayed", author[:16])
        self._seen[key] = issued_at
        if now >= self._next_gc:
            horizon = now - 2 * self.max_skew_s
            self._seen = {k: t for k, t in self._seen.items() if t >= horizon}
            self._next_gc = now + self.max_skew_s


class Node:
    """Common state of a swarm participant (peer or client)."""

    def __init__(
        self,
        identity: Identity,
        rng: random.Random,
        *,
        max_view: int,
        max_skew_s: float,
        max_message_bytes: int,
        ledger_tau_s: float = 3600.0,
        verify_cache: VerifyCache | None = None,
        rate_per_s: float = 200.0,
        rate_burst: float = 400.0,
        federations: frozenset[str] = frozenset(),
        rumour_age_s: float = math.inf,
    ) -> None:
        self.identity = identity
        self.id = identity.peer_id
        self.rng = rng
        self.view = View(self.id, max_view, rng=rng, rumour_age_s=rumour_age_s)
        self.ledger = Ledger(ledger_tau_s)
        self.guard = Guard(max_skew_s)
        self.max_skew_s = max_skew_s
        self.max_message_bytes = max_message_bytes
        self.verify_cache = verify_cache if verify_cache is not None else VerifyCache()
        #: rejected inputs by reason tag (``bad-signature``, ``stale``, ...)
        self.rejected: Counter[str] = Counter()
        #: protocol events (``bids_sent``, ``shards_won``, ...)
        self.stats: Counter[str] = Counter()
        self.limiter = RateLimiter(rate_per_s, rate_burst)
        self.solicited = Solicited(int(4 * rate_burst))
        self.federations = federations
        #: peers proven to have returned wrong results (excluded from work)
        self.banned: set[str] = set()

    # -- encoding ----------------------------------------------------------

    def _encode(self, msg: Message, now: float) -> bytes:
        nonce = self.rng.getrandbits(63)
        cache = self.verify_cache
        if cache.trusted and msg.SIGNED:
            # every receiver is an honest core of this process (netsim's fast
            # mode): they check what they receive in every field but the
            # signature, and what an honest core sends passes, so neither
            # side checks it here; the receivers take this message object
            # from the cache instead of decoding the bytes
            # (tests/netsim/test_netsim_sim.py compares with full checks)
            raw = encode(msg, self.identity, issued_at=now, nonce=nonce, check=False)
            cache.remember(raw, self.max_message_bytes, msg, self.id, now, nonce)
            return raw
        return encode(msg, self.identity if msg.SIGNED else None, issued_at=now, nonce=nonce)

    def _send(self, to: str, msg: Message, now: float) -> Send:
        self.solicited.grant(to, replies_invited(msg), now)
        return Send(to, self._encode(msg, now), type(msg).__name__, self._addrs_of(to))

    def _addrs_of(self, peer: str) -> tuple[str, ...]:
        """Where ``peer`` says it can be dialled (its state in the view)."""
        e = self.view.get(peer)
        return e.state.addrs if e is not None else ()

    # -- receiving ---------------------------------------------------------

    def _receive(self, now: float, sender: str, data: bytes) -> Signed | None:
        """Decode and check one message; None (and a counter) if rejected."""
        if not self.limiter.allow(sender, now):
            # the bucket first, so that the credit (and its counter) only
            # matters where the bucket alone would have refused
            if not self.solicited.take(sender, now):
                self.rejected["rate-limited"] += 1
                return None
            self.stats["solicited_past_limit"] += 1
        try:
            signed = decode(data, max_bytes=self.max_message_bytes, cache=self.verify_cache)
            msg = signed.msg
            if isinstance(msg, Gossip):
                return signed
            if isinstance(msg, PeerState):
                return signed  # freshness by seq/ttl in _merge_state
            self.guard.check(signed.author, signed.nonce, signed.issued_at, now)
            return signed
        except RemoteProtocolError as exc:
            self.rejected[exc.reason] += 1
            return None

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    # -- gossip ------------------------------------------------------------

    def _merge_state(self, now: float, raw: bytes, signed: Signed | None = None) -> bool:
        """Verify a relayed PeerState envelope and merge it; True if news."""
        if signed is None:
            try:
                signed = decode(raw, max_bytes=self.max_message_bytes, cache=self.verify_cache)
            except RemoteProtocolError as exc:
                self.rejected[exc.reason] += 1
                return False
        st = signed.msg
        if not isinstance(st, PeerState):
            self.rejected["bad-gossip-entry"] += 1
            return False
        if signed.author == self.id:
            return False
        if signed.issued_at > now + self.max_skew_s:
            self.rejected["stale"] += 1
            return False
        if signed.author in self.banned:
            self.rejected["banned"] += 1
            return False
        trusted = check_membership(st.membership, signed.author, now, self.federations)
        # signed.raw: the bytes of its first decode when the verify cache
        # knew it (equal to raw), so the views of a process share one copy
        news = self.view.merge(signed.author, st, signed.issued_at, signed.raw, now, trusted=trusted)
        if news:
            self.ledger.merge_row(signed.author, st.ledger)
            self._on_state(now, signed.author, st)
        return news

    def _on_state(self, now: float, peer: str, state: PeerState) -> None:
        """Hook: a new state of ``peer`` entered the view."""

    def _handle_gossip(self, now: float, sender: str, g: Gossip) -> list[Effect]:
        for raw in g.entries:
            self._merge_state(now, raw)
        if g.reply:
            if g.want:
                return [self._gossip_to(now, sender, reply=False, entries=g.want)]
            return [self._gossip_to(now, sender, reply=False)]
        return []

    def _own_entry(self, now: float) -> bytes | None:
        """Our own signed state to gossip (None for clients)."""
        return None

    def _gossip_to(self, now: float, to: str, *, reply: bool, entries: int = 8, want: int = 0) -> Send:
        own = self._own_entry(now)
        picked = self.view.sample_for_gossip(min(entries, MAX_GOSSIP_REPLY), self.rng, now, exclude=to)
        raws = ([own] if own is not None else []) + [e.raw for e in picked]
        self.stats["gossip_sent"] += 1
        return Send(to, self._encode(Gossip(tuple(raws), reply, want), now), "Gossip", self._addrs_of(to))

    def is_trusted(self, peer: str) -> bool:
        e = self.view.get(peer)
        return e is not None and e.trusted

    def _handle_accusation(self, now: float, signed: Signed, acc: Accusation) -> bool:
        """Check an accusation's evidence; ban the accused if it holds.

        The evidence must be signed results for one shard in which the
        accused's result differs from those of witnesses that all agree with
        each other, and the witnesses must include a peer *we* trust (whose
        results we believe): a tenant with sybils cannot frame an honest peer
        without a trusted witness.
        Returns True if the accused is newly banned.
        """
        if acc.accused in self.banned or acc.accused == self.id:
            return False
        results: dict[str, bytes] = {}
        for raw in acc.evidence:
            try:
                ev = decode(raw, max_bytes=self.max_message_bytes, cache=self.verify_cache)
            except RemoteProtocolError:
                raise RemoteProtocolError("bad-evidence", "unverifiable result") from None
            r = ev.msg
            if not isinstance(r, ShardResult) or r.job_id != acc.job_id or r.shard != acc.shard or not r.ok:
                raise RemoteProtocolError("bad-evidence", "not a result for this shard")
            results[ev.author] = r.result
        if acc.accused not in results:
            raise RemoteProtocolError("bad-evidence", "no result from the accused")
        bad = results.pop(acc.accused)
        agreeing = [p for p, r in results.items() if r != bad]
        values = {results[p] for p in agreeing}
        if not agreeing or len(values) != 1 or len(agreeing) != len(results):
            raise RemoteProtocolError("bad-evidence", "witnesses do not agree against the accused")
        if not any(self.is_trusted(p) for p in agreeing):
            self.stats["accusations_unwitnessed"] += 1
            return False
        self.ban(acc.accused)
        self.stats["accusations_accepted"] += 1
        return True

    def ban(self, peer: str) -> None:
        self.banned.add(peer)
        self.view.remove(peer)

    def stats_snapshot(self) -> dict[str, Any]:
        return {"rejected": dict(self.rejected), **dict(self.stats)}
