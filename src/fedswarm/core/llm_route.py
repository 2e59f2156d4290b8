"""The client side of LLM layer serving, as sans-IO state: routes, bans and
one session's walk along its chain of peers.

No torch, trio or sockets here: hidden states are the shell's business
(``fedswarm.llm_client``), and time is an argument. What this module decides:

* **Routes** (``find_route``): the live spans of a model form a graph over
  block boundaries ``0..L``; a chain is a cheapest path where a hop costs its
  measured one-token round trip or, unmeasured, ``1/throughput`` plus a
  default latency. Ties break on peer ids, so the choice is deterministic.
* **Bans and round trips** (``RouteBook``): a peer that failed us is avoided
  until a time; round trips are an EWMA per peer, fed by the steps the
  client drives hop by hop and by forwarded steps (``observe_chain``: the
  chain's time, split over its hops).
* **One step of one session** (``StepPlan``): which positions to send to
  which hop next, what a resync (``pos-mismatch`` / ``unknown-session``)
  rewinds, and what a failed or lying hop changes in the chain (a detour over
  its blocks only, or a new tail from its first block). The shell performs
  each action and reports back.

The step's transitions::

    next() -> NeedRoute(b)  no hop starts at b and the view has no chain
                            from b: the shell waits for a chain b -> L and
                            calls chain.set_tail(b, route)
    next() -> Send(hs, lo, hi)  send boundary hs.start's inputs [lo, hi) to
                            hs; then sent(hs, hi - lo), resync(hs, length,
                            have) or failed(hs, reason, now)
    next() -> HopOutput(hs, lo)  hs now holds every position of the step:
                            its outputs for [lo, upto) are complete; the
                            shell checks them and calls accept(hs) or
                            lied(hs)
    next() -> Done          every block ran for positions [n, upto)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_HOP_LATENCY",
    "Hop",
    "HopState",
    "live_spans",
    "find_route",
    "RouteBook",
    "Chain",
    "StepPlan",
    "NeedRoute",
    "Send",
    "HopOutput",
    "Done",
    "GiveUp",
]

DEFAULT_HOP_LATENCY = 0.002  # s, assumed network round trip of an unmeasured peer


@dataclass(frozen=True)
class Hop:
    """A peer serving blocks ``[start, end)`` at ``throughput`` tokens/s."""

    peer: str
    start: int
    end: int
    throughput: float


@dataclass(eq=False)
class HopState:
    """A hop of one session's chain and where that peer's cache stands."""

    hop: Hop
    pos: int = 0  # positions the peer's session holds
    pos_before: int = 0  # where the hop's last complete run started


def live_spans(entries: Sequence[Any], model_hash: str) -> list[Hop]:
    """The spans of ``model_hash`` served by the view's live entries."""
    out = []
    for e in entries:
        for s in e.state.spans:
            if s.model == model_hash:
                out.append(Hop(e.peer, s.start, s.end, s.throughput))
    return out


def find_route(
    hops: Sequence[Hop],
    start: int,
    end: int,
    *,
    exclude: set[str] | frozenset[str] = frozenset(),
    cost: Callable[[Hop], float] | None = None,
) -> list[Hop] | None:
    """Cheapest chain of ``hops`` from block ``start`` to block ``end`` (Dijkstra
    over block boundaries; ties break on peer id), or None."""
    cost_of = cost or (lambda h: 1.0 / max(h.throughput, 1e-9) + DEFAULT_HOP_LATENCY)
    by_start: dict[int, list[Hop]] = {}
    for h in hops:
        if h.peer not in exclude and start <= h.start < h.end <= end:
            by_start.setdefault(h.start, []).append(h)
    best: dict[int, tuple[float, int, tuple[str, ...]]] = {start: (0.0, 0, ())}
    prev: dict[int, Hop] = {}
    heap: list[tuple[float, int, tuple[str, ...], int]] = [(0.0, 0, (), start)]
    while heap:
        c, n, ids, b = heapq.heappop(heap)
        if best.get(b) != (c, n, ids):
            continue
        if b == end:
            break
        for h in sorted(by_start.get(b, ()), key=lambda h: (h.peer, h.end)):
            cand = (c + cost_of(h), n + 1, ids + (h.peer,))
            if h.end not in best or cand < best[h.end]:
                best[h.end] = cand
                prev[h.end] = h
                heapq.heappush(heap, (*cand, h.end))
    if end not in best:
        return None
    route = []
    b = end
    while b != start:
        h = prev[b]
        route.append(h)
        b = h.start
    return route[::-1]


