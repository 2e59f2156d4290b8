"""netsim at scale: 1,000, 3,000 and 10,000 peers, ten shards per peer, churn on.

The swarm and workload are ``netsim/scenarios/scale-10k.toml`` (5% crashes,
2% graceful leaves, joins, 0.5% loss, 4 tenants submitting jobs of 100
shards within 120 s), scaled to each size: the profile mix and joins by
``Scenario.scaled``, the jobs per tenant so that there are ten shards per
peer (``--shards`` overrides). Each size runs in its own process, one after
the other, so that its peak RSS is its own. Prints, per size: wall seconds,
simulated seconds, events, events per second, peak RSS, messages per peer
per second (and split into gossip, leases and scheduling), CPU seconds
(steadier than wall time on a shared box), shards lost / duplicated, and
whether the core ran compiled (``scripts/build_native.py``). ``--kinds``
also prints, per size, how long the cores took over each kind of input
(``netsim.timing``: every message kind, polls, finished shards), with the
same events and results (in one process, unsplit).

scale-10k is split into two parts by region, one process each
(``netsim.parallel``); ``--split one`` runs each size unsplit in one
process, and ``--split both`` runs each size both ways, one after the
other, and prints the ratios. A split run's CPU seconds and peak RSS are
both processes'. Run from the repository root::

    .venv/bin/python benchmarks/netsim_scale.py [--peers 1000 3000 10000] [--seed S] [--shards M]
        [--max-time T] [--profile] [--kinds] [--split scenario|one|both]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fedswarm.core  # noqa: E402
from netsim import hugepages  # noqa: E402
from netsim.scenario import load_scenario  # noqa: E402
from netsim.parallel import Partitioned  # noqa: E402
from netsim.sim import Simulator  # noqa: E402
from netsim.timing import TimedSimulator, format_table  # noqa: E402

SCENARIO = REPO / "netsim" / "scenarios" / "scale-10k.toml"
ARRIVALS_S = 120.0  # every job arrives within this


def scenario(peers: int, shards: int | None = None):
    """scale-10k scaled to ``peers`` with ``shards`` shards (default: 10 per peer)."""
    sc = load_scenario(SCENARIO).scaled(peers)
    tenants = len(sc.tenants)
    per = int(sc.tenants[0]["shards"])
    jobs = max((shards if shards is not None else 10 * peers) // (tenants * per), 1)
    ts = [{**t, "jobs": jobs, "rate_per_h": 3600 * jobs / ARRIVALS_S} for t in sc.tenants]
    return replace(sc, tenants=ts)


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (a split run's
    other parts): on a shared box, steadier than wall time."""
    ru, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime


def _peak_rss_mb() -> int:
    """This process's peak RSS plus the largest of its children's (a split
    run of two parts: the sum of both processes' peaks)."""
    ru, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return round((ru.ru_maxrss + ch.ru_maxrss) / 1024)


