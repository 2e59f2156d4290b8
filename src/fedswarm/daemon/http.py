"""The daemon's HTTP face: a live dashboard, JSON status, Prometheus metrics.

``serve_http(port, agent, host=..., llm=...)`` serves a Starlette app on
hypercorn's trio worker (``fedswarm.net.http.serve_asgi``):

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

import dataclasses
import json
import math
import time
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..core.peer import LeaseState, PeerCore
from ..runtime.agent import Agent
from .prometheus import HISTORY_EVERY_S, PeerCollector, Telemetry, level_from_power, package_version, tenant_rho

__all__ = ["status_json", "make_app", "serve_http"]


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
                "level": (max(running) if running else 0.0) if mine else level_from_power(s.power),
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
        "version": package_version(),
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
        "transport": _transport_stats(agent.transport),
    }


def _transport_stats(transport: Any) -> dict[str, Any]:
    """The transport's counters (libp2p: frames, requests, direct lanes)."""
    stats = getattr(transport, "statistics", None)
    st = stats() if stats is not None else None
    out: dict[str, Any] = dataclasses.asdict(st) if dataclasses.is_dataclass(st) and not isinstance(st, type) else {}
    if hasattr(transport, "lanes_live"):
        out["lanes_live"] = transport.lanes_live()
        out["lane_port"] = transport.lane_port
    return out


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

    from ..dashboard import STATIC_DIR

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
    from ..net.http import bind_tcp, serve_asgi

    if llm is not None and not hasattr(llm, "sessions"):
        llm = None  # a description dict, not a BlockServer: spans come from the core
    sock = bind_tcp(host, port)
    app = make_app(agent, llm=llm, host=host)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_sampler, app.state.telemetry)
        _, bound = await nursery.start(serve_asgi, app, sock)
        task_status.started(bound)