class RouteBook:
    """What one client knows about serving peers: bans and round trips."""

    def __init__(self, *, ban_s: float = 60.0, default_latency: float = DEFAULT_HOP_LATENCY) -> None:
        self.ban_s = ban_s
        self.default_latency = default_latency
        self.rtt: dict[str, float] = {}  # EWMA of one-token round trips per peer
        self.banned: dict[str, float] = {}  # peer -> banned until
        #: (peer, start, end) -> until: spans a peer said it no longer serves
        #: (it moved; the view still shows the old state for a while)
        self.retired: dict[tuple[str, int, int], float] = {}

    def excluded(self, now: float) -> set[str]:
        for p in [p for p, t in self.banned.items() if t <= now]:
            del self.banned[p]
        return set(self.banned)

    def ban(self, peer: str, now: float, seconds: float | None = None) -> None:
        self.banned[peer] = now + (self.ban_s if seconds is None else seconds)
        self.rtt.pop(peer, None)

    def retire(self, hop: Hop, now: float, seconds: float | None = None) -> None:
        """``hop``'s peer answered that it does not serve that span (any more):
        skip that span, not the peer, until the view has caught up."""
        self.retired[(hop.peer, hop.start, hop.end)] = now + (self.ban_s if seconds is None else seconds)

    def observe(self, peer: str, seconds: float) -> None:
        """A one-position round trip to ``peer`` took ``seconds``."""
        old = self.rtt.get(peer)
        self.rtt[peer] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def observe_chain(self, hops: Sequence[Hop], seconds: float, *, first: float | None = None) -> None:
        """A forwarded step went through ``hops`` (in route order) peer to
        peer: ``seconds`` from the request to the first hop until the last
        hop's output arrived, so the last peer's answer covers the whole
        chain. ``first``: when the first hop's own answer came (it answers
        once its output is on its way to the next hop: its compute and one
        round trip, as for a step the client drives).

        The first hop is observed at ``first``; the rest of the chain's time
        is split over the later hops in proportion to what the book expects
        of each (``cost``), so their sum moves toward what was measured while
        the ratio between them is kept until steps measure them one by one.
        Without ``first``, or when the chain's output came no later than the
        first hop's answer, the whole time is split that way over every hop.
        """
        if not hops or not seconds > 0:
            return
        rest: Sequence[Hop] = hops
        left = seconds
        if first is not None and 0 < first < seconds and len(hops) > 1:
            self.observe(hops[0].peer, first)
            rest, left = hops[1:], seconds - first
        costs = [self.cost(h) for h in rest]
        total = sum(costs)
        for h, c in zip(rest, costs):
            self.observe(h.peer, left * (c / total if total > 0 else 1.0 / len(rest)))

    def cost(self, h: Hop) -> float:
        r = self.rtt.get(h.peer)
        return r if r is not None else 1.0 / max(h.throughput, 1e-9) + self.default_latency

    def route(self, hops: Sequence[Hop], start: int, end: int, now: float) -> list[Hop] | None:
        if self.retired:
            for k in [k for k, t in self.retired.items() if t <= now]:
                del self.retired[k]
            hops = [h for h in hops if (h.peer, h.start, h.end) not in self.retired]
        return find_route(hops, start, end, exclude=self.excluded(now), cost=self.cost)


@dataclass
class Chain:
    """One session's chain of hops, and the hops it left (to close)."""

    num_layers: int
    hops: list[HopState] = field(default_factory=list)
    stale: list[HopState] = field(default_factory=list)

    def hop_from(self, b: int) -> HopState | None:
        for hs in self.hops:
            if hs.hop.start == b:
                return hs
        return None

    def set_tail(self, b: int, route: Sequence[Hop]) -> None:
        """Replace the chain from boundary ``b`` on with ``route``."""
        idx = next((i for i, hs in enumerate(self.hops) if hs.hop.start >= b), len(self.hops))
        self.stale.extend(self.hops[idx:])
        self.hops = self.hops[:idx] + [HopState(h) for h in route]

    def detour(self, b: int, failed: HopState, route: Sequence[Hop]) -> None:
        """Replace ``failed`` (starting at ``b``) with ``route`` over its blocks;
        the later hops keep their caches."""
        idx = self.hops.index(failed)
        self.stale.append(failed)
        self.hops = self.hops[:idx] + [HopState(h) for h in route] + self.hops[idx + 1 :]

    def rollback(self, length: int) -> None:
        for hs in self.hops:
            hs.pos = min(hs.pos, length)
            hs.pos_before = min(hs.pos_before, length)

    def take_stale(self) -> list[HopState]:
        out, self.stale = self.stale, []
        return out


@dataclass(frozen=True)
class NeedRoute:
    start: int  # a chain start -> L is needed


@dataclass(frozen=True)
class Send:
    hop: HopState
    lo: int
    hi: int  # inputs [lo, hi) of boundary hop.hop.start