def run_one(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    sc = scenario(args.peers[0], args.shards)
    if args.max_time:
        sc.max_time_s = args.max_time
    if args.split == "one" or args.kinds or args.profile:  # the stopwatch and cProfile see one process
        sc = replace(sc, parts=1, part_regions=())
    if sc.parts > 1:
        sim: Any = Partitioned(sc, args.seed, workers=sc.parts)
    else:
        sim = TimedSimulator(sc, args.seed) if args.kinds else Simulator(sc, args.seed)
    t_build = time.perf_counter() - t0
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    t_run = time.perf_counter()
    sim.run()
    t_run = time.perf_counter() - t_run
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    s = sim.results()["summary"]
    split = s.get("msgs_per_peer_s_split", {})
    out = {
        "peers": args.peers[0], "shards": s["shards_submitted"], "jobs": s["jobs_submitted"],
        "completed": s["shards_completed"], "lost": s["shards_lost"], "duplicated": s["shards_duplicated"],
        "wall_s": round(wall, 1), "setup_s": round(t_build, 1), "sim_s": round(sim.now, 1), "events": sim.events,
        "events_per_s": round(sim.events / wall), "cpu_s": round(_cpu_s(), 1),
        "peak_rss_mb": _peak_rss_mb(), "parts": sc.parts,
        "makespan_s": s["makespan_s"], "msgs_per_peer_s": s["msgs_per_peer_s"], "split": split,
        "bytes_per_peer_s": s["bytes_per_peer_s"], "native": fedswarm.core.NATIVE,
        "huge_pages": hugepages.status(),
    }
    if isinstance(sim, TimedSimulator):
        out["kinds"] = format_table(sim.timing, t_run)
        out["run_s"] = round(t_run, 1)
    if prof:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peers", type=int, nargs="+", default=[1000, 3000, 10_000])
    ap.add_argument("--shards", type=int, help="shards in all (default: 10 per peer)")
    ap.add_argument("--max-time", type=float, help="stop at this simulated time (profiling)")
    ap.add_argument("--profile", action="store_true", help="cProfile the run and print the top functions")
    ap.add_argument("--kinds", action="store_true",
                    help="time the cores by input kind (netsim.timing) and print a table per size")
    ap.add_argument("--split", choices=("scenario", "one", "both"), default="scenario",
                    help="scenario: split into parts as scale-10k's [parallel] table says (two parts, one process "
                         "each); one: one process, unsplit; both: each size both ways, one after the other, "
                         "with the ratio (default: scenario)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one size, in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    rows = []
    ways = ("one", "scenario") if args.split == "both" else (args.split,)
    for n, way in ((n, w) for n in args.peers for w in ways):
        cmd = [sys.executable, __file__, "--one", "--peers", str(n), "--seed", str(args.seed), "--split", way]
        for flag, v in (("--shards", args.shards), ("--max-time", args.max_time)):
            if v is not None:
                cmd += [flag, str(v)]
        for flag in ("profile", "kinds"):
            if getattr(args, flag):
                cmd.append("--" + flag)
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if res.returncode:
            print(f"peers={n}: exit {res.returncode}", file=sys.stderr)
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"peers={r['peers']} parts={r['parts']} shards={r['shards']} jobs={r['jobs']} completed={r['completed']} "
              f"lost={r['lost']} duplicated={r['duplicated']} wall_s={r['wall_s']} sim_s={r['sim_s']} "
              f"events={r['events']} events_per_s={r['events_per_s']} cpu_s={r['cpu_s']} peak_rss_mb={r['peak_rss_mb']} "
              f"msgs_per_peer_s={r['msgs_per_peer_s']:.3f} native_core={r['native']} huge_pages={r['huge_pages']}", flush=True)
        if "kinds" in r:
            print(f"\nThe cores' time by input, {r['peers']:,} peers (the run's {r['run_s']} s, set-up left out):\n")
            print(r["kinds"] + "\n", flush=True)
    if not rows:
        sys.exit(1)
    print()
    print("| peers | parts | shards | wall s | CPU s | sim s | events | events/s | peak RSS MB "
          "| msgs/peer/s (gossip, leases, sched.) | lost/dup | compiled core | huge pages |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["split"]
        parts = ", ".join(f"{sp[k]:.3f}" for k in ("gossip", "leases", "scheduling") if k in sp)
        print(f"| {r['peers']:,} | {r['parts']} | {r['shards']:,} | {r['wall_s']} | {r['cpu_s']} | {r['sim_s']} | "
              f"{r['events']:,} | "
              f"{r['events_per_s']:,} | {r['peak_rss_mb']:,} | {r['msgs_per_peer_s']:.3f} ({parts}) | "
              f"{r['lost']}/{r['duplicated']} | {'yes' if r['native'] else 'no'} | {r['huge_pages']} |")
    pairs = [(a, b) for a in rows for b in rows if a["peers"] == b["peers"] and a["parts"] == 1 < b["parts"]]
    if pairs:
        print()
        print("| peers | wall, split / one | CPU, split / one |")
        print("|---|---|---|")
        for a, b in pairs:
            print(f"| {a['peers']:,} | {b['wall_s'] / a['wall_s']:.2f} | {b['cpu_s'] / a['cpu_s']:.2f} |")
    if any(r["lost"] or r["duplicated"] for r in rows if not args.max_time):
        sys.exit(1)


if __name__ == "__main__":
    main()
