"""``netsim compare``: fedswarm against baseline schedulers on one workload.

Every policy sees the same scenario, seed, swarm, churn and workload.
``fedswarm`` is ``netsim run``; ``fedswarm-race`` is the same with every
peer's ``race_to_idle = true`` (always the top frequency level: the energy
baseline), ``fedswarm-rerun`` the same with ``rerun_room = true`` (a slowed
shard must leave room for a re-run after a crash); the others are ``netsim.baselines``, whose messages cross the
scenario's network (their ``-instant`` variants deliver them at once). The
JSON holds, per policy,
the ``summary`` of ``netsim run`` plus ``deadline_misses``,
``msgs_per_shard``, ``sched_msgs_per_shard``, ``p99_jct_s`` and
``energy_horizon_j`` (energy over the longest run's length: a run that ends
sooner has its peers idle on at ``idle_floor_w`` until then).
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

from .baselines import BASELINES, run_baseline
from .scenario import Scenario
from .sim import Simulator
from .workload import TraceJob

__all__ = ["POLICIES", "run_policy", "compare", "extras", "print_table"]

POLICIES = ("fedswarm", "fedswarm-race", "fedswarm-rerun") + BASELINES
# fedswarm message kinds that are background membership traffic, not scheduling
_BACKGROUND = ("Gossip", "PeerState")


def run_policy(sc: Scenario, seed: int, policy: str, jobs: list[TraceJob] | None = None,
               task: Any = None) -> dict[str, Any]:
    """One policy's results; ``task`` (a ``netsim.progress`` task) is told
    how the run goes (fedswarm: as it runs; baselines: when done)."""
    if policy in BASELINES:
        res = run_baseline(sc, seed, policy, jobs)
        if task is not None:
            task.update(sim_t=res["summary"]["sim_time_s"], events=res["summary"].get("events", 0))
            task.finish()
        return res
    if policy == "fedswarm-race":
        sc = replace(sc, peer_overrides={**sc.peer_overrides, "race_to_idle": True})
    elif policy == "fedswarm-rerun":
        sc = replace(sc, peer_overrides={**sc.peer_overrides, "rerun_room": True})
    elif policy != "fedswarm":
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    from .progress import run_sim

    sim = Simulator(sc, seed, jobs=jobs)
    run_sim(sim, task)
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
    if sc.llm is not None:  # LLM serving sessions: fedswarm against static spans, client-driven hops
        from .llm import compare_llm

        return compare_llm(sc, seed, progress)
    trace = Simulator(sc, seed, jobs=jobs).trace  # the workload every policy gets
    out: dict[str, Any] = {"scenario": sc.name, "seed": seed, "peers": sc.n_peers, "policies": {}}
    for pol in policies:
        # ``progress``: a netsim.progress.Progress (a task per policy), or a
        # callable told each policy's name when it is done
        task = progress.task(pol) if hasattr(progress, "task") else None
        res = run_policy(sc, seed, pol, trace, task)
        ex = extras(res, trace)
        out["policies"][pol] = {
            "summary": res["summary"],
            **ex,
            "jobs": [{k: j[k] for k in ("job_id", "tenant", "jct_s", "rho", "energy_j", "tokens") if k in j}
                     for j in res["jobs"]],
            "tenants": res["tenants"],
            "shares_over_time": res["shares_over_time"],
            "network_by_kind": res["network"]["by_kind"],
        }
        if callable(progress):
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
