"""netsim for LLM serving: Petals-style sessions through spans of blocks, in virtual time.

A scenario with an ``[llm]`` table runs here instead of the batch
simulator (``netsim run`` dispatches). The same sans-IO cores as the daemon
decide everything:

* each serving peer is a ``fedswarm.core.spans.ServingCore``: the span it
  takes (``choose_span`` with ``--blocks auto`` sizes: ``auto_span_size``
  from the profile's device memory), admission, expiry, batches, fair
  ordering by the tenants' shares of one ``Ledger``, span moves
  (``PlacementPolicy``: probes, gaps, throughput, drains) and the clock level
  of its span (``span_level`` from the profile's power model);
* each tenant's client is a ``fedswarm.core.llm_route.RouteBook`` and one
  ``StepPlan`` per session step: route choice, bans, resyncs, detours and
  replays from an earlier boundary when a hop fails.

netsim performs their effects: a forward of ``b`` steps of ``t`` positions
through ``n`` blocks takes ``n * block_ms * (1 + batch_cost * (b*t - 1)) /
speed / level`` (``speed``: the profile's throughput, A100 = 1.0); requests
cross the scenario's links (``netsim.network``: the link's fixed latency plus
the hidden states' transfer time); a span load takes ``load_s_per_block`` per
block; a probe of a crashed peer fails after its timeout. Crashes come from
``[churn]``: a crashed peer answers nothing (requests to it fail after
``request_timeout_s``), its advertised spans stay in the view for
``state_ttl_s``.

Policies: ``fedswarm`` (spans keep placed, servers forward hidden states to
the next hop) and ``static`` (spans chosen once at start and never moved, the
client drives every hop). Deterministic: one ``random.Random(seed)``, one
heap ordered by (time, sequence), no clocks, no set iteration.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from fedswarm.core.energy import PowerModel
from fedswarm.core.ledger import Ledger
from fedswarm.core.llm_route import Chain, Done, GiveUp, Hop, HopOutput, HopState, NeedRoute, RouteBook, Send, StepPlan
from fedswarm.core.spans import (
    Admission,
    Advertise,
    DropSpan,
    LoadSpan,
    PlacementPolicy,
    Probe,
    ProbeDone,
    Refusal,
    ServerLimits,
    ServingCore,
    SetSpanLevel,
    SpanAd,
    SpanLoaded,
    SwarmSpans,
    auto_span_size,
    choose_span,
)
from fedswarm.profiles import Profile

from .stats import StepFn, jain, round_floats
from .workload import TraceError, check_dist, draw

__all__ = ["LLMConfig", "LLMTenant", "parse_llm", "LLMSim", "run_llm", "compare_llm", "print_llm_table",
           "LLM_POLICIES"]

GIB = 1 << 30
LLM_POLICIES = ("fedswarm", "fedswarm-race", "static")
ROUTE_RETRY_S = 0.5  # a client with no chain looks again this much later

(START, READY, POLL, PROBES, LOADED, ARRIVE, DONE, REPLY, SESSION, RETRY, CRASH, FORGET) = range(12)


class LLMError(ValueError):
    pass


@dataclass(frozen=True)
class LLMTenant:
    name: str
    sessions: int
    weight: float = 1.0
    start_s: float = 0.0
    rate_per_s: float = 0.0  # Poisson arrivals; 0: all at start_s
    prompt_tokens: Any = 128
    new_tokens: Any = 64


@dataclass(frozen=True)
class LLMConfig:
    """The ``[llm]`` table (see docs/netsim.md, "LLM serving")."""

    tenants: tuple[LLMTenant, ...]
    num_blocks: int = 32
    block_gb: float = 1.0  # weights of one block
    kv_kb_per_pos: float = 16.0  # KV cache of one position in one block
    hidden_size: int = 4096
    dtype_bytes: int = 2
    block_ms: float = 1.0  # one position through one block at batch 1 on the reference device
    batch_cost: float = 0.05  # each further position of a forward adds this fraction
    cache_gb: float = 2.0  # KV-cache memory reserved when sizing a span (auto_span_size)
    mem_reserve: float = 0.1  # of device memory kept free; the rest less the weights holds KV caches
    max_sessions: int = 64
    max_batch: int = 16
    max_chunk: int = 256
    idle_timeout_s: float = 300.0
    load_s_per_block: float = 2.0
    request_timeout_s: float = 5.0
    route_timeout_s: float = 120.0  # a session with no chain for this long fails
    ban_s: float = 60.0
    state_ttl_s: float = 30.0  # a crashed peer's spans stay in the view this long
    ledger_tau_s: float = 300.0
    energy: bool = True  # choose span clock levels (span_level); false: full clock
    fair: bool = True  # order queued steps by the tenants' shares (false: first come, first served)
    placement: dict[str, Any] = field(default_factory=dict)  # PlacementPolicy overrides


_LLM_KEYS = {f for f in LLMConfig.__dataclass_fields__} - {"placement"} | {"placement", "tenants"}
_TENANT_KEYS = {"name", "sessions", "weight", "start_s", "rate_per_s", "prompt_tokens", "new_tokens"}
_POLICY_KEYS = set(PlacementPolicy.__dataclass_fields__) - {"n_blocks"}


def parse_llm(raw: Any, src: str) -> LLMConfig:
    """Validate an ``[llm]`` table strictly (unknown keys, ranges)."""
    where = f"{src}: llm"
    if not isinstance(raw, dict):
        raise LLMError(f"{where}: must be a table")
    bad = sorted(set(raw) - _LLM_KEYS)
    if bad:
        raise LLMError(f"{where}: unknown key(s) {bad}; allowed: {sorted(_LLM_KEYS)}")
    kw: dict[str, Any] = {}
    for k, v in raw.items():
        if k in ("tenants", "placement"):
            continue
        default = LLMConfig.__dataclass_fields__[k].default
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise LLMError(f"{where}.{k}: true or false")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise LLMError(f"{where}.{k}: a finite number >= 0, got {v!r}")
        elif isinstance(default, int) and (not isinstance(v, int) or v < 1):
            raise LLMError(f"{where}.{k}: an integer >= 1, got {v!r}")
        kw[k] = v
    pl = raw.get("placement", {})
    if not isinstance(pl, dict) or sorted(set(pl) - _POLICY_KEYS):
        raise LLMError(f"{where}.placement: a table of {sorted(_POLICY_KEYS)}")
    kw["placement"] = dict(pl)
    ts = raw.get("tenants")
    if not isinstance(ts, list) or not ts:
        raise LLMError(f"{where}: needs at least one [[llm.tenants]] (name, sessions)")
    tenants, names = [], set()
    for i, t in enumerate(ts):
        w = f"{where}.tenants[{i}]"
        if not isinstance(t, dict) or sorted(set(t) - _TENANT_KEYS) or "name" not in t or "sessions" not in t:
            raise LLMError(f"{w}: a table with name, sessions and optionally {sorted(_TENANT_KEYS - {'name', 'sessions'})}")
        name = t["name"]
        if not isinstance(name, str) or not name or name in names:
            raise LLMError(f"{w}.name: a unique, non-empty name")
        names.add(name)
        if isinstance(t["sessions"], bool) or not isinstance(t["sessions"], int) or t["sessions"] < 0:
            raise LLMError(f"{w}.sessions: a non-negative integer")
        for k in ("weight", "start_s", "rate_per_s"):
            v = t.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (k == "weight" and k in t and v <= 0):
                raise LLMError(f"{w}.{k}: a number >= 0 (weight > 0)")
        try:
            for k in ("prompt_tokens", "new_tokens"):
                if k in t:
                    check_dist(t[k], f"{w}.{k}")
        except TraceError as exc:
            raise LLMError(str(exc)) from None
        tenants.append(LLMTenant(name, t["sessions"], float(t.get("weight", 1.0)), float(t.get("start_s", 0.0)),
                                 float(t.get("rate_per_s", 0.0)), t.get("prompt_tokens", 128), t.get("new_tokens", 64)))
    cfg = LLMConfig(tenants=tuple(tenants), **kw)
    if cfg.num_blocks < 1 or cfg.max_chunk < 1 or cfg.block_ms <= 0:
        raise LLMError(f"{where}: num_blocks, max_chunk >= 1 and block_ms > 0")
    PlacementPolicy(n_blocks=1, **cfg.placement)  # type-checks the overrides
    return cfg


# -- the simulation ---------------------------------------------------------------

class _Server:
    __slots__ = ("pid", "idx", "profile", "region", "speed", "power", "n", "core", "alive", "ready", "start_t",
                 "end_t", "queued", "running", "busy_s", "busy_j", "level_s")

    def __init__(self, pid: str, idx: int, profile: Profile, region: str) -> None:
        self.pid, self.idx, self.profile, self.region = pid, idx, profile, region
        self.speed = profile.speed("*")
        self.power: PowerModel = profile.power
        self.n = 0
        self.core: ServingCore | None = None
        self.alive = True
        self.ready = False
        self.start_t = 0.0
        self.end_t: float | None = None
        self.queued: dict[int, _Req] = {}  # admitted requests not answered yet
        self.running: list[_Req] = []
        self.busy_s = 0.0
        self.busy_j = 0.0
        self.level_s = 0.0  # busy seconds x level (for the mean level)


class _Req:
    __slots__ = ("id", "sess", "hs", "lo", "hi", "peer", "sent", "session")

    def __init__(self, rid: int, sess: "_Sess", hs: HopState, lo: int, hi: int, sent: float) -> None:
        self.id, self.sess, self.hs, self.lo, self.hi, self.sent = rid, sess, hs, lo, hi, sent
        self.peer = hs.hop.peer
        self.session: Any = None


class _Sess:
    __slots__ = ("i", "tenant", "client", "sid", "prompt", "new", "arrival", "chain", "plan", "length", "generated",
                 "hist", "req", "done_t", "failed", "recoveries", "resyncs", "wait_since", "steps", "decode_s",
                 "step_t")

    def __init__(self, i: int, tenant: "_Client", prompt: int, new: int, arrival: float, num_layers: int) -> None:
        self.i, self.tenant, self.client = i, tenant.name, tenant
        self.sid = f"{tenant.name}/{i}".encode()
        self.prompt, self.new, self.arrival = prompt, new, arrival
        self.chain = Chain(num_layers)
        self.plan: StepPlan | None = None
        self.length = 0
        self.generated = 0
        self.hist: dict[int, int] = {}  # boundary -> positions of its inputs the client holds
        self.req: _Req | None = None
        self.done_t: float | None = None
        self.failed = ""
        self.recoveries = 0
        self.resyncs = 0
        self.wait_since: float | None = None
        self.steps = 0
        self.decode_s = 0.0
        self.step_t = 0.0


class _Client:
    __slots__ = ("name", "id", "weight", "region", "book", "sessions", "token_t", "compute_s", "compute_t")

    def __init__(self, t: LLMTenant, region: str, ban_s: float) -> None:
        self.name, self.weight, self.region = t.name, t.weight, region
        self.id = f"client-{t.name}"
        self.book = RouteBook(ban_s=ban_s)
        self.sessions: list[_Sess] = []
        self.token_t: list[float] = []  # when each generated token reached the client
        self.compute_s = 0.0  # forward seconds charged to this tenant
        self.compute_t: list[tuple[float, float]] = []


class LLMSim:
    """One LLM-serving run: ``LLMSim(scenario, seed, policy).run()`` then ``results()``."""

    def __init__(self, sc: Any, seed: int, policy: str = "fedswarm") -> None:
        if policy not in LLM_POLICIES:
            raise ValueError(f"unknown LLM policy {policy!r}; one of {LLM_POLICIES}")
        cfg: LLMConfig = sc.llm
        ch = sc.churn
        if ch.leave_fraction or ch.join_count:
            raise LLMError(f"{sc.name}: an [llm] scenario models crashes only (no leave_fraction, join_count)")
        self.sc, self.cfg, self.seed, self.policy = sc, cfg, seed, policy
        self.moving = policy != "static"
        self.forwarding = policy != "static"
        self.energy = cfg.energy and policy != "fedswarm-race"
        self.L = cfg.num_blocks
        master = random.Random(seed)
        self.place_rng = random.Random(master.getrandbits(64))
        self.churn_rng = random.Random(master.getrandbits(64))
        self.work_rng = random.Random(master.getrandbits(64))
        self.net = replace(sc.network, seed=master.getrandbits(32))
        self._links: dict[tuple[str, str], float] = {}
        self._s_per_byte = 8.0 / (self.net.bandwidth_mbps * 1e6)
        self.recovered: dict[str, int] = {}  # hops replaced, by what the failed hop did
        self.q: list[tuple[Any, ...]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self.rid = 0
        self.ledger = Ledger(tau_s=cfg.ledger_tau_s)
        self.block_bytes = int(cfg.block_gb * GIB)
        self.kv_per_block = int(cfg.kv_kb_per_pos * 1024)
        # the view: peer -> its advertised spans; a crashed peer's stay until FORGET
        self.ads: dict[str, tuple[tuple[int, int, float], ...]] = {}
        self._swarm: SwarmSpans | None = None
        self._hops: list[Hop] | None = None
        self.capacity = StepFn(0.0, 0.0)  # live serving speed (reference devices)
        self.active = StepFn(0.0, 0.0)  # tenants with an open session
        self.open_by_tenant: dict[str, int] = {}
        self.stats = {"requests": 0, "refusals": 0, "timeouts": 0, "moved": 0, "route_waits": 0, "probes": 0,
                      "sessions_dropped": 0}
        self.refusals: dict[str, int] = {}
        # peers
        regions = sorted(sc.regions)
        rweights = [sc.regions[r] for r in regions]
        self.servers: dict[str, _Server] = {}
        order: list[_Server] = []
        for g in sc.swarm:
            prof = sc.profiles[g.profile]
            for _ in range(g.count):
                i = len(order)
                region = g.region or (prof.region if prof.region in sc.regions else "") or \
                    self.place_rng.choices(regions, weights=rweights)[0]
                s = _Server(f"p{i:05d}", i, prof, region)
                order.append(s)
                self.servers[s.pid] = s
        self.order = order
        for s in order:
            self._push(self.place_rng.uniform(0.0, sc.warmup_s / 2), START, s)
        n_crash = int(round(ch.crash_fraction * len(order)))
        for s in self.churn_rng.sample(order, n_crash):
            self._push(self.churn_rng.uniform(*ch.crash_window_s), CRASH, s)
        # tenants and their sessions
        self.clients: dict[str, _Client] = {}
        self.sessions: list[_Sess] = []
        for t in cfg.tenants:
            c = _Client(t, self.work_rng.choices(regions, weights=rweights)[0], cfg.ban_s)
            self.clients[t.name] = c
            at = sc.warmup_s + t.start_s
            for i in range(t.sessions):
                if t.rate_per_s > 0:
                    at += self.work_rng.expovariate(t.rate_per_s)
                prompt = max(1, int(round(draw(t.prompt_tokens, self.work_rng))))
                new = max(1, int(round(draw(t.new_tokens, self.work_rng))))
                sess = _Sess(i, c, prompt, new, at, self.L)
                c.sessions.append(sess)
                self.sessions.append(sess)
                self._push(at, SESSION, sess)
        self.max_length = max((s.prompt + s.new for s in self.sessions), default=1)
        self.open_sessions = len(self.sessions)

    # -- plumbing -------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, kind, a, b))

    def _lat(self, a: str, ra: str, b: str, rb: str, positions: int = 0) -> float:
        """One-way time of a message carrying ``positions`` hidden states: the
        link's latency (``NetworkModel.latency``, memoised per link) plus transfer."""
        key = (a, b) if a < b else (b, a)
        base = self._links.get(key)
        if base is None:
            base = self._links[key] = self.net.latency(a, b, ra, rb)
        nbytes = positions * self.cfg.hidden_size * self.cfg.dtype_bytes + 128
        return base + nbytes * self._s_per_byte

    def swarm(self) -> SwarmSpans:
        if self._swarm is None:
            self._swarm = SwarmSpans((SpanAd(p, a, b, thr) for p, spans in sorted(self.ads.items())
                                      for a, b, thr in spans), self.L)
        return self._swarm

    def hops(self) -> list[Hop]:
        if self._hops is None:
            self._hops = [Hop(a.peer, a.start, a.end, a.throughput) for a in self.swarm()]
        return self._hops

    def _advertise(self, pid: str, spans: tuple[tuple[int, int, float], ...]) -> None:
        if spans:
            self.ads[pid] = spans
        else:
            self.ads.pop(pid, None)
        self._swarm = self._hops = None

    def _throughput(self, s: _Server, n: int) -> float:
        """Tokens/s of one position through ``n`` blocks at batch 1, full clock (what the peer measures)."""
        return s.speed / (n * self.cfg.block_ms / 1000.0)

    # -- the loop -------------------------------------------------------------------
    def run(self) -> None:
        stop = self.sc.max_time_s
        q = self.q
        handlers = (self._start, self._ready, self._poll, self._probes, self._loaded, self._arrive, self._done,
                    self._reply, self._session, self._retry, self._crash, self._forget)
        while q and self.open_sessions > 0:
            t, _, kind, a, b = heapq.heappop(q)
            if t > stop:
                self.now = stop
                break
            self.now = t
            self.events += 1
            handlers[kind](a, b)

    # -- peers ----------------------------------------------------------------------
    def _start(self, s: _Server, _: Any) -> None:
        if not s.alive:
            return
        cfg = self.cfg
        mem = min((d.mem_total for d in s.profile.devices if d.kind != "cpu"),
                  default=min(d.mem_total for d in s.profile.devices))
        s.n = n = auto_span_size(self.L, self.block_bytes, mem, int(cfg.cache_gb * GIB))
        cache = max(int(cfg.cache_gb * GIB), int(mem * (1 - cfg.mem_reserve)) - n * self.block_bytes)
        ads = [(a.peer, a.start, a.end, a.throughput) for a in self.swarm()]
        a, b = choose_span(ads, self.L, n, self_id=s.pid)
        limits = ServerLimits(max_tokens_per_request=cfg.max_chunk, max_sessions=cfg.max_sessions,
                              max_session_length=self.max_length, max_cache_bytes=max(cache, 1),
                              max_batch=cfg.max_batch, idle_timeout_s=cfg.idle_timeout_s)
        policy = PlacementPolicy(n_blocks=n, **cfg.placement) if self.moving else None
        core = ServingCore(s.pid, limits, max_length=self.max_length, max_tokens=cfg.max_chunk, num_layers=self.L,
                           policy=policy)
        core.level_every_s = self.tick_s
        if self.energy:
            core.power = s.power
            core.level = s.power.allowed_levels()[-1]
        if cfg.fair:
            ledger, sim = self.ledger, self
            core.share = lambda tenant: ledger.shares(sim.now).get(tenant, 0.0)
        s.core = core
        s.start_t = self.now
        self._push(self.now + cfg.load_s_per_block * n, READY, s, (a, b))

    def _ready(self, s: _Server, span: tuple[int, int]) -> None:
        if not s.alive:
            return
        core = s.core
        assert core is not None
        a, b = span
        thr = self._throughput(s, b - a)
        core.add_span(self.now, a, b, bytes_per_pos=(b - a) * self.kv_per_block, throughput=thr)
        core.last_change = self.now
        s.ready = True
        self._advertise(s.pid, core.advertised())
        self.capacity.set(self.now, self.capacity.value + s.speed)
        self._push(self.now + self.tick_s, POLL, s)

    @property
    def tick_s(self) -> float:
        return float(self.cfg.placement.get("tick_s", PlacementPolicy.tick_s))

    def _poll(self, s: _Server, _: Any) -> None:
        if not s.alive:
            return
        core = s.core
        assert core is not None
        self._perform(s, core.poll(self.now, self.swarm()))
        self._push(self.now + self.tick_s, POLL, s)

    def _perform(self, s: _Server, effects: list[Any]) -> None:
        probes: list[tuple[str, bool]] = []
        timeout = 0.0
        for e in effects:
            if isinstance(e, Probe):
                t = self.servers.get(e.peer)
                probes.append((e.peer, t is not None and t.alive))
                timeout = max(timeout, e.timeout_s)
            elif isinstance(e, LoadSpan):
                self._push(self.now + self.cfg.load_s_per_block * (e.end - e.start), LOADED, s, (e.start, e.end))
            elif isinstance(e, Advertise):
                self._advertise(s.pid, e.spans)
            elif isinstance(e, DropSpan):
                pass  # the core freed the span's sessions; their queued steps fail at batch time
            elif isinstance(e, SetSpanLevel):
                pass  # core.level is read at each forward
        if probes:
            self.stats["probes"] += len(probes)
            # answers come back within the probe timeout (a dead peer's at it)
            self._push(self.now + timeout, PROBES, s, probes)

    def _probes(self, s: _Server, results: list[tuple[str, bool]]) -> None:
        if s.alive and s.core is not None:
            for peer, ok in results:
                s.core.handle(self.now, ProbeDone(peer, ok))

    def _loaded(self, s: _Server, span: tuple[int, int]) -> None:
        if not s.alive or s.core is None:
            return
        a, b = span
        ev = SpanLoaded(a, b, self._throughput(s, b - a), (b - a) * self.kv_per_block,
                        self.cfg.load_s_per_block * (b - a))
        self._perform(s, s.core.handle(self.now, ev))
        self._kick(s)

    def _crash(self, s: _Server, _: Any) -> None:
        if not s.alive:
            return
        s.alive = False
        s.end_t = self.now
        if s.ready:
            self.capacity.set(self.now, self.capacity.value - s.speed)
        # its callers notice at their request's timeout
        for r in sorted(list(s.queued.values()) + s.running, key=lambda r: r.id):
            self._push(max(self.now, r.sent + self.cfg.request_timeout_s), REPLY, r, ("timeout",))
        s.queued.clear()
        s.running = []
        self._push(self.now + self.cfg.state_ttl_s, FORGET, s)

    def _forget(self, s: _Server, _: Any) -> None:
        self._advertise(s.pid, ())

    # -- a request at a peer ----------------------------------------------------------
    def _arrive(self, r: _Req, _: Any) -> None:
        s = self.servers[r.peer]
        sess = r.sess
        if not s.alive or s.core is None or not s.ready:
            self._push(max(self.now, r.sent + self.cfg.request_timeout_s), REPLY, r, ("timeout",))
            return
        core = s.core
        self.stats["requests"] += 1
        span = (r.hs.hop.start, r.hs.hop.end)
        back = self._lat(s.pid, s.region, sess.client.id, sess.client.region)
        if not core.accepts(span):
            self._refused(r, "wrong-span", back)
            return
        adm = core.admit_forward(self.now, sess.client.id, sess.sid, span, r.lo, r.hi - r.lo, sess.prompt + sess.new)
        if isinstance(adm, Refusal) or (isinstance(adm, Admission) and adm.refusal is not None):
            ref = adm if isinstance(adm, Refusal) else adm.refusal
            assert ref is not None
            self._refused(r, ref.code, back, ref.length)
            return
        r.session = adm.session
        s.queued[r.id] = r
        core.enqueue(r, adm.key, r.hi - r.lo, tenant=sess.tenant, weight=sess.client.weight)
        self._kick(s)

    def _refused(self, r: _Req, code: str, back: float, length: int | None = None) -> None:
        self.stats["refusals"] += 1
        self.refusals[code] = self.refusals.get(code, 0) + 1
        self._push(self.now + back, REPLY, r, (code, length))

    def _kick(self, s: _Server) -> None:
        """Start the next forward if none runs."""
        core = s.core
        assert core is not None
        while not core.running and core.queued:
            batch: list[_Req] = core.take_batch()
            live = [r for r in batch if r.session is not None and not r.session.closed]
            for r in batch:
                if r not in live:  # its span was dropped (moved) or the session freed
                    s.queued.pop(r.id, None)
                    back = self._lat(s.pid, s.region, r.sess.client.id, r.sess.client.region)
                    self._refused(r, "wrong-span", back)
            if not live:
                core.batch_done()
                continue
            span = live[0].session.span
            positions = sum(r.hi - r.lo for r in live)
            work = (span[1] - span[0]) * self.cfg.block_ms / 1000.0 * (1 + self.cfg.batch_cost * (positions - 1))
            work /= s.speed
            core.record_forward(self.now, work)
            f = core.level if core.power is not None else 1.0
            took = work / f
            s.busy_s += took
            s.busy_j += s.power.power(f) * took
            s.level_s += f * took
            for r in live:
                s.queued.pop(r.id, None)
            s.running = live
            self._push(self.now + took, DONE, s, (live, took))

    def _done(self, s: _Server, arg: tuple[list[_Req], float]) -> None:
        if not s.alive:
            return  # the crash answered them (timeouts)
        live, took = arg
        core = s.core
        assert core is not None
        core.finish(self.now, [r.session for r in live], [r.hi - r.lo for r in live], True)
        core.batch_done()
        s.running = []
        for r in live:  # each row's part of the forward, to its tenant (as BlockServer charges)
            c = r.sess.client
            c.compute_s += took / len(live)
            c.compute_t.append((self.now, took / len(live)))
            self.ledger.add("swarm", c.name, took / len(live), self.now)
        for r in live:
            sess = r.sess
            if sess.req is not r:
                continue
            plan = sess.plan
            if self.forwarding and plan is not None and r.hs.hop.end < self.L and r.hi == plan.upto:
                # the route travels with the request: this peer hands its
                # outputs straight to the next hop (the answer will carry
                # each hop's time, which the client's RouteBook learns)
                if r.hi - r.lo == 1:
                    sess.client.book.observe(r.peer, self.now - r.sent)
                self._apply(sess, r, ("ok",))
                self._drive(sess, src=s)
            else:
                back = self._lat(s.pid, s.region, sess.client.id, sess.client.region, r.hi - r.lo)
                self._push(self.now + back, REPLY, r, ("ok",))
        self._kick(s)

    # -- the client side ----------------------------------------------------------------
    def _session(self, sess: _Sess, _: Any) -> None:
        t = sess.tenant
        self.open_by_tenant[t] = self.open_by_tenant.get(t, 0) + 1
        if self.open_by_tenant[t] == 1:
            self.active.set(self.now, self.active.value + 1)
        self._next_step(sess)
        self._drive(sess)

    def _next_step(self, sess: _Sess) -> None:
        n = sess.length
        t = sess.prompt if n == 0 else 1
        sess.hist[0] = n + t
        sess.plan = StepPlan(sess.chain, sess.client.book, self.hops, n, n + t, max_chunk=self.cfg.max_chunk)
        sess.step_t = self.now

    def _retry(self, sess: _Sess, _: Any) -> None:
        if sess.done_t is None and not sess.failed:
            self._drive(sess)

    def _reply(self, r: _Req, res: tuple[Any, ...]) -> None:
        sess = r.sess
        if sess.req is not r or sess.done_t is not None or sess.failed:
            return
        if res[0] == "ok" and r.hi - r.lo == 1:
            sess.client.book.observe(r.peer, self.now - r.sent)
        if self._apply(sess, r, res):
            self._drive(sess)

    def _apply(self, sess: _Sess, r: _Req, res: tuple[Any, ...]) -> bool:
        """Tell the step's plan how the request went; False if the session failed."""
        plan = sess.plan
        assert plan is not None
        sess.req = None
        code = res[0]
        try:
            if code == "ok":
                plan.sent(r.hs, r.hi - r.lo)
            elif code == "pos-mismatch" and res[1] is not None:
                sess.resyncs += 1
                plan.resync(r.hs, res[1], sess.hist.get(r.hs.hop.end, 0), self.now)
            elif code == "unknown-session":
                sess.resyncs += 1
                plan.resync(r.hs, 0, sess.hist.get(r.hs.hop.end, 0), self.now)
            else:
                if code == "timeout":
                    self.stats["timeouts"] += 1
                elif code == "wrong-span":
                    self.stats["moved"] += 1
                before = len(plan.recoveries)
                plan.failed(r.hs, code, self.now, moved=code == "wrong-span")
                k = len(plan.recoveries) - before
                sess.recoveries += k
                self.recovered[code] = self.recovered.get(code, 0) + k
        except GiveUp as exc:
            self._fail(sess, str(exc))
            return False
        return True

    def _drive(self, sess: _Sess, src: _Server | None = None) -> None:
        """Perform the plan's actions until it waits on the network."""
        c = sess.client
        while True:
            plan = sess.plan
            assert plan is not None
            try:
                act = plan.next()
            except GiveUp as exc:
                self._fail(sess, str(exc))
                return
            if isinstance(act, Done):
                if not self._step_done(sess):
                    return
                src = None
                continue
            if isinstance(act, NeedRoute):
                route = c.book.route(self.hops(), act.start, self.L, self.now)
                if route is None:
                    if sess.wait_since is None:
                        sess.wait_since = self.now
                        self.stats["route_waits"] += 1
                    if self.now - sess.wait_since > self.cfg.route_timeout_s:
                        self._fail(sess, f"no chain from block {act.start} for {self.cfg.route_timeout_s:g}s")
                        return
                    self._push(self.now + ROUTE_RETRY_S, RETRY, sess)
                    return
                sess.wait_since = None
                sess.chain.set_tail(act.start, route)
                continue
            if isinstance(act, HopOutput):
                sess.hist[act.hop.hop.end] = plan.upto
                plan.accept(act.hop)
                continue
            assert isinstance(act, Send)
            hs = act.hop
            peer = self.servers[hs.hop.peer]
            k = act.hi - act.lo
            if src is not None and src.pid != peer.pid and hs.hop.start > 0:
                delay = self._lat(src.pid, src.region, peer.pid, peer.region, k)
            elif src is not None:
                delay = self._lat(src.pid, src.region, c.id, c.region, k) + \
                    self._lat(c.id, c.region, peer.pid, peer.region, k)
            else:
                delay = self._lat(c.id, c.region, peer.pid, peer.region, k)
            self.rid += 1
            r = _Req(self.rid, sess, hs, act.lo, act.hi, self.now)
            sess.req = r
            self._push(self.now + delay, ARRIVE, r)
            return

    def _step_done(self, sess: _Sess) -> bool:
        """A step went through every block; start the next or finish. False when finished."""
        plan = sess.plan
        assert plan is not None
        first = sess.length == 0
        sess.length = plan.upto
        if not first:
            sess.generated += 1
            sess.steps += 1
            sess.decode_s += self.now - sess.step_t
            sess.client.token_t.append(self.now)
        if first:  # the prefill's last position's output is the first new token
            sess.generated += 1
            sess.client.token_t.append(self.now)
        if sess.generated >= sess.new:
            self._finish(sess)
            return False
        self._next_step(sess)
        return True

    def _close_all(self, sess: _Sess) -> None:
        for hs in sess.chain.hops + sess.chain.take_stale():
            s = self.servers.get(hs.hop.peer)
            if s is not None and s.alive and s.core is not None:
                s.core.close(sess.client.id, sess.sid)
        sess.chain.hops = []

    def _finish(self, sess: _Sess) -> None:
        sess.done_t = self.now
        self._close_all(sess)
        self._closed(sess)

    def _fail(self, sess: _Sess, why: str) -> None:
        sess.failed = why or "failed"
        self._close_all(sess)
        self._closed(sess)

    def _closed(self, sess: _Sess) -> None:
        self.open_sessions -= 1
        t = sess.tenant
        self.open_by_tenant[t] -= 1
        if self.open_by_tenant[t] == 0:
            self.active.set(self.now, self.active.value - 1)

    # -- results ----------------------------------------------------------------------
    def results(self) -> dict[str, Any]:
        cfg = self.cfg
        end = self.now
        done = [s for s in self.sessions if s.done_t is not None]
        failed = [s for s in self.sessions if s.failed]
        unfinished = len(self.sessions) - len(done) - len(failed)
        max_speed = max((s.speed for s in self.order), default=1.0)
        # rho: a session alone on a 1/N share of the swarm's serving capacity,
        # never faster than its own steps through the fastest device plus one
        # round trip on a typical link of the client's region per step
        per_pos = self.L * cfg.block_ms / 1000.0
        rtt = 2 * math.sqrt(self.net.intra_ms[0] * self.net.intra_ms[1]) / 1000.0
        batched = (1 + cfg.batch_cost * (cfg.max_batch - 1)) / cfg.max_batch
        rhos: dict[str, list[float]] = {t.name: [] for t in cfg.tenants}
        for s in done:
            chunks = [min(cfg.max_chunk, s.prompt - i) for i in range(0, s.prompt, cfg.max_chunk)]
            t_lat = (sum(per_pos * (1 + cfg.batch_cost * (k - 1)) for k in chunks) + per_pos * (s.new - 1)) / max_speed \
                + rtt * (len(chunks) + s.new - 1)
            work = per_pos * (s.prompt + s.new - 1) * batched
            assert s.done_t is not None
            cap = self.capacity.mean(s.arrival, s.done_t)
            n = max(self.active.mean(s.arrival, s.done_t), 1.0)
            t_share = work / max(cap / n, 1e-9)
            rhos[s.tenant].append((s.done_t - s.arrival) / max(t_lat, t_share, 1e-9))
        # the window where every tenant had sessions: its tokens/s per tenant
        firsts = [min((s.arrival for s in c.sessions), default=0.0) for c in self.clients.values()]
        lasts = [max((s.done_t or end for s in c.sessions), default=0.0) for c in self.clients.values()]
        w0, w1 = max(firsts, default=0.0), min(lasts, default=0.0)
        w_compute = sum(x for c in self.clients.values() for t, x in c.compute_t if w0 <= t <= w1)
        tenants: dict[str, Any] = {}
        for c in self.clients.values():
            toks = len(c.token_t)
            t0 = min((s.arrival for s in c.sessions), default=0.0)
            t1 = max((s.done_t or end for s in c.sessions), default=t0)
            in_w = sum(1 for x in c.token_t if w0 <= x <= w1) if w1 > w0 else 0
            steps = sum(s.steps for s in c.sessions)
            rs = rhos[c.name]
            tenants[c.name] = {
                "weight": c.weight,
                "region": c.region,
                "sessions": len(c.sessions),
                "sessions_completed": sum(1 for s in c.sessions if s.done_t is not None),
                "tokens": toks,
                "tokens_per_s": toks / (t1 - t0) if t1 > t0 else 0.0,
                "tokens_per_s_shared": in_w / (w1 - w0) if w1 > w0 else None,
                "compute_s": c.compute_s,
                "compute_share_shared": (sum(x for t, x in c.compute_t if w0 <= t <= w1) / w_compute
                                         if w_compute > 0 else None),
                "rho": sum(rs) / len(rs) if rs else None,
                "max_rho": max(rs) if rs else None,
                "mean_session_s": (sum(s.done_t - s.arrival for s in c.sessions if s.done_t is not None)
                                   / max(sum(1 for s in c.sessions if s.done_t is not None), 1)),
                "s_per_token": sum(s.decode_s for s in c.sessions) / steps if steps else None,
                "recoveries": sum(s.recoveries for s in c.sessions),
            }
        shared = [tenants[c]["tokens_per_s_shared"] / self.clients[c].weight for c in tenants
                  if tenants[c]["tokens_per_s_shared"] is not None]
        busy_j = idle_j = 0.0
        busy_s = level_s = 0.0
        span_changes = level_changes = 0
        by_profile: dict[str, dict[str, Any]] = {}
        for sv in self.order:
            if sv.core is None:
                continue
            life = (sv.end_t if sv.end_t is not None else end) - sv.start_t
            busy_j += sv.busy_j
            idle_j += sv.power.idle_w * max(life - sv.busy_s, 0.0)
            busy_s += sv.busy_s
            level_s += sv.level_s
            span_changes += sv.core.span_changes
            level_changes += sv.core.level_changes
            pe = by_profile.setdefault(sv.profile.name, {"peers": 0, "blocks": sv.n, "busy_s": 0.0, "span_changes": 0})
            pe["peers"] += 1
            pe["busy_s"] += sv.busy_s
            pe["span_changes"] += sv.core.span_changes
        holders = [0] * self.L
        for pid, spans in self.ads.items():
            if self.servers[pid].alive:
                for a, b, _ in spans:
                    for i in range(a, b):
                        holders[i] += 1
        all_rho = [x for rs in rhos.values() for x in rs]
        llm = {
            "policy": self.policy,
            "sessions": len(self.sessions),
            "sessions_completed": len(done),
            "sessions_failed": len(failed),
            "sessions_unfinished": unfinished,
            "failures": sorted({s.failed for s in failed})[:5],
            "tokens": sum(len(c.token_t) for c in self.clients.values()),
            "prefill_tokens": sum(s.prompt for s in self.sessions if s.length > 0),
            "span_changes": span_changes,
            "recoveries": sum(s.recoveries for s in self.sessions),
            "recoveries_by_reason": dict(sorted(self.recovered.items())),
            "resyncs": sum(s.resyncs for s in self.sessions),
            "tenants": tenants,
            "jain_tokens_per_weight": jain(shared) if shared else None,
            "mean_rho": sum(all_rho) / len(all_rho) if all_rho else None,
            "max_rho": max(all_rho) if all_rho else None,
            "makespan_s": max((s.done_t or 0.0 for s in done), default=0.0) - min((s.arrival for s in self.sessions),
                                                                                    default=0.0),
            "energy_j": busy_j + idle_j,
            "energy_busy_j": busy_j,
            "energy_idle_j": idle_j,
            "idle_floor_w": sum(s.power.idle_w for s in self.order if s.alive and s.core is not None),
            "busy_level": level_s / busy_s if busy_s > 0 else None,
            "level_changes": level_changes,
            "blocks_min_holders_at_end": min(holders) if holders else 0,
            "profiles": dict(sorted(by_profile.items())),
            "counts": {**self.stats, "refusals_by_code": dict(sorted(self.refusals.items()))},
        }
        crashed = sum(1 for s in self.order if not s.alive)
        return {
            "scenario": self.sc.name,
            "seed": self.seed,
            "kind": "llm",
            "llm": llm,
            "peers": {"initial": len(self.order), "crashed": crashed, "live_at_end": len(self.order) - crashed},
            "summary": {"sim_time_s": end, "events": self.events},
        }


