"""The daemon's HTTP app on hypercorn's trio worker, in process: /healthz,
404s, the /status keys the dashboard reads, /metrics names, /events.

Two peers and a client on the in-memory transport run a small job for real
(wall clock, shards that take a few milliseconds), so the shard histograms,
energy per tenant, shares and the ``self`` row all have something to show.
"""

from __future__ import annotations

import json
import random

import httpx
import trio

from fedswarm.client import JobRequest, open_client
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.events import RunShard, SetSpans, ShardFinished
from fedswarm.core.peer import PeerCore
from fedswarm.core.wire import Span
from fedswarm.daemon.http import serve_http
from fedswarm.daemon.prometheus import OTHER, fold_tenants
from fedswarm.net.memory import MemoryNetwork
from fedswarm.runtime.agent import Agent
from helpers import ident


class QuickRunner:
    async def run_shard(self, eff: RunShard) -> ShardFinished:
        await trio.sleep(0.01)
        return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, True, b"ok", run_s=0.01, energy_j=2.5)


def test_status_healthz_404_metrics_and_events() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        ids = [ident(i, 424) for i in range(2)]
        agents = []
        async with trio.open_nursery() as nursery:
            for i, idn in enumerate(ids):
                core = PeerCore(idn, PeerConfig(bootstrap=(ids[0].peer_id,), renew_interval_s=1.0), random.Random(i))
                agent = Agent(core, net.add(idn), runner=QuickRunner())
                await nursery.start(agent.run)
                agents.append(agent)
            agents[1].feed(SetSpans((Span("m" * 64, 0, 2, 12.5),)))
            port = await nursery.start(serve_http, 0, agents[0])
            assert isinstance(port, int) and port > 0
            cid = ident(900, 424)
            async with open_client(net.add(cid), cid, bootstrap=[ids[0].peer_id], config=ClientConfig(lease_s=4.0),
                                   seed=3) as client:
                await client.wait_for_peers(2, timeout=20)
                outs = await client.run(JobRequest("sim", shards=6, work_s=0.01), timeout=60)
                assert len(outs) == 6
            # the tenant's usage reaches peer 0's ledger by its own shards or by peer 1's gossip
            with trio.fail_after(30):
                while cid.peer_id not in agents[0].core.ledger.shares(agents[0].now()):
                    await trio.sleep(0.05)
            # and peer 1's spans reach peer 0 with its next signed state (a gossip round or two)
            with trio.fail_after(30):
                while not ((e := agents[0].core.view.get(ids[1].peer_id)) and e.state.spans):
                    await trio.sleep(0.05)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                r = await http.get("/healthz")
                assert r.status_code == 200 and r.text.strip() == "ok"
                for bad in ("/nope", "/status/x", "/static/nope.js", "/metricsx"):
                    assert (await http.get(bad)).status_code == 404, bad
                r = await http.post("/status")
                assert r.status_code == 405  # read-only
                # bound to loopback: a page elsewhere that rebinds its DNS name to 127.0.0.1 reads nothing
                r = await http.get("/status", headers={"Host": f"evil.example:{port}"})
                assert r.status_code == 400
                assert (await http.get("/healthz", headers={"Host": f"localhost:{port}"})).status_code == 200
                st = (await http.get("/status")).json()
                for key in ("peer", "addrs", "peers", "leases", "tenant_shares", "stats", "rejected", "spans",
                            "span_changes", "sessions", "bootstrap", "models", "history", "energy_j_by_tenant"):
                    assert key in st, key
                assert st["span_changes"] == 0 and st["sessions"] == [] and st["bootstrap"] == []
                rows = {p["peer"]: p for p in st["peers"]}
                assert set(rows) == set(ids_ := [i.peer_id for i in ids]), ids_
                assert rows[ids[0].peer_id]["self"] is True and rows[ids[1].peer_id]["self"] is False
                for k in ("devices", "throughput", "power_w", "cap_w", "level", "energy_price", "carbon_g_kwh",
                          "trust", "region", "spans", "slots", "backlog_s"):
                    assert k in rows[ids[1].peer_id], k
                assert rows[ids[1].peer_id]["spans"] == [{"model": "m" * 64, "start": 0, "end": 2, "throughput": 12.5}]
                # the model's layer count is unknown to a peer that serves none of it: the strip ends at the
                # last block anyone holds
                (model,) = st["models"]
                assert model["holders"][0]["peer"] == ids[1].peer_id and model["gaps"] == []
                assert cid.peer_id in st["tenant_shares"]
                # every shard that finished here is charged (2.5 J each), also one whose lease had
                # lapsed meanwhile on a loaded machine (it burnt the energy all the same)
                ran_here = agents[0].core.stats["shards_run"]
                charged = st["energy_j_by_tenant"].get(cid.peer_id, 0.0)
                assert charged >= 2.5 * ran_here and (charged / 2.5).is_integer()
                # nothing secret: no key bytes, no membership signature
                text = json.dumps(st)
                assert "membership" not in text and "private" not in text.lower()
                m = (await http.get("/metrics")).text
                for name in ("fedswarm_build_info{", "fedswarm_tenant_share_ratio{", "fedswarm_energy_joules_total{",
                             "fedswarm_bid_latency_seconds_bucket", "fedswarm_shard_run_seconds_bucket",
                             "fedswarm_llm_hop_latency_seconds_bucket", "fedswarm_llm_token_latency_seconds_bucket",
                             "fedswarm_power_watts ", "fedswarm_clock_level_ratio ", "fedswarm_peers_known 2.0"):
                    assert name in m, name
                # the real Prometheus parser reads it all; ratios end in _ratio
                from prometheus_client.parser import text_string_to_metric_families

                fams = {f.name: f for f in text_string_to_metric_families(m)}
                assert fams["fedswarm_bid_latency_seconds"].type == "histogram"
                assert fams["fedswarm_energy_joules"].type == "counter"
                assert all(n.endswith("_ratio") for n in fams if "share" in n or "level" in n or "busy" in n)
                runs = [float(line.split()[1]) for line in m.splitlines()
                        if line.startswith("fedswarm_shard_run_seconds_count ")]
                assert runs == [charged / 2.5]
                page = (await http.get("/")).text
                assert "/static/app.js" in page and "http" not in page.replace("http-equiv", "").split("<body>")[0]
                assert (await http.get("/static/app.js")).status_code == 200
                async with http.stream("GET", "/events") as ev:
                    assert ev.headers["content-type"].startswith("text/event-stream")
                    async for line in ev.aiter_lines():
                        if line.startswith("data: "):
                            assert json.loads(line[6:])["peer"] == ids[0].peer_id
                            break
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_tenant_labels_fold_into_other() -> None:
    shares = {f"t{i}": 1.0 / (i + 1) for i in range(15)}
    folded = fold_tenants(shares, shares, top=10)
    assert len(folded) == 11 and OTHER in folded
    assert set(folded) - {OTHER} == {f"t{i}" for i in range(10)}
    assert abs(sum(folded.values()) - sum(shares.values())) < 1e-9
    assert fold_tenants({"a": 1.0}, {}) == {"a": 1.0}
