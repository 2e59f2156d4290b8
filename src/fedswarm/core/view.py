"""The swarm view: the newest signed PeerState of each peer we know of.

Rules
-----
1. Newest ``seq`` wins; equal or older ones are ignored (so replays of old
   states are harmless and duplicates are free).
2. An entry expires at ``issued_at + ttl_s`` by *our* clock (peers are assumed
   loosely synchronised; the core rejects states issued too far in the
   future). Relaying never extends a state's life, so a crashed peer drops out
   of every view within one TTL and cannot be kept alive by gossip.
3. A ``leaving`` state is a tombstone: the peer is not offered work, and the
   tombstone keeps older states of it from resurrecting it until it expires.
4. The view is bounded (``max_size``): when full, a new peer's state takes
   the place of an entry drawn at random (``rng``), never our own. (Without
   an ``rng``, of the entry that expires soonest: every view of a swarm
   larger than ``max_size`` then holds the same newest states, so every
   push goes to those few peers and news stops spreading; docs/netsim.md,
   "Gossip convergence".)

Gossip is push anti-entropy with bounded fan-out (see ``Gossiper``): each
interval a peer sends ``fanout`` peers its own state plus ``entries`` others,
half of them the ones it learnt most recently (rumour spreading, so news
travels in O(log N) rounds) and half uniformly at random (anti-entropy, so
every entry is eventually refreshed). Bytes per peer per second are
``fanout * (entries + 1) * size / interval`` whatever the swarm size.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from .wire import PeerState

__all__ = ["ViewEntry", "View"]


@dataclass(slots=True, init=False)
class ViewEntry:
    peer: str
    state: PeerState
    issued_at: float
    raw: bytes  # the signed envelope, relayed as is
    learnt_at: float
    trusted: bool  # admitted by a federation we trust (core.membership)
    counted: bool  # its capacity is in View._cap (live when last asked)
    #: ``issued_at + state.ttl_s``, kept (an entry's state never changes;
    #: read millions of times a run at 10,000 peers)
    expires_at: float = field(init=False)

    # (a written ``__init__``, not the dataclass's: compiled by mypyc, the
    # generated one runs as Python, about 5x slower, on a hot path)
    def __init__(self, peer: str, state: PeerState, issued_at: float, raw: bytes, learnt_at: float,
                 trusted: bool = False, counted: bool = False) -> None:
        self.peer = peer
        self.state = state
        self.issued_at = issued_at
        self.raw = raw
        self.learnt_at = learnt_at
        self.trusted = trusted
        self.counted = counted
        self.expires_at = issued_at + state.ttl_s


def _capacity_of(st: PeerState) -> tuple[int, int, int]:
    """A state's slots, the slots whose occupancy it reports, the busy ones."""
    if st.free_s and len(st.free_s) == min(st.slots, 64):
        n = len(st.free_s)
        return st.slots, n, n - bisect.bisect_right(st.free_s, 0.0)
    return st.slots, 0, 0