def run_llm(sc: Any, seed: int, policy: str = "fedswarm") -> dict[str, Any]:
    sim = LLMSim(sc, seed, policy)
    sim.run()
    return sim.results()


def compare_llm(sc: Any, seed: int, progress: Any = None) -> dict[str, Any]:
    """fedswarm (spans kept placed, server-to-server forwarding, span clock
    levels), fedswarm-race (the same at full clock) and static spans (chosen
    once at start, never moved) with client-driven hops. ``energy_horizon_j``:
    a run's energy plus its peers' idle floor until the longest run's end."""
    out: dict[str, Any] = {"scenario": sc.name, "seed": seed, "peers": sc.n_peers, "kind": "llm", "policies": {}}
    for pol in LLM_POLICIES:
        task = progress.task(pol) if hasattr(progress, "task") else None
        res = run_llm(sc, seed, pol)
        if task is not None:
            task.update(sim_t=res["summary"]["sim_time_s"], events=res["summary"]["events"])
            task.finish()
        out["policies"]["static-spans" if pol == "static" else pol] = {"llm": res["llm"], "summary": res["summary"]}
    horizon = max(p["summary"]["sim_time_s"] for p in out["policies"].values())
    for p in out["policies"].values():
        x = p["llm"]
        x["energy_horizon_j"] = x["energy_j"] + x["idle_floor_w"] * (horizon - p["summary"]["sim_time_s"])
    return out


