"""netsim at scale: 1,000 peers, 10,000 shards, churn on.

Prints wall seconds, simulated seconds, events per second and peak RSS.
Run from the repository root::

    .venv/bin/python benchmarks/netsim_scale.py [--seed S] [--peers N] [--shards M] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from netsim.scenario import parse_scenario  # noqa: E402
from netsim.sim import Simulator  # noqa: E402


def scenario(peers: int, shards: int):
    tenants = 4
    jobs_per_tenant = max(shards // (tenants * 100), 1)
    return parse_scenario(
        {
            "name": "scale",
            "max_time_s": 20000,
            "warmup_s": 20,
            "pubsub_fanout": 32,  # a Publish reaches 32 random nodes (first gossipsub hop)
            "network": {"regions": {"us": 0.4, "eu": 0.4, "asia": 0.2}, "loss": 0.005},
            # gossip every 10 s and renew leases every 10 s: the per-peer message
            # cost dominates at 1,000 peers (see docs/netsim.md, performance)
            "peer": {"gossip_interval_s": 10.0, "state_ttl_s": 120.0, "state_refresh_s": 40.0,
                     "renew_interval_s": 10.0, "lease_grace_s": 60.0},
            "client": {"lease_s": 32.0, "gossip_interval_s": 5.0},
            "swarm": [
                {"profile": "datacenter-a100", "count": 80},
                {"profile": "datacenter-v100", "count": 120},
                {"profile": "workstation-rtx4090", "count": 300},
                {"profile": "volunteer-gaming", "count": 500},
            ],
            "churn": {"crash_fraction": 0.05, "crash_window_s": [40, 200], "leave_fraction": 0.02,
                      "leave_window_s": [40, 200], "leave_grace_s": 30, "join_count": 20, "join_window_s": [30, 150]},
            "workload": {
                "tenants": [
                    {"name": f"tenant{i}", "jobs": jobs_per_tenant, "rate_per_h": 3600 * jobs_per_tenant / 120,
                     "shards": 100, "duration_s": {"dist": "lognormal", "median": 20, "sigma": 0.5, "min": 5, "max": 120},
                     "chain_fraction": 0.0}
                    for i in range(tenants)
                ]
            },
        },
        src="<benchmark>",
        base_dir=REPO,
        profiles_dir=REPO / "peers",
    ).scaled(peers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--max-time", type=float, help="stop at this simulated time (profiling)")
    ap.add_argument("--profile", action="store_true", help="cProfile the run and print the top functions")
    args = ap.parse_args()
    t0 = time.perf_counter()
    sc = scenario(args.peers, args.shards)
    if args.max_time:
        sc.max_time_s = args.max_time
    sim = Simulator(sc, args.seed)
    t_build = time.perf_counter() - t0
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    sim.run()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    s = sim.results()["summary"]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peers={args.peers} shards={s['shards_submitted']} jobs={s['jobs_submitted']}")
    print(f"completed={s['shards_completed']} lost={s['shards_lost']} duplicated={s['shards_duplicated']}")
    print(f"wall_s={wall:.1f} (setup {t_build:.1f}) sim_s={sim.now:.1f} events={sim.events} "
          f"events_per_s={sim.events / wall:.0f} peak_rss_mb={rss_mb:.0f}")
    print(f"makespan_s={s['makespan_s']:.1f} utilization={s['utilization']:.3f} "
          f"msgs_per_peer_s={s['msgs_per_peer_s']:.2f} bytes_per_peer_s={s['bytes_per_peer_s']:.0f}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