class View:
    """Bounded map of peer id -> newest ``ViewEntry``."""

    def __init__(self, self_id: str, max_size: int = 1024, graveyard_s: float = 600.0,
                 rng: random.Random | None = None, rumour_age_s: float = math.inf) -> None:
        self.self_id = self_id
        self.max_size = max_size
        #: draws the entry a full view drops (None: the soonest to expire)
        self.rng = rng
        #: a full view's newcomer is a rumour only if issued within this
        #: long (see ``merge``)
        self.rumour_age_s = rumour_age_s
        self.graveyard_s = graveyard_s
        self._entries: dict[str, ViewEntry] = {}
        #: every peer id, sorted: kept in step with ``_entries`` (bisect)
        #: instead of re-sorted after each new peer (a 1,000-entry sort per
        #: gossip round at 10,000 peers)
        self._sorted: list[str] = []
        self._version = 0
        self._live_key: tuple[float, int] | None = None
        self._live_val: list[ViewEntry] = []
        #: the entries that are not tombstones, sorted by peer id, with
        #: their ids: built on the first ``live`` call, then kept up to date
        #: on every change (None: not built; peers seldom ask)
        self._nl: list[ViewEntry] | None = None
        self._nl_ids: list[str] = []
        #: peers learnt most recently, newest last (rumour half of gossip)
        self._recent: list[str] = []
        #: peers whose state expired recently -> when; probed now and then so
        #: that the two sides of a healed partition find each other again
        self.graveyard: OrderedDict[str, float] = OrderedDict()  # oldest first
        #: (expires_at, peer) of every entry merged; stale items are skipped
        self._expiry: list[tuple[float, str]] = []
        #: stale heap items allowed beyond 4 per entry before the heaps are
        #: compacted (``_compact``; a test sets it huge: never compacted)
        self.compact_slack = 64
        #: (slots, slots with known occupancy, busy ones) summed over the
        #: counted entries: those not leaving and not yet seen expired by
        #: ``capacity``, kept up to date on every change (see ``capacity``)
        self._cap = [0, 0, 0]
        self._cap_heap: list[tuple[float, int, ViewEntry]] = []
        self._cap_seq = 0
        self._cap_now = float("-inf")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, peer: str) -> bool:
        return peer in self._entries

    @property
    def version(self) -> int:
        """Changes whenever an entry is added, replaced or removed (a cheap
        test of whether the view changed)."""
        return self._version

    def get(self, peer: str) -> ViewEntry | None:
        return self._entries.get(peer)

    def is_live(self, peer: str, now: float) -> bool:
        """Whether ``peer`` is in ``live(now)``, without building that list:
        a serving peer asks this for each hop of a forwarded step's route,
        on every decode step, whatever the size of its view."""
        e = self._entries.get(peer)
        return e is not None and not e.state.leaving and e.expires_at > now

    def merge(
        self, peer: str, state: PeerState, issued_at: float, raw: bytes, now: float, *, trusted: bool = False
    ) -> bool:
        """Offer a verified state; return True if it was news (newer seq)."""
        old = self._entries.get(peer)
        if old is not None and old.state.seq >= state.seq:
            return False
        if issued_at + state.ttl_s <= now:
            return False
        rumour = True
        if old is None:
            if len(self._entries) >= self.max_size:
                if not (self._evict(now) if self.rng is None else self._evict_random(self.rng, now)):
                    return False
                # a full view turns over all the time: a peer taken in place
                # of another is a rumour only if its state is new (the churn
                # of old states would push real news out of the rumour half)
                rumour = now - issued_at <= self.rumour_age_s
            bisect.insort(self._sorted, peer)
        else:
            self._uncount(old)
        e = self._entries[peer] = ViewEntry(peer, state, issued_at, raw, now, trusted)
        if not state.leaving:
            self._count(e)
        if self._nl is not None:
            self._nl_put(old, e)
        heapq.heappush(self._expiry, (issued_at + state.ttl_s, peer))
        if len(self._expiry) > 4 * len(self._entries) + self.compact_slack:
            self._compact()
        self._version += 1
        self.graveyard.pop(peer, None)
        if rumour:
            self._recent.append(peer)
            if len(self._recent) > 256:
                del self._recent[:128]
        return True

    def _compact(self) -> None:
        """Drop the heaps' stale items (replaced or dropped entries), which
        otherwise stay until their expiry: a full view that turns over
        many times per TTL held most of a large simulation's memory in
        them. The live items keep their keys, so the order in which they
        come out, and so every result, is unchanged."""
        entries = self._entries
        self._expiry = list(
            dict.fromkeys((w, p) for w, p in self._expiry if (e := entries.get(p)) is not None and e.expires_at == w)
        )
        heapq.heapify(self._expiry)
        self._cap_heap = [item for item in self._cap_heap if item[2].counted]
        heapq.heapify(self._cap_heap)

    def _pop_stale(self) -> None:
        """Pop the expiry heap's stale head items (their entries replaced or
        gone), so that its head is a live entry's expiry if it has any."""
        heap, entries = self._expiry, self._entries
        while heap:
            when, p = heap[0]
            e = entries.get(p)
            if e is not None and e.expires_at == when:
                return
            heapq.heappop(heap)

    def _evict_random(self, rng: random.Random, now: float) -> bool:
        """Drop an entry that has expired if there is one, else one drawn at
        random, never our own: views smaller than the swarm stay spread over
        it (and a flood of new ids cannot choose whom it pushes out)."""
        heap = self._expiry
        self._pop_stale()
        if heap and heap[0][0] <= now and heap[0][1] != self.self_id:
            return self._evict(now)
        srt = self._sorted
        n = len(srt)
        if n == 0 or (n == 1 and srt[0] == self.self_id):
            return False
        i = rng.randrange(n)
        if srt[i] == self.self_id:
            i = (i + 1) % n
        self._drop(srt[i])
        self._version += 1
        return True

    def _evict(self, now: float) -> bool:
        """Drop the entry that expires soonest (ties: smallest id), never our own."""
        heap = self._expiry
        mine: list[tuple[float, str]] = []
        victim = None
        while heap:
            when, p = heap[0]
            e = self._entries.get(p)
            if e is None or e.expires_at != when:
                heapq.heappop(heap)  # stale: replaced or gone
            elif p == self.self_id:
                mine.append(heapq.heappop(heap))
            else:
                victim = p
                break
        for item in mine:
            heapq.heappush(heap, item)
        if victim is None:
            return False
        heapq.heappop(heap)
        self._drop(victim)
        self._version += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Drop expired entries; return the ids dropped (sorted)."""
        heap = self._expiry
        found: set[str] = set()
        while heap and heap[0][0] <= now:
            _, p = heapq.heappop(heap)
            e = self._entries.get(p)
            if e is not None and p != self.self_id and e.expires_at <= now:
                found.add(p)
        self._uncount_expired(now)  # also bounds _cap_heap where capacity is never asked
        dead = sorted(found)
        for p in dead:
            if not self._entries[p].state.leaving:
                self.graveyard.pop(p, None)
                self.graveyard[p] = now
            self._drop(p)
        if dead:
            self._version += 1
        g = self.graveyard
        if g:
            horizon = now - self.graveyard_s
            while g and next(iter(g.values())) <= horizon:
                g.popitem(last=False)
            if len(g) > self.max_size:
                keep = sorted(g.items(), key=lambda kv: (-kv[1], kv[0]))[: self.max_size]
                self.graveyard = OrderedDict(sorted(keep, key=lambda kv: (kv[1], kv[0])))
        return dead

    def remove(self, peer: str) -> None:
        self.graveyard.pop(peer, None)
        old = self._entries.get(peer)
        if old is not None:
            self._drop(peer)
            self._version += 1

    def peers(self) -> list[str]:
        """Known peer ids in sorted order (deterministic iteration). The
        view's own list, kept up to date: callers must not mutate it."""
        return self._sorted

    def peers_but(self, peer: str) -> list[str]:
        """``[p for p in peers() if p != peer]``, as a new list, by slicing."""
        srt = self._sorted
        i = bisect.bisect_left(srt, peer)
        if i < len(srt) and srt[i] == peer:
            return srt[:i] + srt[i + 1 :]
        return srt[:]

    def _drop(self, peer: str) -> None:
        """Remove ``peer``'s entry (present) from the map, the counts and
        the sorted non-tombstones."""
        old = self._entries.pop(peer)
        self._uncount(old)
        srt = self._sorted
        del srt[bisect.bisect_left(srt, peer)]
        if self._nl is not None and not old.state.leaving:
            i = bisect.bisect_left(self._nl_ids, peer)
            del self._nl[i], self._nl_ids[i]

    def _nl_put(self, old: ViewEntry | None, e: ViewEntry) -> None:
        """Keep the sorted non-tombstones in step with ``e`` replacing ``old``."""
        nl, ids = self._nl, self._nl_ids
        assert nl is not None
        was = old is not None and not old.state.leaving
        now_in = not e.state.leaving
        if not was and not now_in:
            return
        i = bisect.bisect_left(ids, e.peer)
        if was and now_in:
            nl[i] = e
        elif now_in:
            nl.insert(i, e)
            ids.insert(i, e.peer)
        else:
            del nl[i], ids[i]

    def live(self, now: float) -> list[ViewEntry]:
        """Entries that are unexpired and not leaving, sorted by peer id.

        Memoised per ``(now, version)``: callers must not mutate the list.
        The non-tombstones are kept sorted as the view changes, so a call
        after a change copies them, or filters them when some entry may have
        expired (the expiry heap's head, a lower bound of every entry's
        expiry but our own, is due): O(view) at C speed, no sort.
        """
        key = (now, self._version)
        if key != self._live_key:
            nl = self._nl
            if nl is None:
                nl = self._nl = [e for e in map(self._entries.__getitem__, self.peers()) if not e.state.leaving]
                self._nl_ids = [e.peer for e in nl]
            out = nl[:]
            gone = self._expired(now)
            if gone:
                ids = self._nl_ids
                drop = []
                for p in gone:
                    i = bisect.bisect_left(ids, p)
                    if i < len(ids) and ids[i] == p:
                        drop.append(i)
                for i in sorted(drop, reverse=True):
                    del out[i]
            self._live_key, self._live_val = key, out
        return self._live_val

    def _expired(self, now: float) -> set[str]:
        """The entries still here whose expiry is past at ``now`` (``expire``
        drops them at its next call; a client calls it once per pull).

        Found from the expiry heap, not by a scan of the view (at 10,000
        entries a scan per call of ``live`` was a tenth of a large run): the
        stale items at its head are popped (``_pop_stale``), then a walk
        visits only the items due by ``now`` (a subtree whose root is later
        holds none).
        Every entry but our own keeps an item of its expiry in the heap;
        ours is checked apart (``expire`` pops its item and keeps it)."""
        heap, entries = self._expiry, self._entries
        self._pop_stale()
        gone: set[str] = set()
        if heap and heap[0][0] <= now:
            n = len(heap)
            stack = [0]
            while stack:
                i = stack.pop()
                w, p = heap[i]
                if w > now:
                    continue
                e = entries.get(p)
                if e is not None and e.expires_at == w:
                    gone.add(p)
                j = 2 * i + 1
                if j < n:
                    stack.append(j)
                    if j + 1 < n:
                        stack.append(j + 1)
        own = entries.get(self.self_id)
        if own is not None and own.expires_at <= now:
            gone.add(own.peer)
        return gone

    def _count(self, e: ViewEntry) -> None:
        cap = self._cap
        for i, v in enumerate(_capacity_of(e.state)):
            cap[i] += v
        e.counted = True
        self._cap_seq += 1
        heapq.heappush(self._cap_heap, (e.expires_at, self._cap_seq, e))
        if len(self._cap_heap) > 4 * len(self._entries) + self.compact_slack:
            self._compact()

    def _uncount(self, e: ViewEntry) -> None:
        if e.counted:
            cap = self._cap
            for i, v in enumerate(_capacity_of(e.state)):
                cap[i] -= v
            e.counted = False

    def capacity(self, now: float) -> tuple[int, int, int]:
        """``(slots, known, busy)`` summed over ``live(now)``: every live
        peer's slots, the slots whose occupancy its state reports
        (``free_s``), and how many of those are busy.

        Kept as running sums: an entry is counted when merged (unless it is
        a tombstone) and uncounted when replaced or dropped, or here, once
        ``now`` has passed its expiry. So a call costs O(expired since the
        last one). Asked about an earlier time than before, it scans
        ``live(now)`` instead.
        """
        if now < self._cap_now:
            slots = known = busy = 0
            for e in self.live(now):
                s, k, b = _capacity_of(e.state)
                slots, known, busy = slots + s, known + k, busy + b
            return slots, known, busy
        self._uncount_expired(now)
        cap = self._cap
        return cap[0], cap[1], cap[2]

    def _uncount_expired(self, now: float) -> None:
        self._cap_now = max(self._cap_now, now)
        heap = self._cap_heap
        while heap and heap[0][0] <= now:
            self._uncount(heapq.heappop(heap)[2])

    def sample_for_gossip(self, k: int, rng: random.Random, now: float, exclude: str) -> list[ViewEntry]:
        """Up to ``k`` unexpired entries: half the most recently learnt
        (rumour spreading), the rest uniformly at random (anti-entropy)."""
        if k <= 0:
            return []

        def ok(p: str) -> bool:
            e = self._entries.get(p)
            return e is not None and p != exclude and p != self.self_id and e.expires_at > now

        chosen: list[str] = []
        seen: set[str] = set()
        for p in reversed(self._recent):
            if len(chosen) >= k // 2:
                break
            if p not in seen and ok(p):
                chosen.append(p)
            seen.add(p)
        peers = self.peers()
        want = min(k, len(peers))
        if len(peers) <= 2 * k:
            # a small view: sample the eligible rest exactly, instead of up
            # to 4k blind draws of which most miss (a pull asks for 255)
            pool = [p for p in peers if p not in seen and ok(p)]
            chosen.extend(rng.sample(pool, min(want - len(chosen), len(pool))) if len(chosen) < want else ())
            return [self._entries[p] for p in chosen]
        tries = 0
        while len(chosen) < want and tries < 4 * k:
            tries += 1
            p = peers[rng.randrange(len(peers))]
            if p not in seen and ok(p):
                chosen.append(p)
            seen.add(p)
        return [self._entries[p] for p in chosen]

    def __repr__(self) -> str:
        return f"<View {len(self._entries)} peers>"