LLM_ROWS = (
    ("sessions", lambda x: f"{x['sessions_completed']}/{x['sessions']}"),
    ("failed", lambda x: x["sessions_failed"]),
    ("tokens", lambda x: x["tokens"]),
    ("makespan_s", lambda x: x["makespan_s"]),
    ("mean_rho", lambda x: x["mean_rho"]),
    ("max_rho", lambda x: x["max_rho"]),
    ("span_changes", lambda x: x["span_changes"]),
    ("recoveries", lambda x: x["recoveries"]),
    ("energy_MJ", lambda x: x["energy_j"] / 1e6),
    ("busy_MJ", lambda x: x["energy_busy_j"] / 1e6),
    ("horizon_MJ", lambda x: x["energy_horizon_j"] / 1e6 if "energy_horizon_j" in x else None),
    ("busy_level", lambda x: x["busy_level"]),
)


def print_llm_table(res: dict[str, Any], out: Any = None) -> None:
    """One column per run (a ``compare_llm`` result, or one ``netsim run`` result)."""
    import sys

    from .compare import _f

    out = out if out is not None else sys.stdout
    runs = res["policies"] if "policies" in res else {res["llm"]["policy"]: res}
    names = list(runs)
    w = max(14, *(len(n) + 2 for n in names))
    print(f"{'metric':<14}" + "".join(f"{n:>{w}}" for n in names), file=out)
    for name, fn in LLM_ROWS:
        print(f"{name:<14}" + "".join(f"{_f(fn(runs[n]['llm'])):>{w}}" for n in names), file=out)
    tenants = list(runs[names[0]]["llm"]["tenants"])
    for t in tenants:
        print(f"{t + ' tok/s':<14}" + "".join(
            f"{_f(runs[n]['llm']['tenants'][t]['tokens_per_s']):>{w}}" for n in names), file=out)
        print(f"{t + ' rho':<14}" + "".join(
            f"{_f(runs[n]['llm']['tenants'][t]['rho']):>{w}}" for n in names), file=out)


