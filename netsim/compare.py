"""``netsim compare``: fedswarm against baseline schedulers on one workload.

Every policy sees the same scenario, seed, swarm, churn and workload.
``fedswarm`` is ``netsim run``; ``fedswarm-race`` is the same with every
peer's ``race_to_idle = true`` (always the top frequency level: the energy
baseline); the others are ``netsim.baselines``, whose messages cross the
scenario's network (their ``-instant`` variants deliver them at once). The
JSON holds, per policy,
the ``summary`` of ``netsim run`` plus ``deadline_misses``,
``msgs_per_shard``, ``sched_msgs_per_shard``, ``p99_jct_s`` and
``energy_horizon_j`` (energy over the longest run's length: a run that ends
sooner has its peers idle on at ``idle_floor_w`` until then).
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .baselines import BASELINES, run_baseline
from .scenario import Scenario
from .sim import Simulator
from .workload import TraceJob

__all__ = ["POLICIES", "run_policy", "compare", "extras", "print_table", "write_plot_data"]

POLICIES = ("fedswarm", "fedswarm-race") + BASELINES
# fedswarm message kinds that are background membership traffic, not scheduling
_BACKGROUND = ("Gossip", "PeerState")


def run_policy(sc: Scenario, seed: int, policy: str, jobs: list[TraceJob] | None = None) -> dict[str, Any]:
    if policy in BASELINES:
        return run_baseline(sc, seed, policy, jobs)
    if policy == "fedswarm-race":
        sc = replace(sc, peer_overrides={**sc.peer_overrides, "race_to_idle": True})
    elif policy != "fedswarm":
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    sim = Simulator(sc, seed, jobs=jobs)
    sim.run()
    res = sim.results()
    res["policy"] = policy
    return res


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(int(math.ceil(q * len(xs))) - 1, 0))]


def extras(res: dict[str, Any], trace: list[TraceJob]) -> dict[str, Any]:
    """Deadline misses (finished late or not at all), messages per shard, p99 JCT."""
    deadline = {j.job_id: j.deadline_s for j in trace}
    misses = 0
    for j in res["jobs"]:
        d = deadline.get(j["job_id"])
        if d is None or j["arrival_s"] is None:
            continue
        if not j["finished"] or j["jct_s"] > d + 1e-6:
            misses += 1
    shards = max(res["summary"]["shards_completed"], 1)
    msgs = res["network"]["msgs"]
    sched = msgs - sum(v for k, v in res["network"]["by_kind"].items() if k in _BACKGROUND)
    jcts = [j["jct_s"] for j in res["jobs"] if j["jct_s"] is not None]
    return {
        "deadline_misses": misses,
        "jobs_with_deadline": sum(1 for d in deadline.values() if d is not None),
        "msgs_per_shard": msgs / shards,
        "sched_msgs_per_shard": sched / shards,
        "p99_jct_s": _pct(jcts, 0.99),
    }


def compare(sc: Scenario, seed: int, policies: list[str], jobs: list[TraceJob] | None = None,
            progress: Any = None) -> dict[str, Any]:
    trace = Simulator(sc, seed, jobs=jobs).trace  # the workload every policy gets
    out: dict[str, Any] = {"scenario": sc.name, "seed": seed, "peers": sc.n_peers, "policies": {}}
    for pol in policies:
        res = run_policy(sc, seed, pol, trace)
        ex = extras(res, trace)
        out["policies"][pol] = {
            "summary": res["summary"],
            **ex,
            "jobs": [{k: j[k] for k in ("job_id", "tenant", "jct_s", "rho", "energy_j")} for j in res["jobs"]],
            "tenants": res["tenants"],
            "shares_over_time": res["shares_over_time"],
            "network_by_kind": res["network"]["by_kind"],
        }
        if progress is not None:
            progress(pol)
    # runs end when their last job does; over the longest run's length, the
    # others' peers would have idled on at their idle floor
    horizon = max((p["summary"]["sim_time_s"] for p in out["policies"].values()), default=0.0)
    for p in out["policies"].values():
        s = p["summary"]
        p["energy_horizon_j"] = s["energy_j"] + s["idle_floor_w"] * (horizon - s["sim_time_s"])
    return out


ROWS = (
    ("jobs", lambda p: f"{p['summary']['jobs_completed']}/{p['summary']['jobs_submitted']}"),
    ("mean_jct_s", lambda p: p["summary"]["mean_jct_s"]),
    ("p99_jct_s", lambda p: p["p99_jct_s"]),
    ("max_rho", lambda p: p["summary"]["max_rho"]),
    ("mean_rho", lambda p: p["summary"]["mean_rho"]),
    ("jain", lambda p: p["summary"]["jain_index"]),
    ("energy_MJ", lambda p: p["summary"]["energy_j"] / 1e6),
    ("busy_MJ", lambda p: p["summary"]["energy_busy_j"] / 1e6),
    ("horizon_MJ", lambda p: p["energy_horizon_j"] / 1e6),
    ("carbon_kg", lambda p: p["summary"]["carbon_g"] / 1e3),
    ("dl_miss", lambda p: f"{p['deadline_misses']}/{p['jobs_with_deadline']}"),
    ("msgs/shard", lambda p: p["msgs_per_shard"]),
    ("sched/shard", lambda p: p["sched_msgs_per_shard"]),
    ("lost", lambda p: p["summary"]["shards_lost"]),
)


def _f(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def print_table(cmp: dict[str, Any], out: Any = None) -> None:
    out = out if out is not None else sys.stdout
    pols = list(cmp["policies"])
    w = [max(12, *(len(p) + 1 for p in pols))]
    print(f"{'metric':<12}" + "".join(f"{p:>{w[0]}}" for p in pols), file=out)
    for name, fn in ROWS:
        print(f"{name:<12}" + "".join(f"{_f(fn(cmp['policies'][p])):>{w[0]}}" for p in pols), file=out)


def write_plot_data(cmp: dict[str, Any], json_path: str) -> list[str]:
    """Plot data as CSV next to the JSON (and PNGs if matplotlib is there)."""
    base = Path(json_path)
    stem = base.with_suffix("")
    written = []
    for metric in ("jct_s", "rho"):
        p = Path(f"{stem}.{metric.replace('_s', '')}_cdf.csv")
        with p.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["policy", metric, "cdf"])
            for pol, d in cmp["policies"].items():
                xs = sorted(j[metric] for j in d["jobs"] if j[metric] is not None)
                for i, x in enumerate(xs):
                    w.writerow([pol, f"{x:.6g}", f"{(i + 1) / len(xs):.6g}"])
        written.append(str(p))
    p = Path(f"{stem}.energy.csv")
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "energy_j", "energy_busy_j", "energy_idle_j", "carbon_g"])
        for pol, d in cmp["policies"].items():
            s = d["summary"]
            w.writerow([pol] + [f"{s[k]:.6g}" for k in ("energy_j", "energy_busy_j", "energy_idle_j", "carbon_g")])
    written.append(str(p))
    p = Path(f"{stem}.shares.csv")
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "tenant", "t_s", "share"])
        for pol, d in cmp["policies"].items():
            sot = d["shares_over_time"]
            for t, ys in sorted(sot["tenants"].items()):
                for ts, y in zip(sot["t_s"], ys):
                    w.writerow([pol, t, f"{ts:.6g}", f"{y:.6g}"])
    written.append(str(p))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("netsim: matplotlib is not installed; wrote the plot data as CSV instead: " + ", ".join(written),
              file=sys.stderr)
        return written
    pols = list(cmp["policies"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for ax, metric, label in ((axes[0][0], "jct_s", "job completion time (s)"), (axes[0][1], "rho", "finish-time fairness rho")):
        for pol in pols:
            xs = sorted(max(j[metric], 1e-3) for j in cmp["policies"][pol]["jobs"] if j[metric] is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=pol)
        ax.set_xscale("log")  # heavy tails: a linear axis hides all but the worst policy
        ax.set_xlabel(label + ", log scale")
        ax.set_ylabel("CDF of jobs")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].legend(loc="lower right")
    busy = [cmp["policies"][p]["summary"]["energy_busy_j"] / 1e6 for p in pols]
    idle = [cmp["policies"][p]["summary"]["energy_idle_j"] / 1e6 for p in pols]
    axes[1][0].bar(pols, busy, label="running shards")
    axes[1][0].bar(pols, idle, bottom=busy, label="idle peers until the last job ends")
    axes[1][0].set_ylabel("energy (MJ)")
    axes[1][0].legend(loc="upper left", fontsize="small")
    axes[1][0].tick_params(axis="x", labelrotation=20)
    who = "fedswarm" if "fedswarm" in cmp["policies"] else pols[0]
    d = cmp["policies"][who]["shares_over_time"]
    for t, ys in sorted(d["tenants"].items()):
        axes[1][1].plot(d["t_s"], ys, label=t)
    axes[1][1].set_title(f"{who}: tenants' shares of busy GPU-seconds", fontsize="medium")
    axes[1][1].set_xlabel("time (s)")
    axes[1][1].set_ylabel("share")
    axes[1][1].legend(fontsize="small")
    fig.tight_layout()
    png = f"{stem}.png"
    fig.savefig(png)
    written.append(png)
    return written
