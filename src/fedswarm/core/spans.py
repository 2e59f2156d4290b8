"""The serving side of LLM layer serving as a sans-IO state machine.

``ServingCore`` is what one serving peer decides, with no torch, sockets or
clocks in it (time is an argument, tensors are opaque handles it never
touches):

* the **session table**: sessions keyed by (transport-authenticated sender,
  session id, span start, span end), each with its length, capacity and the
  KV-cache bytes it holds;
* **admission** against ``ServerLimits`` (open sessions, cache bytes of all
  sessions together, positions per session) and the position rules of the
  wire protocol (``fedswarm.llm_protocol``): a refusal is a ``Refusal`` with
  the protocol's error code;
* **expiry** of sessions idle (and not computing) for ``idle_timeout_s``;
* **batch decisions**: queued steps (opaque ids with their token counts)
  and which of them form the next forward (one at a time);
* **span placement** (``PlacementPolicy``; only with ``--blocks auto``): on a
  timer (``poll``) it re-reads the swarm's advertised spans and decides
  whether this peer should move, loads the new span while the old one still
  serves (``LoadSpan``), switches (``Advertise``), drains the old span's
  sessions (bounded) and drops it (``DropSpan``). It probes the other span
  holders (``Probe``): a state in the view outlives a crashed peer by up to
  its TTL, a probe that fails twice does not;
* the **clock level** of its spans (``span_level``, with a ``PowerModel`` in
  ``power``): the least-energy level that keeps the measured demand under
  ``LEVEL_HEADROOM`` of the device's time, full clock when steps wait for a
  batch (``SetSpanLevel``; ``energy_state`` for ``/status``).

The runtime (``fedswarm.llm_serving.BlockServer``) performs the effects: it
runs the forwards on torch off the event loop, loads spans from the
checkpoint, sends probes and puts the advertised spans into the peer's
signed state.

Placement rule (see ``ServingCore._plan``): per block, the swarm's serving
throughput is the sum of the advertised tokens/s of the live spans over it.
A layout is scored by its uncovered blocks (fewer first), then by its sorted
per-block throughputs (larger first: "leximin"). A peer moves when the move
covers a block nobody serves, or raises the bottleneck (the least served
block) by ``min_gain`` times and it has held its span ``min_dwell_s``.
Every peer works out the same for every span holder; holders whose move
would help are ranked (best resulting layout first, then a hash of the peer
id and the need, so peers that see the same gap do not all jump into it).
The first moves at once, the k-th only after the need has lasted ``k *
patience_s`` (it did not move: a static peer, a failed load). Every block
held is not enough: when no chain of spans whose boundaries meet runs from
block 0 to the last, a holder moves to join one (a "route" need), and a move
for throughput that would leave no chain is not made.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .energy import PowerModel

__all__ = [
    "MAX_TENANT",
    "MAX_WEIGHT",
    "tenant_problem",
    "weight_problem",
    "ServerLimits",
    "ServerStats",
    "PlacementPolicy",
    "Session",
    "SessionKey",
    "Refusal",
    "Admission",
    "SpanAd",
    "SwarmSpans",
    "ServingCore",
    "SetSpanLevel",
    "span_level",
    "LEVEL_HEADROOM",
    "SpanLoaded",
    "SpanLoadFailed",
    "ProbeDone",
    "LoadSpan",
    "DropSpan",
    "Advertise",
    "Probe",
    "choose_span",
    "auto_span_size",
    "per_block",
    "layout_score",
]

#: (sender, session id, span start, span end)
SessionKey = tuple[str, bytes, int, int]

#: fair sessions: a tenant's name and weight (see ``ServingCore.take_batch``)
MAX_TENANT = 64
MAX_WEIGHT = 1000.0


def tenant_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tenant's name, or None."""
    return None if 1 <= len(name) <= MAX_TENANT else f"a tenant name is 1..{MAX_TENANT} characters, got {len(name)}"


def weight_problem(weight: float) -> str | None:
    """Why ``weight`` cannot be a tenant's weight, or None."""
    return None if 0 < weight <= MAX_WEIGHT else f"a weight is in (0, {MAX_WEIGHT:g}], got {weight:g}"
SpanRange = tuple[int, int]


@dataclass(frozen=True)
class ServerLimits:
    """What one serving peer accepts (every request is checked against these)."""

    max_tokens_per_request: int = 1024  # new positions in one forward request
    max_sessions: int = 64
    max_session_length: int = 2048  # positions per session (also <= max_position_embeddings)
    max_cache_bytes: int = 128 * 1024 * 1024  # KV caches of all sessions together
    max_batch: int = 32  # sessions' steps batched into one forward
    idle_timeout_s: float = 300.0