@dataclass(frozen=True)
class HopOutput:
    hop: HopState
    lo: int  # the hop's outputs for [lo, upto) are complete


@dataclass(frozen=True)
class Done:
    pass


class GiveUp(Exception):
    """Too many hops failed in one step."""


class StepPlan:
    """Positions ``[n, upto)`` of one session through its chain.

    ``hops()`` and ``book`` give the live spans and the bans when the plan
    looks for a detour; a failure bans the peer in ``book``. ``recoveries``
    lists each replacement (position, failed peer, reason, blocks, time).
    """

    MAX_RESYNCS = 3

    def __init__(
        self,
        chain: Chain,
        book: RouteBook,
        hops: Callable[[], Sequence[Hop]],
        n: int,
        upto: int,
        *,
        max_chunk: int,
        max_attempts: int | None = None,
    ) -> None:
        self.chain = chain
        self.book = book
        self.hops = hops
        self.n = n
        self.upto = upto
        self.max_chunk = max_chunk
        self.max_attempts = 8 * chain.num_layers if max_attempts is None else max_attempts
        self.b = 0
        self.attempts = 0
        self.recoveries: list[dict[str, Any]] = []
        self._run_start: int | None = None  # where the current hop's run started
        self._resyncs = 0

    def next(self) -> NeedRoute | Send | HopOutput | Done:
        if self.b >= self.chain.num_layers:
            return Done()
        hs = self.chain.hop_from(self.b)
        if hs is None:  # no chain yet, or it changed shape
            return NeedRoute(self.b)
        if self._run_start is None:
            self._run_start = hs.pos
            self._resyncs = 0
        if hs.pos < self.upto:
            return Send(hs, hs.pos, min(self.upto, hs.pos + self.max_chunk))
        return HopOutput(hs, self._run_start)

    def sent(self, hs: HopState, k: int) -> None:
        """The hop answered ``k`` positions."""
        hs.pos += k

    def resync(self, hs: HopState, length: int, have: int, now: float) -> None:
        """The peer holds ``length`` positions (0: it lost the session);
        ``have`` is how many of this hop's outputs the session holds. The
        hop's run starts again there (never later than where it started)."""
        self._resyncs += 1
        if self._resyncs > self.MAX_RESYNCS:
            self.failed(hs, f"cannot resync session (peer holds {length} positions)", now)
            return
        start = self._run_start if self._run_start is not None else hs.pos
        hs.pos = max(0, min(length, have, start))
        self._run_start = hs.pos

    def failed(self, hs: HopState, reason: str, now: float, *, moved: bool = False) -> None:
        """The hop failed (transport, timeout, error answer): ban the peer
        (or, when it answered that it moved to another span, retire only that
        span) and route around it. Raises ``GiveUp`` after ``max_attempts``."""
        self.attempts += 1
        if self.attempts > self.max_attempts:
            raise GiveUp(f"giving up after {self.attempts} failed hops: {hs.hop.peer[:16]}: {reason}")
        if moved:
            self.book.retire(hs.hop, now)
        else:
            self.book.ban(hs.hop.peer, now)
        self.recoveries.append({"position": self.n, "failed": hs.hop.peer, "reason": reason,
                                "blocks": [hs.hop.start, hs.hop.end], "t": now})
        self._replace(hs, now)

    def accept(self, hs: HopState) -> None:
        """The hop's outputs are good: on to the next boundary."""
        hs.pos_before = self._run_start if self._run_start is not None else hs.pos
        self._run_start = None
        self.b = hs.hop.end

    def lied(self, hs: HopState, now: float) -> None:
        """A spot check judged the hop's outputs wrong (the shell banned it):
        recompute its blocks elsewhere."""
        self.attempts += 1
        self._replace(hs, now)

    def _replace(self, hs: HopState, now: float) -> None:
        """Route around ``hs``: a detour over its blocks alone (the later hops
        keep their caches); else a new tail from its first block; else a new
        tail from the latest earlier boundary that has one (this step's inputs
        there are known, so the new hops replay them); else wait for one."""
        self._run_start = None
        live = self.hops()
        if hs in self.chain.hops and hs.hop.start == self.b:
            sub = self.book.route(live, self.b, hs.hop.end, now)
            if sub is not None:
                self.chain.detour(self.b, hs, sub)
                return
        bounds = [h.hop.start for h in self.chain.hops if h.hop.start <= self.b]
        for b in sorted(set(bounds) | {self.b}, reverse=True):
            tail = self.book.route(live, b, self.chain.num_layers, now)
            if tail is not None:
                self.chain.set_tail(b, tail)
                self.b = b
                return
        self.chain.set_tail(self.b, [])  # next() asks the shell to wait for a chain (NeedRoute)
