"""Finish-time forecasting for a client: when a shard would start and end on a peer.

``Forecaster`` owns what a ``ClientCore`` learns about its peers beyond their
signed states, and answers from it how soon a shard would finish where:

* round trips: per peer (call for bids to bid, and view pulls), smoothed as
  RFC 6298 does, and per region for peers never heard from (``transit``,
  ``rto``, ``bid_window``, ``resend_after``);
* news: each bid's start time, fresher than its peer's state, until a newer
  state arrives (``remember``, ``news_wait``);
* staleness: per class of peer speed and state age (and whether the state
  showed a free slot, and whether the shard has a deadline), how much later
  than their states predicted the peers have bid (``learn_stale``,
  ``stale_class``);
* the awards this client sent each peer since its state was issued, which
  that state cannot show (``note_award``, ``unpend``, ``awarded_since``);
* ties: this client's own order among peers ranked equal (``tie``).

``view_wait`` and ``eta`` combine them into a peer's wait and finish for one
shard. Every per-peer map is bounded (by ``config.max_view``). No I/O, no
randomness: the client's auction draws its random picks itself.
"""

from __future__ import annotations

import bisect
import math
import zlib
from typing import Any, Callable

from .config import ClientConfig
from .fairness import run_time
from .node import smooth_rtt
from .slots import fill, replay_sorted
from .view import View, ViewEntry
from .wire import Bid, JobSpec, PeerState

__all__ = ["Forecaster", "position", "AGE_CLASSES", "MAX_PENDING"]

MAX_PENDING = 256  # awards remembered per peer until its next state
AGE_CLASSES = 8  # ages of a state: [0, 1), [1, 3), [3, 7), ... [127, inf) seconds
#: a peer's speed for the task, in half-octaves below the reference: [1, inf),
#: [0.71, 1), [0.5, 0.71), [0, 0.5)
SPEED_CLASSES = 4

#: an award this client sent a peer: (run seconds, slots, sent at, job_id, shard, attempt)
Pending = tuple[float, int, float, str, int, int]


