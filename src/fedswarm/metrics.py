"""The daemon's HTTP face: a live dashboard, JSON status, Prometheus metrics.

``serve_http(port, agent, host=..., llm=...)`` serves a Starlette app on
hypercorn's trio worker (``fedswarm.http.serve_asgi``):

* ``GET /`` the dashboard (``fedswarm/dashboard/static``, shipped in the
  package, nothing from a CDN), which subscribes to ``/events``;
* ``GET /status`` JSON: what the daemon sees (peers with capacity, power,
  spans; its leases; tenants' shares and their history; block coverage per
  served model; LLM sessions; bootstrap state). The row of the peer itself
  carries ``"self": true``. No key material is ever included;
* ``GET /events`` server-sent events: the status JSON whenever the view or
  the leases change, and at least every second;
* ``GET /metrics`` Prometheus text, from a collector that reads the live core
  at scrape time, plus histograms fed by the agent's and block server's
  observers;
* ``GET /healthz`` ``ok`` for probes; anything else is 404.

It is read-only: no route changes the daemon.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections import deque
from typing import Any, Iterator

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .core.peer import LeaseState, PeerCore
from .runtime.agent import Agent

__all__ = ["Telemetry", "PeerCollector", "status_json", "make_app", "serve_http", "TOP_TENANTS", "OTHER"]

#: tenants labelled by name in /metrics; the rest fold into ``OTHER``
TOP_TENANTS = 10
OTHER = "other"
#: samples of shares / rho kept for the dashboard's sparklines
HISTORY_LEN = 180
HISTORY_EVERY_S = 2.0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fedswarm")
    except Exception:  # not installed (a source checkout on sys.path)
        return "0+unknown"


def _level(power: Any) -> float:
    """Clock level implied by the power now, inverting the power curve
    ``idle + (max - idle) * f ** alpha`` (1.0 at or above max)."""
    span = power.max_w - power.idle_w
    if span <= 0:
        return 1.0
    x = min(max((power.now_w - power.idle_w) / span, 0.0), 1.0)
    return round(x ** (1.0 / power.alpha), 3) if x > 0 else 0.0


def fold_tenants(values: dict[str, float], shares: dict[str, float], top: int = TOP_TENANTS) -> dict[str, float]:
    """``values`` per tenant with all but the ``top`` tenants by share (then
    by value, then name) summed into ``OTHER``: bounded label cardinality."""
    ranked = sorted(values, key=lambda t: (-shares.get(t, 0.0), -values[t], t))
    out = {t: values[t] for t in ranked[:top]}
    rest = ranked[top:]
    if rest:
        out[OTHER] = out.get(OTHER, 0.0) + sum(values[t] for t in rest)
    return out


class Telemetry:
    """What happens over time on one daemon, beyond the core's counters:
    histograms, energy per tenant, and a short history of shares and rho."""

    def __init__(self, agent: Agent, llm: Any = None, registry: CollectorRegistry | None = None) -> None:
        self.agent = agent
        self.llm = llm
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.bid_latency = Histogram("fedswarm_bid_latency_seconds", "A call for bids in to its bid out",
                                     buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0), registry=r)
        self.shard_run = Histogram("fedswarm_shard_run_seconds", "Run time of shards executed here",
                                   buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800), registry=r)
        self.hop_latency = Histogram("fedswarm_llm_hop_latency_seconds",
                                     "One forward request through this peer's span, queueing included",
                                     buckets=(1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.token_latency = Histogram("fedswarm_llm_token_latency_seconds",
                                       "A forward request's time per token it carried",
                                       buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1), registry=r)
        self.batch_size = Histogram("fedswarm_llm_batch_size", "Sessions batched into the forward of a request",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.energy_j: dict[str, float] = {}
        self.energy_total_j = 0.0
        self.history: deque[tuple[float, dict[str, float], dict[str, float]]] = deque(maxlen=HISTORY_LEN)
        self.started = time.time()
        agent.observers.append(self._on_agent)
        if llm is not None and hasattr(llm, "observers"):
            llm.observers.append(self._on_forward)

    def _on_agent(self, name: str, f: dict[str, Any]) -> None:
        if name == "bid":
            self.bid_latency.observe(f["latency_s"])
        elif name == "shard":
            if f["run_s"] > 0:
                self.shard_run.observe(f["run_s"])
            e = max(float(f.get("energy_j") or 0.0), 0.0)
            self.energy_j[f["tenant"]] = self.energy_j.get(f["tenant"], 0.0) + e
            self.energy_total_j += e

    def _on_forward(self, tokens: int, seconds: float, batch: int) -> None:
        self.hop_latency.observe(seconds)
        self.token_latency.observe(seconds / max(tokens, 1))
        if batch:
            self.batch_size.observe(batch)

    def sample(self) -> None:
        """Record shares and rho now (for the sparklines)."""
        now = self.agent.now()
        core = self.agent.core
        assert isinstance(core, PeerCore), "telemetry is a serving peer's"
        rho = {t: r for t, r in tenant_rho(core, now).items()}
        shares = {t: round(v, 4) for t, v in core.ledger.shares(now).items()}
        self.history.append((round(now, 1), shares, rho))


def tenant_rho(core: PeerCore, now: float) -> dict[str, float]:
    """Each tenant's worst estimated finish-time fairness among the shards
    it has here (``PeerCore.rho_by_tenant``)."""
    return core.rho_by_tenant(now)


class PeerCollector(Collector):
    def __init__(self, agent: Agent, telemetry: Telemetry | None = None, llm: Any = None) -> None:
        self.agent = agent
        self.telemetry = telemetry
        self.llm = llm

    def collect(self) -> Iterator[Any]:
        core = self.agent.core
        assert isinstance(core, PeerCore)
        now = self.agent.now()
        st = self.agent.stats
        shares = core.ledger.shares(now)
        g = GaugeMetricFamily("fedswarm_build_info", "fedswarm build", labels=["version", "python"])
        g.add_metric([_version(), platform.python_version()], 1)
        yield g
        g = GaugeMetricFamily("fedswarm_peers_known", "Live peers in this peer's view")
        g.add_metric([], len(core.view.live(now)))
        yield g
        c = CounterMetricFamily("fedswarm_bids", "Bids sent")
        c.add_metric([], core.stats["bids_sent"])
        yield c
        c = CounterMetricFamily("fedswarm_shards", "Shards by outcome", labels=["outcome"])
        for label, key in (("won", "shards_won"), ("run", "shards_run"), ("failed", "shards_failed"),
                           ("abandoned", "leases_abandoned"), ("cancelled", "shards_cancelled")):
            c.add_metric([label], core.stats[key])
        yield c
        c = CounterMetricFamily("fedswarm_bytes", "Bytes through the transport", labels=["direction"])
        c.add_metric(["in"], st.bytes_in)
        c.add_metric(["out"], st.bytes_out)
        yield c
        c = CounterMetricFamily("fedswarm_messages", "Messages through the transport", labels=["direction"])
        c.add_metric(["in"], st.msgs_in)
        c.add_metric(["out"], st.msgs_out)
        yield c
        c = CounterMetricFamily("fedswarm_rejected", "Inputs rejected by reason", labels=["reason"])
        for reason, n in sorted(core.rejected.items()):
            c.add_metric([reason], n)
        yield c
        g = GaugeMetricFamily("fedswarm_power_watts", "Power draw now (measured or modelled)")
        g.add_metric([], core.now_w)
        yield g
        g = GaugeMetricFamily("fedswarm_power_cap_watts", "Power cap (0: none)")
        g.add_metric([], core.config.power.cap_w)
        yield g
        running = [lease.level for lease in core.leases.values() if lease.state == LeaseState.RUNNING]
        g = GaugeMetricFamily("fedswarm_clock_level_ratio", "Highest clock level a running shard asks for (0: idle)")
        g.add_metric([], max(running, default=0.0))
        yield g
        g = GaugeMetricFamily("fedswarm_slots_busy_ratio", "Share of this peer's slots running shards")
        g.add_metric([], min(core.busy_slots / max(core.config.slots, 1), 1.0))
        yield g
        g = GaugeMetricFamily("fedswarm_backlog_seconds", "Queued and running work per slot")
        g.add_metric([], core.backlog_s)
        yield g
        g = GaugeMetricFamily("fedswarm_tenant_share_ratio", "Tenant's share of decayed swarm usage "
                              f"(top {TOP_TENANTS} tenants, the rest as '{OTHER}')", labels=["tenant"])
        for tenant, share in sorted(fold_tenants(shares, shares).items()):
            g.add_metric([tenant], share)
        yield g
        tel = self.telemetry
        if tel is not None:
            c = CounterMetricFamily("fedswarm_energy_joules", "Energy of the shards run here, by tenant "
                                    f"(top {TOP_TENANTS} tenants, the rest as '{OTHER}')", labels=["tenant"])
            for tenant, j in sorted(fold_tenants(tel.energy_j, shares).items()):
                c.add_metric([tenant], j)
            if not tel.energy_j:
                c.add_metric([OTHER], 0.0)
            yield c
        llm = self.llm
        if llm is not None:
            s = llm.stats
            g = GaugeMetricFamily("fedswarm_llm_sessions", "Open inference sessions on this peer's span")
            g.add_metric([], len(llm.sessions))
            yield g
            c = CounterMetricFamily("fedswarm_llm_tokens", "Token positions computed through this peer's span")
            c.add_metric([], s.tokens)
            yield c
            c = CounterMetricFamily("fedswarm_llm_forwards", "Batched forwards through this peer's span")
            c.add_metric([], s.forwards)
            yield c
            c = CounterMetricFamily("fedswarm_llm_requests", "LLM protocol requests answered")
            c.add_metric([], s.requests)
            yield c
            c = CounterMetricFamily("fedswarm_llm_errors", "LLM protocol error answers by code", labels=["code"])
            for code, n in sorted(s.by_error.items()):
                c.add_metric([code], n)
            yield c
            g = GaugeMetricFamily("fedswarm_llm_cache_bytes", "KV cache bytes held by open sessions")
            g.add_metric([], llm.cache_bytes)
            yield g


# ----------------------------------------------------------------- status

def _span_rows(agent: Agent, llm: Any) -> list[dict[str, Any]]:
    core = agent.core
    if llm is not None:
        rows = getattr(llm, "span_rows", None)
        if rows is not None:  # every span held here (a moving peer: the new one and the draining old one)
            return list(rows())
        return [{"model": llm.model_hash, "start": llm.start, "end": llm.end, "sessions": len(llm.sessions)}]
    return [{"model": sp.model, "start": sp.start, "end": sp.end, "sessions": 0} for sp in getattr(core, "spans", ())]


def _coverage(rows: list[dict[str, Any]], llm: Any) -> list[dict[str, Any]]:
    """Per model: who holds which blocks, and the gaps."""
    models: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        for sp in r["spans"]:
            models.setdefault(sp["model"], []).append(
                {"peer": r["peer"], "start": sp["start"], "end": sp["end"], "throughput": sp["throughput"],
                 "self": r["self"]})
    out = []
    for model, holders in sorted(models.items()):
        layers = None
        name = None
        if llm is not None and llm.model_hash == model:
            layers = int(llm.span.config.num_hidden_layers)
            name = getattr(llm, "model_name", None)
        known = layers is not None
        n = layers if layers is not None else max(h["end"] for h in holders)
        covered = [0] * n
        for h in holders:
            for i in range(max(h["start"], 0), min(h["end"], n)):
                covered[i] += 1
        gaps, i = [], 0
        while i < n:
            if covered[i] == 0:
                j = i
                while j < n and covered[j] == 0:
                    j += 1
                gaps.append([i, j])
                i = j
            else:
                i += 1
        out.append({"model": model, "name": name, "layers": n, "layers_known": known,
                    "holders": sorted(holders, key=lambda h: (h["start"], h["end"], h["peer"])),
                    "replicas": covered, "gaps": gaps})
    return out


def _sessions(llm: Any, now_mono: float) -> list[dict[str, Any]]:
    if llm is None:
        return []
    out = []
    for key, s in list(llm.sessions.items()):
        client = key[0]
        span = [key[2], key[3]] if len(key) == 4 else [llm.start, llm.end]  # (sender, sid, start, end)
        out.append({"model": llm.model_hash, "client": client, "span": span,
                    "length": s.cache.length, "max_length": s.cache.max_length,
                    "idle_s": round(max(now_mono - s.last_used, 0.0), 1), "busy": s.busy})
    return sorted(out, key=lambda x: (x["client"], -x["length"]))


def status_json(agent: Agent, *, llm: Any = None, telemetry: Telemetry | None = None) -> dict[str, Any]:
    core = agent.core
    assert isinstance(core, PeerCore)
    now = agent.now()
    peers = []
    for e in core.view.live(now):
        s = e.state
        mine = e.peer == core.id
        running = [lease.level for lease in core.leases.values() if lease.state == LeaseState.RUNNING]
        slots_busy = (len(s.free_s) - sum(1 for x in s.free_s if x <= 0.0)) if s.free_s else None
        if mine:
            slots_busy = core.busy_slots
        peers.append(
            {
                "peer": e.peer,
                "self": mine,
                "slots": s.slots,
                "slots_busy": slots_busy,
                "devices": [{"kind": d.kind, "name": d.name, "count": d.count, "mem_total": d.mem_total} for d in s.devices],
                "throughput": s.throughput,
                "backlog_s": round(s.backlog_s, 3),
                "power_w": round(s.power.now_w, 2),
                "idle_w": s.power.idle_w,
                "max_w": s.power.max_w,
                "cap_w": s.power.cap_w,
                "level": (max(running) if running else 0.0) if mine else _level(s.power),
                "levels": list(s.power.levels),
                "energy_price": s.energy_price,
                "carbon_g_kwh": s.carbon_g_kwh,
                "trust": s.trust,
                "trusted": e.trusted,
                "region": s.region,
                "spans": [{"model": sp.model, "start": sp.start, "end": sp.end, "throughput": sp.throughput}
                          for sp in s.spans],
                "age_s": round(now - e.issued_at, 3),
                "ttl_s": s.ttl_s,
            }
        )
    leases = [
        {"tenant": k[0], "job_id": k[1], "shard": k[2], "attempt": k[3], "state": lease.state, "run_s": round(lease.run_s, 3),
         "level": lease.level}
        for k, lease in sorted(core.leases.items())
    ]
    spans = _span_rows(agent, llm)
    shares = core.ledger.shares(now)
    boot = getattr(agent, "bootstrap_state", None)
    if callable(boot):
        boot = boot()
    history: dict[str, Any] = {"t": [], "shares": {}, "rho": {}}
    energy: dict[str, float] = {}
    if telemetry is not None:
        hist = list(telemetry.history)
        history["t"] = [round(t - now, 1) for t, _, _ in hist]
        tenants = sorted({t for _, sh, rh in hist for t in (*sh, *rh)})
        for t in tenants:
            history["shares"][t] = [sh.get(t, 0.0) for _, sh, _ in hist]
            history["rho"][t] = [rh.get(t) for _, _, rh in hist]
        energy = {t: round(v, 3) for t, v in sorted(telemetry.energy_j.items())}
    llm_stats = None
    if llm is not None:
        s = llm.stats
        llm_stats = {"requests": s.requests, "errors": s.errors, "tokens": s.tokens, "forwards": s.forwards,
                     "max_batch": s.max_batch, "sessions_opened": s.sessions_opened, "cache_bytes": llm.cache_bytes}
    return {
        "peer": core.id,
        "addrs": agent.transport.listen_addrs(),
        "leaving": core.leaving,
        "now": round(now, 3),
        "version": _version(),
        "peers": peers,
        "leases": leases,
        "results_pending": len(core.outbox),
        "tenant_shares": {t: round(v, 6) for t, v in sorted(shares.items())},
        "tenant_rho": tenant_rho(core, now),
        "energy_j_by_tenant": energy,
        "history": history,
        "spans": spans,
        "span_changes": int(getattr(llm, "span_changes", 0)) if llm is not None else 0,
        "sessions": _sessions(llm, time.monotonic()),
        "llm": llm_stats,
        "models": _coverage(peers, llm),
        "bootstrap": list(boot) if boot else [],
        "messages": {"in": agent.stats.msgs_in, "out": agent.stats.msgs_out, "send_failures": agent.stats.send_failures},
        "stats": dict(sorted(core.stats.items())),
        "rejected": dict(sorted(core.rejected.items())),
    }


# ----------------------------------------------------------------- app

#: Host headers a loopback-bound server answers: a web page elsewhere that
#: rebinds its DNS name to 127.0.0.1 must not read the dashboard
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def make_app(agent: Agent, *, llm: Any = None, event_interval_s: float = 1.0, host: str = "127.0.0.1") -> Any:
    """The Starlette app (also usable on its own, e.g. under a test client).

    Bound to a loopback address (the default), it answers only requests whose
    ``Host`` is a loopback name (others get 400); bound elsewhere (``--http-listen``), any."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    from .dashboard import STATIC_DIR

    registry = CollectorRegistry()
    telemetry = Telemetry(agent, llm, registry)
    registry.register(PeerCollector(agent, telemetry, llm))
    headers = {"Cache-Control": "no-store"}

    def current() -> dict[str, Any]:
        return status_json(agent, llm=llm, telemetry=telemetry)

    async def index(request: Any) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers=headers)

    async def status(request: Any) -> Response:
        return JSONResponse(current(), headers=headers)

    async def metrics(request: Any) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Any) -> Response:
        return PlainTextResponse("ok\n", headers=headers)

    async def events(request: Any) -> Response:
        async def stream() -> Any:
            yield "retry: 2000\n\n"
            last_key: Any = None
            last_sent = -math.inf
            while True:
                core = agent.core
                assert isinstance(core, PeerCore), "the dashboard is a serving peer's"
                key = (core.view.version, len(core.leases), len(core.outbox), core.stats["shards_run"],
                       len(llm.sessions) if llm is not None else 0, len(telemetry.history))
                t = time.monotonic()
                # news goes out at once but at most twice a second (a big
                # swarm's view changes with nearly every gossip message)
                if (key != last_key and t - last_sent >= 0.5 * event_interval_s) or t - last_sent >= event_interval_s:
                    last_key, last_sent = key, t
                    yield f"event: status\ndata: {json.dumps(current(), separators=(',', ':'))}\n\n"
                await trio.sleep(min(0.25, event_interval_s))

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={**headers, "X-Accel-Buffering": "no"})

    middleware = []
    if host in LOOPBACK_NAMES or host.startswith("127."):
        names = [*LOOPBACK_NAMES, "[::1]", host]
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=sorted(set(names))))
    app = Starlette(middleware=middleware, routes=[
        Route("/", index),
        Route("/status", status),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/events", events),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
    ])
    app.state.telemetry = telemetry
    return app


async def _sampler(telemetry: Telemetry) -> None:
    while True:
        telemetry.sample()
        await trio.sleep(HISTORY_EVERY_S)


async def serve_http(port: int, agent: Agent, *, host: str = "127.0.0.1", llm: Any = None,
                     task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the dashboard, ``/status``, ``/events``, ``/metrics`` and
    ``/healthz`` on ``host:port`` until cancelled; ``task_status`` gets the
    bound port (``0`` picks a free one)."""
    from .http import bind_tcp, serve_asgi

    if llm is not None and not hasattr(llm, "sessions"):
        llm = None  # a description dict, not a BlockServer: spans come from the core
    sock = bind_tcp(host, port)
    app = make_app(agent, llm=llm, host=host)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_sampler, app.state.telemetry)
        _, bound = await nursery.start(serve_asgi, app, sock)
        task_status.started(bound)