@dataclass
class ServerStats:
    requests: int = 0
    step_requests: int = 0  # multi-session ``step`` requests answered
    errors: int = 0
    forwards: int = 0  # forward calls on the span (batches)
    steps: int = 0  # session steps computed
    batched_steps: int = 0  # steps that shared a forward with another session
    max_batch: int = 0
    tokens: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0
    sessions_expired: int = 0
    compute_s: float = 0.0
    by_error: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementPolicy:
    """How a ``--blocks auto`` peer keeps its span placed."""

    n_blocks: int  # size of the span this peer serves
    tick_s: float = 2.0  # re-evaluation (and probe) interval
    min_gain: float = 1.5  # a move for throughput must raise the bottleneck this many times
    min_dwell_s: float = 30.0  # ... and the span must have been held this long
    patience_s: float = 5.0  # the k-th ranked mover waits k times this
    drain_s: float = 60.0  # longest wait for the old span's sessions after a switch
    probe_timeout_s: float = 2.0
    max_probes: int = 8  # probes per tick (round robin over the holders)
    suspect_after: int = 2  # consecutive failed probes that make a holder count as gone
    max_rank: int = 64  # other holders whose moves ours is ranked against (bounds a tick's work)


@dataclass
class Session:
    span: SpanRange
    length: int  # positions held in the cache
    max_length: int
    nbytes: int
    last_used: float
    busy: bool = False
    closed: bool = False
    #: the runtime's KV cache (opaque here)
    cache: Any = None


@dataclass(frozen=True)
class Refusal:
    """A request refused with the protocol's error ``code``."""

    code: str
    detail: str
    length: int | None = None  # the server's length, for ``pos-mismatch``


@dataclass(frozen=True)
class Admission:
    key: SessionKey
    session: Session
    created: bool  # a new session (the runtime gives it a cache)
    refusal: Refusal | None = None  # set: refused after creating it (as the protocol has it)


@dataclass(frozen=True)
class SpanAd:
    """A span some peer advertises (from the swarm view)."""

    peer: str
    start: int
    end: int
    throughput: float


class SwarmSpans(Sequence[SpanAd]):
    """The spans of a model in the view, with what every placement tick
    derives from them computed once: the holders (sorted), each holder's
    spans, and the per-block throughput and holder counts over all of them.

    ``ServingCore.poll`` takes any sequence of ``SpanAd`` and wraps it in
    one; a caller that feeds the same view to many cores (netsim: a swarm
    of 1,000 peers shares one) passes a ``SwarmSpans`` and the O(spans) work
    is done once, not once per peer and tick."""

    def __init__(self, ads: Iterable[SpanAd], num_layers: int = 0) -> None:
        self.ads: tuple[SpanAd, ...] = tuple(ads)
        self.by_peer: dict[str, list[tuple[int, int, float]]] = {}
        for a in self.ads:
            self.by_peer.setdefault(a.peer, []).append((a.start, a.end, a.throughput))
        self.peers: tuple[str, ...] = tuple(sorted(self.by_peer))
        self._totals: dict[int, tuple[list[float], list[int]]] = {}
        self._reach: dict[int, tuple[set[int], set[int]]] = {}
        if num_layers:
            self.totals(num_layers)

    def __len__(self) -> int:
        return len(self.ads)

    def __getitem__(self, i: Any) -> Any:
        return self.ads[i]

    def __iter__(self) -> Iterator[SpanAd]:
        return iter(self.ads)

    def reach(self, num_layers: int) -> tuple[set[int], set[int]]:
        """Boundaries a chain of these spans reaches from 0, and those that reach ``num_layers`` (cached)."""
        got = self._reach.get(num_layers)
        if got is None:
            got = self._reach[num_layers] = _reach(((a.start, a.end) for a in self.ads), num_layers)
        return got

    def totals(self, num_layers: int) -> tuple[list[float], list[int]]:
        """Per-block throughput and holder counts over every span here (cached)."""
        got = self._totals.get(num_layers)
        if got is None:
            thr = [0.0] * num_layers
            cnt = [0] * num_layers
            for spans in self.by_peer.values():
                _add(thr, cnt, spans, 1)
            got = self._totals[num_layers] = (thr, cnt)
        return got


def _add(thr: list[float], cnt: list[int], spans: Iterable[tuple[int, int, float]], sign: int) -> None:
    """Add (sign 1) or take away (-1) ``spans`` to per-block throughput and holder counts."""
    L = len(thr)
    for lo, hi, t in spans:
        t = max(t, 0.0) * sign
        for i in range(max(lo, 0), min(hi, L)):
            thr[i] += t
            cnt[i] += sign


# -- energy: the clock level a span serves at ------------------------------------