def position(bid: Bid, k: int) -> float:
    """When a shard would start on ``bid``'s peer behind ``k`` more shards
    than the bid counted: the wait its ``next_s`` lists for that position;
    past the list (or from a peer that sends none), whole waves of its
    ``slots`` after the last wait it gave."""
    if k == 0:
        return bid.start_s
    nxt = bid.next_s
    if k <= len(nxt):
        return nxt[k - 1]
    if not nxt:
        return bid.start_s + (k // bid.slots) * bid.run_s
    return nxt[-1] + ((k - len(nxt)) // bid.slots + 1) * bid.run_s


def _newest_half(d: dict[str, Any]) -> dict[str, Any]:
    """The more recently updated half of a per-peer map whose values start
    with the time of their update. Peers that left never send the newer
    state that would clear their entry, so such maps are cut this way."""
    return dict(sorted(d.items(), key=lambda kv: (kv[1][0], kv[0]))[len(d) // 2 :])


class Forecaster:
    """A client's beliefs about its peers' queues and links. See the module docstring.

    Args:
        config: the client's configuration (``ClientCore.config`` keeps it current).
        view: the client's view (states, their age and regions).
        salt: this client's seed for ``tie`` (e.g. a hash of its id).
    """

    def __init__(self, config: ClientConfig, view: View, salt: int) -> None:
        self.config = config
        self.view = view
        self._salt = salt
        #: peer -> (last award time, [Pending] of each shard awarded there
        #: since its state was issued)
        self._pending: dict[str, tuple[float, list[Pending]]] = {}
        #: peer -> (time, seconds to start, for a job with a deadline) its
        #: last bid said: fresher than its state
        self._news: dict[str, tuple[float, float, bool]] = {}
        self._ties: dict[str, int] = {}
        #: peer -> (time of the last sample, smoothed round trip, its mean deviation)
        #: from call for bids to bid
        self._rtt: dict[str, tuple[float, float, float]] = {}
        #: region -> smoothed round trip of the bids from its peers
        self._region_rtt: dict[str, float] = {}
        #: per staleness class (``stale_class``): the mean of how much later
        #: than their states predicted the peers have bid (0: no sample yet)
        self._stale = [0.0] * (2 * 2 * AGE_CLASSES * SPEED_CLASSES)
        #: peer -> (state, queued work poured?, its slot free times after
        #: that pour, sorted): ``view_wait`` ranks the same state many times
        #: (every round that samples the peer) until the next one arrives
        self._slot_times: dict[str, tuple[PeerState, bool, list[float]]] = {}

    # -- round trips -----------------------------------------------------

    def sample_rtt(self, peer: str, now: float, sample: float) -> None:
        """A call-for-bids-to-bid round trip of ``peer`` (RFC 6298's smoothing)."""
        old = self._rtt.get(peer)
        srtt, var = smooth_rtt(None if old is None else (old[1], old[2]), sample)
        e = self.view.get(peer)
        if e is not None:
            region = e.state.region
            prior = self._region_rtt.get(region)
            if prior is not None or len(self._region_rtt) < 256:
                self._region_rtt[region] = sample if prior is None else 0.875 * prior + 0.125 * sample
        self._rtt[peer] = (now, srtt, var)
        if len(self._rtt) > self.config.max_view:
            self._rtt = _newest_half(self._rtt)

    def transit(self, peer: str, e: ViewEntry | None = None) -> float:
        """Seconds an award to ``peer`` and its result spend on the wire: its
        smoothed round trip; for a peer never heard from, that of its region
        (as its state names it), and none for a region never heard from, so
        that its peers get asked and measured (optimism: taking the mean of
        the known instead kept one client calling far peers it had measured
        over near ones it never tried). Among peers that would finish alike,
        the near one hands back the result first (it matters for sub-second
        shards)."""
        r = self._rtt.get(peer)
        if r is not None:
            return r[1]
        if e is None:
            e = self.view.get(peer)
        if e is not None:
            prior = self._region_rtt.get(e.state.region)
            if prior is not None:
                return prior
        return 0.0

    def bid_window(self, invited: list[str]) -> float:
        """How long a round waits for bids: ``bid_window_s``, or less when
        every invitee has answered before, namely the longest of their
        retransmission timeouts (smoothed round trip plus four deviations).
        A bid later than that is most likely not coming (the call or the
        bid was lost, or the peer is gone or declined to bid), and a
        sub-second job should not wait the whole window for it."""
        cfg = self.config
        worst = 0.0
        for p in invited:
            rto = self.rto(p)
            if rto is None:
                return cfg.bid_window_s
            worst = max(worst, rto)
        return min(cfg.bid_window_s, max(worst, cfg.bid_window_min_s))

    def rto(self, peer: str) -> float | None:
        """Retransmission timeout for ``peer``: its smoothed round trip plus
        four mean deviations (None: never heard from)."""
        r = self._rtt.get(peer)
        return None if r is None else r[1] + 4.0 * r[2]

    def resend_after(self, slack_s: float, expect_s: float, peer: str) -> float:
        """How long an award may go unconfirmed before it is sent again.

        The peer confirms an award with a renewal at once, so the wait is
        its retransmission timeout (as for its bid, ``rto``; the peer has
        just bid, so it is known), and at most ``award_resend_s``, the shard's
        expected run, or half its deadline slack (time left less its expected
        finish), so a lost award still leaves it time to make its deadline;
        never sooner than ``bid_window_min_s``. Each resend doubles the wait.
        """
        cfg = self.config
        rto = self.rto(peer)
        if rto is None:
            rto = cfg.bid_window_s
        cap = min(cfg.award_resend_s, max(min(slack_s / 2.0, expect_s), cfg.bid_window_min_s))
        return max(min(rto, cap), cfg.bid_window_min_s)

    # -- awards not in a peer's state yet ----------------------------------

    def note_award(self, peer: str, now: float, award: Pending) -> None:
        """This client awarded ``peer`` a shard at ``now``."""
        pend = self._held(peer)
        held = pend[1] if pend is not None else []
        if len(held) < MAX_PENDING:
            held.append(award)
        self._pending[peer] = (now, held)
        if len(self._pending) > self.config.max_view:
            self._pending = _newest_half(self._pending)

    def unpend(self, peer: str, job_id: str, shard: int, attempt: int) -> None:
        """An award to ``peer`` is over (its result or decline came): it no
        longer holds a slot there in this client's replay of the peer's
        queue, until a newer state would have dropped it anyway."""
        pend = self._held(peer)
        if pend is None:
            return
        held = [a for a in pend[1] if not (a[3] == job_id and a[4] == shard and a[5] == attempt)]
        if len(held) != len(pend[1]):
            self._pending[peer] = (pend[0], held)

    def pending(self, peer: str) -> list[Pending]:
        """The awards sent ``peer`` that its state may not show yet."""
        pend = self._held(peer)
        return [] if pend is None else pend[1]

    def awarded_since(self, peer: str, t: float) -> int:
        pend = self._held(peer)
        return 0 if pend is None or pend[0] < t else sum(1 for a in pend[1] if a[2] >= t)

    def _held(self, peer: str, e: ViewEntry | None = None) -> tuple[float, list[Pending]] | None:
        """``peer``'s entry of ``_pending``, dropped (None) once the view
        holds a state of it issued a bid window after the last award there:
        that state counts them. Every reader and writer goes through this,
        so what they see depends on the states received, never on which
        forecasts were asked for before (a dropped list used to linger until
        the next forecast for that peer, and a new award was added to it)."""
        pend = self._pending.get(peer)
        if pend is None:
            return None
        if e is None:
            e = self.view.get(peer)
        if e is not None and e.issued_at > pend[0] + self.config.bid_window_s:
            del self._pending[peer]  # a newer state already counts them
            return None
        return pend

    # -- news and staleness ------------------------------------------------

    def remember(self, now: float, peer: str, bid: Bid, deadline: bool) -> None:
        """A bid is news about its peer, fresher than the peer's state."""
        self._news[peer] = (now, bid.start_s, deadline)
        if len(self._news) > self.config.max_view:
            self._news = _newest_half(self._news)

    def news_wait(self, spec: JobSpec, e: ViewEntry, now: float) -> float | None:
        """The wait the peer's last bid implies now, if that bid is newer
        than its state and speaks for ``spec`` (a bid for a shard with a
        deadline may have jumped a queue that a plain shard waits for)."""
        news = self._news.get(e.peer)
        if news is None:
            return None
        if e.issued_at > news[0]:
            del self._news[e.peer]  # the state is newer than the bid
            return None
        if news[2] or spec.deadline_s is None:
            return news[1] - (now - news[0])
        return None

    @staticmethod
    def stale_class(spec: JobSpec, e: ViewEntry, now: float, wait: float) -> int:
        """Which of the staleness means applies to a prediction from ``e``'s
        state: by the peer's speed for the task (``SPEED_CLASSES``), by the
        state's age (doubling classes), by whether it showed a slot free,
        and by whether the shard has a deadline (it may jump a queue).

        The speed matters on a loaded swarm: the fast peers are taken first,
        so an old "idle" state of a fast peer is likely stale while that of
        a slow one is likely true. Learnt in one mean, a second look raised
        both alike and still ranked the fast, busy ones first (twice the
        load on 400 peers, docs/evaluation.md: a 6.8 s shard whose second
        looks asked busy A100s and RTX 4090s ran at last on a 0.25 peer)."""
        age = max(now - e.issued_at, 0.0)
        k = min(int(math.log2(1.0 + age)), AGE_CLASSES - 1)
        thr = e.state.throughput
        speed = thr.get(spec.task, thr.get("*", 1.0))
        s = min(int(-2.0 * math.log2(speed)), SPEED_CLASSES - 1) if 0.0 < speed < 1.0 else 0
        return ((s * AGE_CLASSES + k) * 2 + (wait > 0.5)) * 2 + (spec.deadline_s is not None)

    def learn_stale(self, predicted: tuple[int, float] | None, bid: Bid) -> None:
        """Fold how far a peer's state was off (``predicted``: its staleness
        class and the wait it predicted), by its bid, into that class's mean."""
        if predicted is None:
            return
        k, wait = predicted
        self._stale[k] += self.config.stale_gain * ((bid.start_s - wait) - self._stale[k])

    @property
    def stale_means(self) -> tuple[float, ...]:
        """Per staleness class, how much later than predicted peers have bid."""
        return tuple(self._stale)

    # -- waits and finishes ------------------------------------------------

    def _awarded(self, e: ViewEntry) -> list[Pending]:
        """This client's awards to ``e``'s peer that its state cannot show
        (read, not copied); dropped once a state newer than them arrives."""
        pend = self._held(e.peer, e)
        return [] if pend is None else pend[1]

    def view_wait(self, spec: JobSpec, e: ViewEntry, now: float, *, queued: bool = True,
                  awards: bool = True) -> float:
        """Seconds until one shard of ``spec`` would start on ``e``'s peer, as
        its state says (and this client's awards there since).

        When the state says when each slot frees (``free_s``), the queued
        work (``backlog_s`` less what is running) is poured onto the
        earliest slots, the state's age drains them, the shards this client
        awarded there since that state was issued (``note_award``) take their
        slots, and the shard starts when ``spec.gpus`` slots are free
        (``core.slots``). A shard with a deadline skips the queued work: it
        jumps the queue when it is urgent (``fairness.URGENT_SLACK``).
        Without ``free_s`` the backlog is taken as an average per slot.
        ``queued=False``: the soonest the shard could start, past running
        work only (a fairness-ordered queue may put it ahead of the rest).
        ``awards=False``: as if this client had awarded nothing there since
        the state (a lower bound: they only delay the start).
        """
        st = e.state
        age = max(now - e.issued_at, 0.0)
        g = max(spec.gpus, 1)
        awarded = self._awarded(e)
        if not awards:
            awarded = []
        if st.free_s and len(st.free_s) == st.slots:
            t = self._slots_of(e.peer, st, spec.deadline_s is None and queued)  # sorted, >= 0
            if not awarded:  # the common case: the g-th slot to free, less the state's age
                return max(t[min(g, len(t)) - 1] - age, 0.0)
            return replay_sorted([max(x - age, 0.0) for x in t], awarded, g)
        if not queued:
            return 0.0  # no slot times: running and queued work are not told apart
        backlog = max(st.backlog_s - age, 0.0)
        return backlog + sum(a[0] * a[1] for a in awarded) / max(st.slots, 1)

    def _slots_of(self, peer: str, st: PeerState, pour: bool) -> list[float]:
        """``st``'s slot free times (sorted, >= 0), with its queued work
        (``backlog_s`` less what is running) poured onto the earliest slots
        when ``pour``; kept per peer until its state or ``pour`` changes.
        The list is shared: callers read it."""
        hit = self._slot_times.get(peer)
        if hit is not None and hit[0] is st and hit[1] == pour:
            return hit[2]
        poured = max(st.backlog_s * st.slots - sum(st.free_s), 0.0) if pour else 0.0
        t = fill(st.free_s, poured)
        if len(self._slot_times) >= 2 * self.config.max_view:
            self._slot_times.clear()
        self._slot_times[peer] = (st, pour, t)
        return t

    def eta(self, spec: JobSpec, e: ViewEntry, now: float, *, stale: bool = False, awards: bool = True) -> float:
        """Estimated finish of one shard of ``spec`` on ``e``'s peer: its
        wait (``view_wait``), at least what a newer bid of the peer said
        (``news_wait``), then its run. ``stale``: a wait from the state
        alone is raised by how much later than such states (of that age)
        peers have lately bid (``learn_stale``). ``awards``: as ``view_wait``'s."""
        wait = self.view_wait(spec, e, now, awards=awards)
        news = self.news_wait(spec, e, now)
        if news is not None:
            wait = max(wait, news)
        elif stale:
            wait += max(self._stale[self.stale_class(spec, e, now, wait)], 0.0)
        return wait + run_time(spec, e.state.throughput)

    def floor(self, spec: JobSpec, e: ViewEntry, now: float, *, stale: bool = False) -> tuple[float, bool]:
        """A lower bound on ``eta(spec, e, now, stale=stale)``, and whether it
        is that eta exactly: it is, unless this client's awards there since
        the state (``note_award``) must be replayed, which only ever delays
        a start (each shard replayed takes slot time, none gives it back).
        Its side effects are ``eta``'s: a state newer than the peer's awards
        or its last bid drops them, so skipping ``eta`` for a peer whose
        floor is too late changes nothing after."""
        if not self._awarded(e):
            return self.eta(spec, e, now, stale=stale), True
        # without the awards, and without a stale class's mean (never below 0)
        return self.eta(spec, e, now, awards=False), False

    def _settle(self, e: ViewEntry) -> None:
        """``floor``'s side effects on ``e`` without its arithmetic: a state
        newer than this client's awards there, or than the peer's last bid,
        drops them. A search that skips a peer whose bound already loses
        calls this, so what it leaves behind is what a full scan leaves."""
        self._awarded(e)
        news = self._news.get(e.peer)
        if news is not None and e.issued_at > news[0]:
            del self._news[e.peer]

    def beats(self, spec: JobSpec, entries: list[ViewEntry], now: float, wins: Callable[[float], bool]) -> bool:
        """``wins(min(eta(spec, e, now) for e in entries))`` (False when
        empty), for a ``wins`` that is monotone (true of a finish, true of
        every sooner one), leaving what evaluating every eta leaves: no eta
        is computed once the answer is known, nor for a peer whose run alone
        (a lower bound of its eta) already loses, and awards are replayed
        only at peers whose floor could still win."""
        found = False
        rest: list[tuple[float, ViewEntry]] = []
        for e in entries:
            if found or not wins(run_time(spec, e.state.throughput)):
                self._settle(e)
                continue
            v, exact = self.floor(spec, e, now)
            if wins(v):
                if exact:
                    found = True
                else:
                    rest.append((v, e))
        if found:
            return True
        rest.sort(key=lambda x: x[0])
        return any(wins(self.eta(spec, e, now)) for _, e in rest)

    def rank(self, spec: JobSpec, entries: list[ViewEntry], k: int, now: float, *, stale: bool = False
             ) -> list[ViewEntry]:
        """The ``k`` entries that finish soonest with two transits, ties by
        ``tie`` and then by their order in ``entries``: exactly
        ``heapq.nsmallest(k, entries, key=(eta + 2 * transit, tie))``. The
        entries are visited by a lower bound of that key (the run alone, two
        transits); the search stops once the bound loses to the k-th found,
        and awards are replayed only at peers whose floor could still make
        the k. The peers skipped get ``floor``'s side effects (``_settle``)."""
        bounds: list[tuple[float, int, int, float]] = []
        for i, e in enumerate(entries):
            t2 = 2.0 * self.transit(e.peer, e)
            bounds.append((run_time(spec, e.state.throughput) + t2, self.tie(e.peer), i, t2))
        bounds.sort()
        top: list[tuple[float, int, int]] = []
        later: list[tuple[float, int, int]] = []
        for j, (lb, tie, i, t2) in enumerate(bounds):
            if len(top) >= k and (lb, tie) > top[-1][:2]:
                for b in bounds[j:]:  # every later bound loses too
                    self._settle(entries[b[2]])
                break
            v, is_exact = self.floor(spec, entries[i], now, stale=stale)
            row = (v + t2, tie, i)
            if is_exact:
                if len(top) < k or row < top[-1]:
                    bisect.insort(top, row)
                    del top[k:]
            else:
                later.append(row)
        later.sort()
        for lo, tie, i in later:
            if len(top) >= k and (lo, tie) > top[-1][:2]:
                break  # this floor and every later one lose to the k-th
            e = entries[i]
            row = (self.eta(spec, e, now, stale=stale) + 2.0 * self.transit(e.peer, e), tie, i)
            if len(top) < k or row < top[-1]:
                bisect.insort(top, row)
                del top[k:]
        return [entries[i] for _, _, i in top]

    def tie(self, peer: str) -> int:
        """This client's own order among peers its view ranks equal. A
        shared order (by id) would send every client's shards to the same
        peer whenever their views agree, e.g. on a swarm seen as idle."""
        k = self._ties.get(peer)
        if k is None:
            if len(self._ties) >= 4 * self.config.max_view:
                self._ties.clear()
            k = self._ties[peer] = zlib.crc32(peer.encode(), self._salt)
        return k
