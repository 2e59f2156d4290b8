"""Prometheus metrics and a JSON status page, served over plain HTTP.

``serve_http(port, agent)`` answers ``GET /metrics`` (Prometheus text format,
from a collector that reads the live core at scrape time, so nothing is
double-booked) and ``GET /status`` (JSON: what the daemon sees: peers with
capacity and power, its leases, tenants' shares). It is a deliberately tiny
HTTP/1.0 responder on trio: one request per connection, bounded reads.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .core.peer import PeerCore
from .runtime.agent import Agent

__all__ = ["PeerCollector", "status_json", "serve_http"]


class PeerCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        core = self.agent.core
        assert isinstance(core, PeerCore)
        now = self.agent.now()
        st = self.agent.stats
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
        c = CounterMetricFamily("fedswarm_rejected", "Inputs rejected by reason", labels=["reason"])
        for reason, n in sorted(core.rejected.items()):
            c.add_metric([reason], n)
        yield c
        g = GaugeMetricFamily("fedswarm_power_watts", "Power draw now (measured or modelled)")
        g.add_metric([], core.now_w)
        yield g
        g = GaugeMetricFamily("fedswarm_backlog_seconds", "Queued and running work per slot")
        g.add_metric([], core.backlog_s)
        yield g
        g = GaugeMetricFamily("fedswarm_tenant_share", "Tenant's share of decayed swarm usage", labels=["tenant"])
        for tenant, share in sorted(core.ledger.shares(now).items()):
            g.add_metric([tenant], share)
        yield g


def status_json(agent: Agent) -> dict[str, Any]:
    core = agent.core
    assert isinstance(core, PeerCore)
    now = agent.now()
    peers = []
    for e in core.view.live(now):
        s = e.state
        peers.append(
            {
                "peer": e.peer,
                "slots": s.slots,
                "devices": [{"kind": d.kind, "name": d.name, "count": d.count, "mem_total": d.mem_total} for d in s.devices],
                "throughput": s.throughput,
                "backlog_s": round(s.backlog_s, 3),
                "power_w": s.power.now_w,
                "max_w": s.power.max_w,
                "cap_w": s.power.cap_w,
                "energy_price": s.energy_price,
                "carbon_g_kwh": s.carbon_g_kwh,
                "trust": s.trust,
                "region": s.region,
                "age_s": round(now - e.issued_at, 3),
            }
        )
    leases = [
        {"tenant": k[0], "job_id": k[1], "shard": k[2], "attempt": k[3], "state": lease.state, "run_s": round(lease.run_s, 3)}
        for k, lease in sorted(core.leases.items())
    ]
    return {
        "peer": core.id,
        "addrs": agent.transport.listen_addrs(),
        "leaving": core.leaving,
        "peers": peers,
        "leases": leases,
        "results_pending": len(core.outbox),
        "tenant_shares": {t: round(v, 6) for t, v in sorted(core.ledger.shares(now).items())},
        "stats": dict(sorted(core.stats.items())),
        "rejected": dict(sorted(core.rejected.items())),
    }


async def _handle(stream: trio.SocketStream, agent: Agent, registry: CollectorRegistry) -> None:
    try:
        with trio.fail_after(5):
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                data += chunk
            line = data.split(b"\r\n", 1)[0].decode("latin-1").split()
            path = line[1] if len(line) >= 2 else "/"
            if path.startswith("/metrics"):
                body, ctype, code = generate_latest(registry), "text/plain; version=0.0.4", "200 OK"
            elif path.startswith("/status"):
                body, ctype, code = json.dumps(status_json(agent), indent=1).encode(), "application/json", "200 OK"
            else:
                body, ctype, code = b"not found\n", "text/plain", "404 Not Found"
            head = f"HTTP/1.0 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            await stream.send_all(head.encode() + body)
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def serve_http(port: int, agent: Agent, *, host: str = "127.0.0.1", task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    registry = CollectorRegistry()
    registry.register(PeerCollector(agent))
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(lambda s: _handle(s, agent, registry), listeners)