def dumps(res: dict[str, Any]) -> str:
    import json

    return json.dumps(round_floats(res), sort_keys=True, indent=1, allow_nan=False) + "\n"


def llm_run_main(args: Any, sc: Any, t0: float) -> int:
    """``netsim run`` of a scenario with ``[llm]``: the results JSON (an ``llm``
    object), the table to stdout; exit 1 if a session failed or did not finish."""
    import sys
    import time
    from pathlib import Path

    if getattr(args, "plot", None) is not None:
        print("netsim: note: --plot draws batch figures; an [llm] scenario has none", file=sys.stderr)
    sim = LLMSim(sc, args.seed, "fedswarm")
    sim.run()
    res = sim.results()
    if args.out:
        Path(args.out).write_text(dumps(res))
    print_llm_table(res)
    wall = time.perf_counter() - t0
    print(f"netsim: {sc.name} seed={args.seed} peers={sc.n_peers} llm sim={sim.now:.1f}s events={sim.events} "
          f"wall={wall:.2f}s ({sim.events / max(wall, 1e-9):.0f} events/s)", file=sys.stderr)
    x = res["llm"]
    return 1 if x["sessions_failed"] or x["sessions_unfinished"] else 0


def llm_compare_main(args: Any, sc: Any, t0: float) -> int:
    """``netsim compare`` of an ``[llm]`` scenario: fedswarm and static spans (``--policies`` is not used)."""
    import sys
    import time
    from pathlib import Path

    cmp = compare_llm(sc, args.seed)
    if args.out:
        Path(args.out).write_text(dumps(cmp))
    print(f"# {sc.name} seed={args.seed} peers={sc.n_peers}")
    print_llm_table(cmp)
    if not args.quiet:
        print(f"netsim: llm compare wall={time.perf_counter() - t0:.1f}s", file=sys.stderr)
    bad = sum(p["llm"]["sessions_failed"] + p["llm"]["sessions_unfinished"] for p in cmp["policies"].values())
    return 1 if bad else 0