#: a span may run at a lower clock only while its forwards keep the device
#: busy at most this fraction of the time at that clock (room for bursts)
LEVEL_HEADROOM = 0.5
LEVEL_TAU_S = 30.0  # time constant of the measured demand


def span_level(power: PowerModel, demand: float, *, saturated: bool, headroom: float = LEVEL_HEADROOM) -> float:
    """The clock level a span serves at, from the profile's power model.

    ``demand`` is the fraction of the time the span's forwards would keep the
    device busy at full clock (recent work over time). As for batch shards
    (``core.energy``): the level of least energy that still meets the demand,
    here the least mean power ``u * P(f) + (1 - u) * P_idle`` with
    ``u = demand / f``, among the levels that keep ``u <= headroom``; the
    fastest allowed level when none does or when the span is ``saturated``
    (steps waited for a batch: the swarm needs all it has)."""
    levels = power.allowed_levels()
    fastest = levels[-1]
    if saturated or demand < 0:
        return fastest
    best: tuple[float, float] | None = None
    for f in levels:
        if demand / f > headroom:
            continue
        # mean power above idle is demand * (P(f) - P_idle) / f: rank by the
        # energy a unit of work costs above the idle floor (so an idle span
        # waits at the level its next work is cheapest at)
        w = (power.power(f) - power.idle_w) / f
        if best is None or w <= best[0] * (1 + 1e-12):  # levels ascend: a tie goes to the faster
            best = (w, f)
    return fastest if best is None else best[1]


# -- inputs and effects of placement ------------------------------------------

@dataclass(frozen=True)
class SpanLoaded:
    start: int
    end: int
    throughput: float  # tokens/s measured through it
    bytes_per_pos: int  # KV-cache bytes one session position costs
    load_s: float = 0.0


@dataclass(frozen=True)
class SpanLoadFailed:
    start: int
    end: int
    error: str = ""


@dataclass(frozen=True)
class ProbeDone:
    peer: str
    ok: bool


@dataclass(frozen=True)
class LoadSpan:
    start: int
    end: int


@dataclass(frozen=True)
class DropSpan:
    start: int
    end: int


@dataclass(frozen=True)
class Advertise:
    spans: tuple[tuple[int, int, float], ...]  # (start, end, tokens/s) of the spans that take new sessions


@dataclass(frozen=True)
class Probe:
    peer: str
    timeout_s: float


@dataclass(frozen=True)
class SetSpanLevel:
    """Run this peer's spans at clock ``level`` from now on (``span_level``)."""

    level: float


@dataclass
class _SpanSlot:
    bytes_per_pos: int
    throughput: float
    since: float
    draining: bool = False
    drain_until: float = float("inf")


@dataclass
class _Queued:
    item: Any
    key: SessionKey
    tokens: int
    tenant: str = ""
    weight: float = 1.0
    seq: int = 0


# -- scoring ------------------------------------------------------------------

def per_block(spans: Iterable[tuple[int, int, float]], num_layers: int) -> list[float]:
    """Serving throughput per block: the sum over the spans that hold it."""
    out = [0.0] * num_layers
    for a, b, thr in spans:
        for i in range(max(a, 0), min(b, num_layers)):
            out[i] += max(thr, 0.0)
    return out


def layout_score(blocks: Sequence[float], holders: Sequence[int] | None = None) -> tuple[int, tuple[float, ...]]:
    """Smaller is better: uncovered blocks (no holder; without ``holders``:
    no throughput), then the sorted throughputs negated (so a layout with a
    larger bottleneck, then a larger second least served block, ... wins)."""
    gaps = sum(1 for x in blocks if x <= 0.0) if holders is None else sum(1 for c in holders if c <= 0)
    return gaps, tuple(-x for x in sorted(blocks))


def _hash(*parts: object) -> bytes:
    return hashlib.sha256(":".join(map(str, parts)).encode()).digest()


def choose_span(
    spans: list[tuple[str, int, int, float]],
    num_layers: int,
    n_blocks: int,
    *,
    self_id: str = "",
    current: tuple[int, int] | None = None,
    min_gain: float = 1.5,
) -> tuple[int, int]:
    """Petals-style allocation: the ``n_blocks`` window whose weakest block has
    the least serving throughput among ``spans`` ((peer, start, end, tok/s)).

    Our own spans are ignored. With ``current`` given, it is kept unless the
    best window's bottleneck is ``min_gain`` times worse than current's (so
    peers do not flap between equally good choices). Ties break on a hash of
    ``self_id`` so peers that join together spread out.
    """
    n_blocks = max(1, min(n_blocks, num_layers))
    blocks = per_block(((a, b, thr) for peer, a, b, thr in spans if peer != self_id), num_layers)

    def key(s: int) -> tuple[float, float, bytes]:
        w = blocks[s : s + n_blocks]
        return (min(w), sum(w), _hash(self_id, s))

    best = min(range(num_layers - n_blocks + 1), key=key)
    if current is not None and current[1] - current[0] == n_blocks:
        cur = blocks[current[0] : current[1]]
        if min(cur) <= min_gain * key(best)[0] or min(cur) == 0:
            return current
    return best, best + n_blocks


