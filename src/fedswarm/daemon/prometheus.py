"""What the daemon measures, and its Prometheus exposition.

``Telemetry`` keeps what happens over time on one daemon beyond the core's
counters (histograms fed by the agent's and block server's observers,
energy per tenant, a short history of shares and rho for the dashboard).
``PeerCollector`` reads the live core at scrape time for ``GET /metrics``
(served by ``fedswarm.daemon.http``). Tenants beyond the ``TOP_TENANTS``
largest shares fold into ``OTHER``, so labels stay bounded.
"""

from __future__ import annotations

import platform
import time
from collections import deque
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..core.peer import LeaseState, PeerCore
from ..runtime.agent import Agent

__all__ = ["Telemetry", "PeerCollector", "fold_tenants", "tenant_rho", "TOP_TENANTS", "OTHER"]

#: tenants labelled by name in /metrics; the rest fold into ``OTHER``
TOP_TENANTS = 10
OTHER = "other"
#: samples of shares / rho kept for the dashboard's sparklines
HISTORY_LEN = 180
HISTORY_EVERY_S = 2.0


def package_version() -> str:
    """The installed fedswarm version, for /status and the build-info metric."""
    try:
        from importlib.metadata import version

        return version("fedswarm")
    except Exception:  # not installed (a source checkout on sys.path)
        return "0+unknown"


def level_from_power(power: Any) -> float:
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
        g.add_metric([package_version(), platform.python_version()], 1)
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
        transport: Any = self.agent.transport
        lanes_live = getattr(transport, "lanes_live", None)
        if lanes_live is not None:
            ts = transport.statistics()
            g = GaugeMetricFamily("fedswarm_lanes", "Direct lanes held now (both directions)")
            g.add_metric([], lanes_live())
            yield g
            c = CounterMetricFamily("fedswarm_lane_requests", "Requests carried on direct lanes",
                                    labels=["direction"])
            c.add_metric(["in"], ts.lane_requests_in)
            c.add_metric(["out"], ts.lane_requests_out)
            yield c
            c = CounterMetricFamily("fedswarm_lane_refusals", "Direct lane connections or frames refused",
                                    labels=["reason"])
            c.add_metric(["no-ticket"], ts.lane_refused)
            c.add_metric(["bad-frame"], ts.lane_failures)
            c.add_metric(["open-failed"], ts.lane_open_failures)
            yield c
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