def auto_span_size(num_layers: int, block_bytes: int, mem_bytes: int, cache_bytes: int = 0) -> int:
    """Blocks a ``--blocks auto`` peer takes: half the model, fewer when the
    weights would not fit in half of ``mem_bytes`` next to ``cache_bytes`` of
    KV caches (at least one)."""
    half = max(1, num_layers // 2)
    budget = mem_bytes // 2 - cache_bytes
    if block_bytes <= 0 or mem_bytes <= 0:
        return half
    return max(1, min(half, budget // block_bytes))


def _best_move(others: list[float], holders: list[int], n: int, thr: float, current: SpanRange,
               tie: str) -> tuple[SpanRange, list[float], list[int]]:
    """The window of ``n`` blocks that gives the best layout when a peer of
    ``thr`` tokens/s serves it on top of ``others`` (per-block throughput and
    holder counts); the current one wins ties."""
    best: tuple[Any, ...] | None = None
    for s in range(len(others) - n + 1):
        v, c = list(others), list(holders)
        for i in range(s, s + n):
            v[i] += thr
            c[i] += 1
        k = (layout_score(v, c), (s, s + n) != current, _hash(tie, s))
        if best is None or k < best[0]:
            best = (k, (s, s + n), v, c)
    assert best is not None
    return best[1], best[2], best[3]


def _may_raise(others: list[float], n: int, thr: float, bar: float) -> bool:
    """Whether some window of ``n`` blocks with ``thr`` added on top of
    ``others`` has its least served block at ``bar`` or above (and ``bar > 0``):
    the necessary condition of a move for throughput."""
    if bar <= 0.0:
        return False
    L = len(others)
    for s in range(L - n + 1):
        inner = min(others[s : s + n]) + thr
        if inner < bar:
            continue
        if (s == 0 or min(others[:s]) >= bar) and (s + n >= L or min(others[s + n :]) >= bar):
            return True
    return False


def _reach(spans: Iterable[tuple[int, int]], L: int) -> tuple[set[int], set[int]]:
    """Block boundaries a chain of ``spans`` reaches from 0, and those from
    which it reaches ``L`` (a chain exists iff ``L`` is in the first)."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for lo, hi in spans:
        if 0 <= lo < hi <= L:
            starts.setdefault(lo, []).append(hi)
            ends.setdefault(hi, []).append(lo)
    out = []
    for origin, edges in ((0, starts), (L, ends)):
        seen, stack = {origin}, [origin]
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        out.append(seen)
    return out[0], out[1]


def _route_move(others: list[float], holders: list[int], n: int, cur: SpanRange, peer: str,
                reach: tuple[set[int], set[int]], frontier: int, need: tuple[Any, ...]) -> tuple[Any, SpanRange] | None:
    """Every block is held but no chain runs 0 -> L: the window of ``n``
    blocks for ``peer`` (its span taken away: ``others``, ``holders``,
    ``reach``) that joins a boundary reachable from 0 to one that reaches L
    without uncovering a block; else the one that pushes the boundary
    reachable from 0 (``frontier`` now) furthest. Best layout first, then
    the current span, then a hash."""
    fwd, back = reach
    L = len(others)
    best: tuple[Any, ...] | None = None
    for s in range(L - n + 1):
        if s not in fwd:
            continue
        c = list(holders)
        v = list(others)
        for i in range(s, s + n):
            c[i] += 1
            v[i] += 1.0
        if any(x <= 0 for x in c):
            continue
        joins = s + n in back
        if not joins and s + n <= frontier:
            continue
        k = (0 if joins else 1, 0 if joins else -(s + n), layout_score(v, c)[1], (s, s + n) != cur, _hash(peer, s))
        if best is None or k < best[0]:
            best = (k, (s, s + n))
    if best is None or best[1] == cur:
        return None
    return (best[0][:3], _hash(peer, need)), best[1]


class _Held:
    """The live holders' spans for one tick: the swarm's, less the excluded
    peers, with ours replaced (a read-only mapping, not a copy of 1,000 lists)."""

    def __init__(self, by_peer: dict[str, list[tuple[int, int, float]]], excluded: set[str], me: str,
                 mine: list[tuple[int, int, float]]) -> None:
        self.by_peer, self.excluded, self.me, self.mine = by_peer, excluded, me, mine

    def __getitem__(self, peer: str) -> list[tuple[int, int, float]]:
        return self.mine if peer == self.me else self.by_peer[peer]

    def peers(self) -> list[str]:
        out = [p for p in self.by_peer if p not in self.excluded and p != self.me]
        out.append(self.me)
        return out


# -- the state machine ----------------------------------------------------------

class ServingCore:
    """Sessions, admission, expiry, batching and span placement of one
    serving peer. See the module docstring; every method takes ``now``
    where time matters and does no I/O."""

    def __init__(
        self,
        self_id: str,
        limits: ServerLimits | None = None,
        *,
        max_length: int,
        max_tokens: int,
        num_layers: int = 0,
        policy: PlacementPolicy | None = None,
    ) -> None:
        self.id = self_id
        self.limits = limits or ServerLimits()
        self.max_length = max_length  # positions per session
        self.max_tokens = max_tokens  # positions per request
        self.num_layers = num_layers
        self.policy = policy
        self.spans: dict[SpanRange, _SpanSlot] = {}
        self.primary: SpanRange | None = None  # the span new sessions are steered to
        self.sessions: dict[SessionKey, Session] = {}
        # at most the oldest ``last_used`` of any session here: ``expire``
        # scans the table only once the timeout has passed since then
        self._oldest_use = math.inf
        self.cache_bytes = 0
        self.stats = ServerStats()
        self.span_changes = 0
        self.sessions_dropped = 0  # still open when their span was dropped
        self._pending: list[_Queued] = []
        self._seq = 0
        self.running = False  # a forward is computing
        #: tenant -> its share of the decayed usage (the peer's ledger, the
        #: same as batch shards'); None: queued steps go first come, first served
        self.share: Callable[[str], float] | None = None
        # placement
        self.loading: SpanRange | None = None
        self.load_s = 0.0  # how long our last span load took
        self.last_change = 0.0
        self.suspects: dict[str, int] = {}  # holder -> consecutive failed probes
        self._probing: set[str] = set()
        self._probe_cursor = ""
        self._need_since: dict[tuple[Any, ...], float] = {}
        self._next_tick = 0.0
        self.decisions: list[dict[str, Any]] = []  # the last moves decided (bounded), for /status and tests
        # energy (``span_level``): with a power model the core picks the clock
        # level its spans serve at, every ``level_every_s``
        self.power: PowerModel | None = None
        self.level_every_s = 2.0
        self.level = 1.0
        self.level_changes = 0
        self._work = 0.0  # decayed full-clock forward seconds (LEVEL_TAU_S)
        self._work_t = 0.0
        self._waited = False  # a step waited for a batch since the last level decision
        self._next_level = 0.0

    # -- spans ------------------------------------------------------------------
    def add_span(self, now: float, start: int, end: int, *, bytes_per_pos: int, throughput: float) -> None:
        """A span is loaded and serves from now on (the first one, or a switch)."""
        self.spans[(start, end)] = _SpanSlot(bytes_per_pos, throughput, now)
        self.primary = (start, end)
        self.last_change = now

    def accepts(self, span: SpanRange) -> bool:
        return span in self.spans

    def advertised(self) -> tuple[tuple[int, int, float], ...]:
        return tuple((a, b, s.throughput) for (a, b), s in sorted(self.spans.items()) if not s.draining)

    def span_sessions(self, span: SpanRange) -> int:
        return sum(1 for s in self.sessions.values() if s.span == span)

    # -- sessions -----------------------------------------------------------------
    def admit_forward(self, now: float, sender: str, sid: bytes, span: SpanRange, pos: int, tokens: int,
                      max_length: int) -> Admission | Refusal:
        """``forward``: find or create the session and check the positions; on
        success it is busy and rolled back to ``pos`` (``begin``)."""
        key = (sender, sid, span[0], span[1])
        s = self.sessions.get(key)
        created = False
        if s is None:
            if pos != 0:
                return Refusal("unknown-session", "no such session (expired?): replay from position 0")
            if max_length > self.max_length:
                return Refusal("too-large", f"max_length above {self.max_length}")
            if len(self.sessions) >= self.limits.max_sessions:
                return Refusal("full", f"{len(self.sessions)} sessions open")
            nbytes = max_length * self.spans[span].bytes_per_pos
            if self.cache_bytes + nbytes > self.limits.max_cache_bytes:
                return Refusal("full", "KV cache memory exhausted")
            s = Session(span, 0, max_length, nbytes, now)
            self.sessions[key] = s
            self._used(now)
            self.cache_bytes += nbytes
            self.stats.sessions_opened += 1
            created = True
        ref = self._check(s, pos, tokens)
        if ref is None:
            self.begin(now, [s], [pos])
        return Admission(key, s, created, ref)

    def check_step(self, sender: str, sid: bytes, span: SpanRange, pos: int) -> Session | Refusal:
        """One session of a ``step`` (one new position); nothing changes."""
        s = self.sessions.get((sender, sid, span[0], span[1]))
        if s is None:
            return Refusal("unknown-session", "no such session (expired?): replay from position 0")
        return self._check(s, pos, 1) or s

    @staticmethod
    def _check(s: Session, pos: int, tokens: int) -> Refusal | None:
        if s.busy:
            return Refusal("busy", "a step of this session is running")
        if pos > s.length:
            return Refusal("pos-mismatch", "server is behind", s.length)
        if pos + tokens > s.max_length:
            return Refusal("too-large", f"session length {s.max_length} exceeded")
        return None

    def begin(self, now: float, sessions: Sequence[Session], poss: Sequence[int]) -> None:
        """Sessions about to compute: rolled back to ``pos`` (a retried step) and busy."""
        for s, pos in zip(sessions, poss):
            s.length = min(s.length, pos)
            s.last_used = now
            s.busy = True
        self._used(now)

    def finish(self, now: float, sessions: Sequence[Session], tokens: Sequence[int], ok: bool) -> None:
        """Their forward is over: ``tokens`` positions each were appended (if ``ok``)."""
        for s, t in zip(sessions, tokens):
            s.busy = False
            s.last_used = now
            if ok:
                s.length += t
        self._used(now)

    def _used(self, now: float) -> None:
        """A session was stamped ``last_used = now``: keep ``_oldest_use``
        a lower bound (it only moves when the clock went back)."""
        if now < self._oldest_use:
            self._oldest_use = now

    def free(self, key: SessionKey) -> bool:
        s = self.sessions.pop(key, None)
        if s is None:
            return False
        s.closed = True
        self.cache_bytes -= s.nbytes
        return True

    def close(self, sender: str, sid: bytes) -> bool:
        """``close``: free the sender's session ``sid`` on every span here."""
        keys = [k for k in self.sessions if k[0] == sender and k[1] == sid]
        for k in keys:
            self.free(k)
        if keys:
            self.stats.sessions_closed += 1
        return bool(keys)

    def expire(self, now: float) -> int:
        """Drop sessions idle for longer than ``idle_timeout_s``; return how many.

        Called on every request: the table is scanned only when the oldest
        use of any session (a lower bound, ``_oldest_use``) is more than the
        timeout ago, so a peer with many open sessions does not walk them
        all for each step."""
        timeout = self.limits.idle_timeout_s
        if not now - timeout > self._oldest_use:
            return 0
        dead = [k for k, s in self.sessions.items() if not s.busy and now - s.last_used > timeout]
        for k in dead:
            self.free(k)
        self._oldest_use = min((s.last_used for s in self.sessions.values()), default=math.inf)
        self.stats.sessions_expired += len(dead)
        return len(dead)

    # -- batching -----------------------------------------------------------------
    def enqueue(self, item: Any, key: SessionKey, tokens: int, *, tenant: str = "", weight: float = 1.0) -> None:
        """A step waits for a forward (``item``: the runtime's handle) on
        behalf of ``tenant`` (its weight ``weight``)."""
        self._seq += 1
        self._pending.append(_Queued(item, key, tokens, tenant or key[0], weight, self._seq))

    def cancel(self, item: Any) -> None:
        """A queued step whose caller went away (no-op once it was taken)."""
        self._pending = [q for q in self._pending if q.item is not item]

    def take_batch(self) -> list[Any]:
        """The next forward: the queued steps with the first one's token count
        and span, up to ``max_batch`` sessions (and about ``max_tokens``
        positions). Empty while a forward runs; ``batch_done`` ends it."""
        if self.running or not self._pending:
            return []
        if self.share is not None and len(self._pending) > 1:
            # fair sessions: when more steps wait than one forward takes, the
            # tenants with the least usage over weight go first (a tenant over
            # its share waits; it is not refused), then arrival order
            share = self.share
            self._pending.sort(key=lambda q: (share(q.tenant) / q.weight, q.seq))
        first = self._pending[0]
        t, span = first.tokens, first.key[2:]
        batch: list[Any] = []
        rest = []
        for q in self._pending:
            if q.tokens == t and q.key[2:] == span and len(batch) < self.limits.max_batch and len(batch) * t < self.max_tokens:
                batch.append(q.item)
            else:
                rest.append(q)
        self._pending = rest
        if rest:
            self._waited = True
        self.running = True
        return batch

    def batch_done(self) -> None:
        self.running = False

    @property
    def queued(self) -> int:
        return len(self._pending)

    # -- energy -----------------------------------------------------------------
    def record_forward(self, now: float, work_s: float) -> None:
        """A forward that takes ``work_s`` seconds at full clock started at ``now``."""
        self._work = self._decayed(now) + max(work_s, 0.0)
        self._work_t = now

    def _decayed(self, now: float) -> float:
        dt = now - self._work_t
        return self._work * math.exp(-dt / LEVEL_TAU_S) if dt > 0 else self._work

    def demand(self, now: float) -> float:
        """Busy fraction the recent forwards need at full clock (decayed over ``LEVEL_TAU_S``)."""
        return self._decayed(now) / LEVEL_TAU_S

    def energy_state(self, now: float) -> dict[str, Any]:
        """What ``/status`` can show of the level choice."""
        return {"level": self.level, "demand": round(self.demand(now), 4), "level_changes": self.level_changes,
                "power_model": self.power is not None}

    def _choose_level(self, now: float) -> list[Any]:
        if self.power is None or now < self._next_level:
            return []
        self._next_level = now + self.level_every_s
        f = span_level(self.power, self.demand(now), saturated=self._waited or len(self._pending) > 0)
        self._waited = False
        if f == self.level:
            return []
        self.level = f
        self.level_changes += 1
        return [SetSpanLevel(f)]

    # -- placement ------------------------------------------------------------------
    def next_deadline(self) -> float:
        if self.power is not None and (self.policy is None or self._next_level < self._next_tick):
            return self._next_level
        return self._next_tick

    def poll(self, now: float, swarm: Sequence[SpanAd] = ()) -> list[Any]:
        """The timer: expire sessions, finish drains, and (with a policy, once
        per ``tick_s``) probe holders and re-plan against ``swarm``: the
        spans of this model in the view (other peers' and our own stale ones)."""
        self.expire(now)
        out: list[Any] = self._drains(now)
        out.extend(self._choose_level(now))
        pol = self.policy
        if pol is None or now < self._next_tick:
            return out
        self._next_tick = now + pol.tick_s
        sw = swarm if isinstance(swarm, SwarmSpans) else SwarmSpans(swarm)
        for p in [p for p in self.suspects if p not in sw.by_peer or p == self.id]:
            del self.suspects[p]  # left the view
        out.extend(self._probes(sw.peers))
        if self.loading is None:  # while an old span drains only a gap moves us again
            out.extend(self._plan(now, sw))
        return out

    def handle(self, now: float, inp: Any) -> list[Any]:
        if isinstance(inp, ProbeDone):
            self._probing.discard(inp.peer)
            if inp.ok:
                self.suspects.pop(inp.peer, None)
            else:
                self.suspects[inp.peer] = self.suspects.get(inp.peer, 0) + 1
            return []
        if isinstance(inp, SpanLoaded):
            return self._loaded(now, inp)
        if isinstance(inp, SpanLoadFailed):
            if self.loading == (inp.start, inp.end):
                self.loading = None
                self._note(now, "load-failed", (inp.start, inp.end), inp.error)
            return []
        raise TypeError(f"not an input: {type(inp).__name__}")

    def gone(self, peer: str) -> bool:
        pol = self.policy
        return pol is not None and self.suspects.get(peer, 0) >= pol.suspect_after

    def _probes(self, holders: Sequence[str]) -> list[Any]:
        """``holders``: sorted peer ids (ours skipped)."""
        pol = self.policy
        assert pol is not None
        # round robin: the holders after the last one probed, then from the start
        n = len(holders)
        i0 = bisect.bisect_right(holders, self._probe_cursor)
        out: list[Any] = []
        for j in range(n):
            if len(out) >= pol.max_probes:
                break
            p = holders[(i0 + j) % n]
            if p in self._probing or p == self.id:
                continue
            self._probing.add(p)
            self._probe_cursor = p
            out.append(Probe(p, pol.probe_timeout_s))
        return out

    def _drains(self, now: float) -> list[Any]:
        out: list[Any] = []
        for span, slot in list(self.spans.items()):
            if not slot.draining:
                continue
            left = [k for k, s in self.sessions.items() if s.span == span]
            busy = any(self.sessions[k].busy for k in left)
            if not left or (now >= slot.drain_until and not busy):
                for k in left:
                    self.free(k)
                self.sessions_dropped += len(left)
                del self.spans[span]
                out.append(DropSpan(*span))
        return out

    def _loaded(self, now: float, ev: SpanLoaded) -> list[Any]:
        new = (ev.start, ev.end)
        if self.loading != new:
            return [] if new in self.spans else [DropSpan(*new)]  # not asked for (any more)
        self.loading = None
        self.load_s = ev.load_s
        old = self.primary
        self.add_span(now, ev.start, ev.end, bytes_per_pos=ev.bytes_per_pos, throughput=ev.throughput)
        self.span_changes += 1
        if old is not None and old != new:
            slot = self.spans[old]
            slot.draining = True
            slot.drain_until = now + (self.policy.drain_s if self.policy else 0.0)
        return [Advertise(self.advertised()), *self._drains(now)]

    def _note(self, now: float, what: str, span: SpanRange, why: Any) -> None:
        self.decisions.append({"t": round(now, 3), "what": what, "span": list(span), "why": why})
        del self.decisions[:-16]

    def _plan(self, now: float, swarm: SwarmSpans) -> list[Any]:
        pol = self.policy
        assert pol is not None and self.primary is not None
        L = self.num_layers
        mine = self.primary
        my_thr = self.spans[mine].throughput
        # the swarm's totals, less our own stale entries and the holders we
        # found gone, plus our span as it is now
        out_peers = [p for p in self.suspects if self.gone(p) and p in swarm.by_peer]
        if self.id in swarm.by_peer:
            out_peers.append(self.id)
        thr0, cnt0 = swarm.totals(L)
        now_blocks, count = list(thr0), list(cnt0)
        for p in out_peers:
            _add(now_blocks, count, swarm.by_peer[p], -1)
        mine_spans = [(mine[0], mine[1], my_thr)]
        _add(now_blocks, count, mine_spans, 1)
        now_blocks = [max(x, 0.0) if c > 0 else 0.0 for x, c in zip(now_blocks, count)]
        excluded = set(out_peers)
        held = _Held(swarm.by_peer, excluded, self.id, mine_spans)
        uncovered = tuple(i for i, c in enumerate(count) if c == 0)
        # a chain needs spans whose boundaries meet: every block can be held
        # and still no chain run from block 0 to L (spans 0-4 and 3-5 and
        # 5-8 cover 0..7, but no span starts at 4)
        if not out_peers or out_peers == [self.id] and swarm.by_peer.get(self.id) == mine_spans:
            fwd, back = swarm.reach(L)
            if self.id not in swarm.by_peer:
                fwd, back = _reach([(lo, hi) for p in held.peers() for lo, hi, _ in held[p]], L)
        else:
            fwd, back = _reach([(lo, hi) for p in held.peers() for lo, hi, _ in held[p]], L)
        routable = L in fwd
        need: tuple[Any, ...] = ("gap", uncovered) if uncovered else ("thr",) if routable else ("route",)
        for k in [k for k in self._need_since if k != need]:
            del self._need_since[k]
        draining = any(sl.draining for sl in self.spans.values())

        def reach_without(peer: str) -> tuple[set[int], set[int]]:
            return _reach([(lo, hi) for p in held.peers() if p != peer for lo, hi, _ in held[p]], L)

        def move_of(peer: str) -> tuple[Any, SpanRange] | None:
            spans = held[peer]
            if len(spans) != 1:
                return None  # several spans: not one of ours (auto peers serve one)
            a, b, thr = spans[0]
            others, holders = list(now_blocks), list(count)
            for i in range(max(a, 0), min(b, L)):
                others[i] = max(others[i] - max(thr, 0.0), 0.0)
                holders[i] -= 1
            cur = (a, b)
            if need[0] == "route":
                return _route_move(others, holders, b - a, cur, peer, reach_without(peer), max(fwd), need)
            if not uncovered and not _may_raise(others, b - a, max(thr, 0.0), pol.min_gain * min(now_blocks)):
                return None  # no window could pass the throughput test below (the usual tick: skip the search)
            w, after, after_holders = _best_move(others, holders, b - a, max(thr, 0.0), cur, peer)
            if w == cur:
                return None
            before_u, after_u = len(uncovered), sum(1 for c in after_holders if c == 0)
            if after_u < before_u:
                pass  # covers a block nobody serves
            elif before_u == 0 and after_u == 0 and min(after) >= pol.min_gain * min(now_blocks) > 0.0:
                if peer == self.id and (now - self.last_change < pol.min_dwell_s or draining):
                    return None
                f1, b1 = reach_without(peer)
                if L not in f1 and not (w[0] in f1 and w[1] in b1):
                    return None  # more throughput, but no chain through the swarm any more
            else:
                return None
            return (layout_score(after, after_holders), _hash(peer, need)), w

        me = move_of(self.id)
        if me is None:
            return []
        since = self._need_since.setdefault(need, now)
        # the holders that would make a better move than ours, among the
        # first max_rank in an order every peer that sees this need shares
        rank = 0
        for p in sorted((p for p in held.peers() if p != self.id), key=lambda p: _hash(p, need))[: pol.max_rank]:
            m = move_of(p)
            if m is not None and m[0] < me[0]:
                rank += 1
        if now - since < rank * (pol.patience_s + 2 * self.load_s):
            return []
        w = me[1]
        self.loading = w
        self._note(now, "move", w, {"from": list(mine), "rank": rank,
                                     "need": list(need[1]) if uncovered else "throughput" if routable else "route"})
        return [LoadSpan(*w)]
