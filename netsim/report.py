"""The results of a run: ``report(record) -> dict``, one function for every policy.

A simulator (``netsim.sim.Simulator`` for fedswarm, ``netsim.baselines``
for the baseline schedulers) hands over a ``RunRecord``: what happened to
each job (``JobRec``) and node (``NodeRun``), the runs that completed or were
wasted, the swarm's capacity and the active tenants over time, the messages
and the fault counters. ``report`` turns it into the results JSON of
``netsim run`` (docs/netsim.md, "Results"): rho and Jain's index, JCTs,
shares over time, energy and carbon, messages per peer-second, and what the
injected faults did. It reads only the record: no core, no event queue.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedswarm.core.runs import Runs
from fedswarm.profiles import Profile

from .stats import StepFn, jain, rho
from .scenario import Scenario
from .workload import TraceJob

__all__ = ["JobRec", "NodeRun", "RunRecord", "report", "open_runs", "MSG_CLASS"]

#: which cost a message kind counts under in the results' message split
MSG_CLASS = {
    "Gossip": "gossip", "PeerState": "gossip",
    "LeaseRenew": "leases", "LeaseAck": "leases", "LeaseRenewBatch": "leases", "LeaseAckBatch": "leases",
}  # everything else (calls for bids, bids, awards, declines, cancels, results and their acks): scheduling


@dataclass(eq=False)
class JobRec:
    """One job of the trace, as the run went."""

    tj: TraceJob
    submit_t: float = 0.0
    submitted: bool = False
    finish_t: float | None = None
    ok: bool | None = None
    delivered: dict[int, int] = field(default_factory=dict)  # shard -> deliveries
    energy_j: float = 0.0
    carbon_g: float = 0.0
    gpu_s: float = 0.0
    delivered_by: dict[int, tuple[str, int]] = field(default_factory=dict)  # shard -> (peer, attempt), first
    holders: dict[int, dict[int, str]] | None = None  # shard -> attempt -> peer (taken before forget)


@dataclass(eq=False)
class NodeRun:
    """One node (peer or client) at the end of a run."""

    id: str
    is_peer: bool
    name: str  # tenant name for clients, profile name for peers
    profile: Profile | None
    started: bool
    start_t: float
    end_t: float | None  # None: up at the end
    fate: str  # live | crashed | left
    hung: bool
    busy_gpu_s: float  # closed run segments (GPU-seconds)
    busy_energy_j: float
    msgs: int
    bytes: int
    #: runs still going at the end, in key order: (start of the segment, gpus, level)
    open_runs: list[tuple[float, int, float]] = field(default_factory=list)
    stats: Mapping[str, int] = field(default_factory=Counter)  # the core's counters
    rejected: Mapping[str, int] = field(default_factory=Counter)
    stale_leases: int = 0  # leases not acknowledged for lease_grace_s + 1 s at the end (live peers)
    fault_ids: list[int] = field(default_factory=list)  # indices into scenario.faults


@dataclass(eq=False)
class RunRecord:
    """What a simulator hands ``report``."""

    scenario: Scenario
    seed: int
    end: float  # the run's last simulated time
    events: int
    jobs: dict[str, JobRec]
    submitted: int  # jobs submitted
    nodes: dict[str, NodeRun]  # the nodes the per-node results cover
    clients: dict[str, NodeRun]  # tenant -> its client
    initial_peers: int
    intervals: list[tuple[float, float, str, int]]  # completed runs: start, end, tenant, gpus
    wasted_gpu_s: float
    capacity: StepFn  # sum(slots x throughput) of live, non-leaving peers
    active_tenants: StepFn
    msgs: int
    bytes: int
    msg_kinds: Counter[str]
    bytes_kinds: Counter[str]
    net_stats: Counter[str]
    holders: dict[str, dict[int, dict[int, str]]] = field(default_factory=dict)  # job -> shard -> attempt -> peer
    fault_targets: list[tuple[str, ...]] = field(default_factory=list)
    fault_stats: Counter[str] = field(default_factory=Counter)
    gc_tenant: dict[str, Counter[str]] = field(default_factory=dict)  # client id -> GC at the peers
    lapsed_at: Counter[str] = field(default_factory=Counter)  # peer id -> lapses the clients saw


def open_runs(runs: Runs) -> list[tuple[float, int, float]]:
    """The runs still going, in key order: (start of the segment, gpus, level)."""
    out = []
    for key in runs:
        run = runs.get(key)
        assert run is not None
        out.append((run.since, run.gpus, run.effect.level))
    return out


def _split(kinds: Counter[str], peer_s: float) -> dict[str, float]:
    """Messages (or bytes) per peer per second, by cost class."""
    out = {"gossip": 0.0, "leases": 0.0, "scheduling": 0.0}
    if peer_s > 0:
        for kind, n in sorted(kinds.items()):
            out[MSG_CLASS.get(kind, "scheduling")] += n / peer_s
    return out


def report(rec: RunRecord) -> dict[str, Any]:
    """The results JSON of a run (before rounding: ``netsim.dumps_results``)."""
    end = rec.end
    sc = rec.scenario
    jobs = rec.jobs
    jobs_out = []
    lost = dup = completed_shards = 0
    per_tenant_rho: dict[str, list[float]] = {}
    per_tenant_jct: dict[str, list[float]] = {}
    for jid in sorted(jobs):
        j = jobs[jid]
        tj = j.tj
        j_lost = j_dup = j_done = 0
        for s in range(tj.shards):
            n = j.delivered.get(s, 0)
            if n == 0:
                j_lost += 1 if j.submitted else 0
            else:
                j_done += 1
                j_dup += n - 1
        lost += j_lost
        dup += j_dup
        completed_shards += j_done
        row: dict[str, Any] = {
            "job_id": jid,
            "tenant": tj.tenant,
            "kind": tj.kind,
            "task": sc.task_of(tj.tenant),
            "shards": tj.shards,
            "gpus_per_shard": tj.gpus_per_shard,
            "work_s": tj.duration_s,
            "arrival_s": j.submit_t - sc.warmup_s if j.submitted else None,
            "finished": j.finish_t is not None and bool(j.ok),
            "shards_delivered": j_done,
            "shards_lost": j_lost,
            "shards_duplicated": j_dup,
            "jct_s": None,
            "rho": None,
            "t_alone_s": None,
            "tenants_avg": None,
            "energy_j": j.energy_j,
            "carbon_g": j.carbon_g,
            "gpu_s": j.gpu_s,
        }
        if j.finish_t is not None and j.ok:
            jct = j.finish_t - j.submit_t
            cap = rec.capacity.mean(j.submit_t, j.finish_t)
            nten = max(rec.active_tenants.mean(j.submit_t, j.finish_t), 1.0)
            r, t_alone = rho(jct, tj.duration_s, tj.shards, tj.gpus_per_shard, tj.chain, cap, nten)
            row.update(jct_s=jct, rho=r, t_alone_s=t_alone, tenants_avg=nten)
            per_tenant_rho.setdefault(tj.tenant, []).append(r)
            per_tenant_jct.setdefault(tj.tenant, []).append(jct)
        jobs_out.append(row)

    tenants = sorted(rec.clients)
    # GPU-seconds per tenant per bucket (completed runs only)
    first = min((jobs[j].submit_t for j in jobs if jobs[j].submitted), default=0.0)
    last = max((j.finish_t for j in jobs.values() if j.finish_t is not None), default=end)
    makespan = max(last - first, 0.0) if jobs else 0.0
    bucket = sc.sample_s if sc.sample_s > 0 else max(makespan / 50.0, 1.0)
    nb = max(int(math.ceil(makespan / bucket)), 1) if makespan > 0 else 0
    grid = {t: [0.0] * nb for t in tenants}
    gpu_s_t = dict.fromkeys(tenants, 0.0)
    for s0, s1, tname, g in rec.intervals:
        if tname in gpu_s_t:
            gpu_s_t[tname] += (s1 - s0) * g
        a, b = s0 - first, s1 - first
        i = max(int(a // bucket), 0)
        while i < nb and i * bucket < b:
            lo, hi = max(a, i * bucket), min(b, (i + 1) * bucket)
            if hi > lo and tname in grid:
                grid[tname][i] += (hi - lo) * g
            i += 1
    shares_t: dict[str, list[float]] = {t: [] for t in tenants}
    window_jain = []
    for i in range(nb):
        tot = sum(grid[t][i] for t in tenants)
        active = [t for t in tenants if grid[t][i] > 0]
        for t in tenants:
            shares_t[t].append(grid[t][i] / tot if tot > 0 else 0.0)
        if len(active) >= 2:
            window_jain.append(jain([grid[t][i] for t in active]))

    mean_rho = {t: sum(v) / len(v) for t, v in per_tenant_rho.items()}
    all_rho = [r for v in per_tenant_rho.values() for r in v]
    all_jct = [x for v in per_tenant_jct.values() for x in v]

    # energy: busy (power(level) * run time * gpus, incl. cancelled runs) + idle GPUs at idle_w
    busy_e = idle_e = carbon = 0.0
    slot_s = busy_s = peer_s = 0.0
    floor_w = 0.0  # idle draw of the peers still up at the end
    fates: Counter[str] = Counter()
    msgs_peers = bytes_peers = 0
    for pid in sorted(rec.nodes):
        nd = rec.nodes[pid]
        if not nd.is_peer or not nd.started:
            continue
        assert nd.profile is not None
        t1 = nd.end_t if nd.end_t is not None else end
        life = max(t1 - nd.start_t, 0.0)
        # runs still going at the end count up to `end`
        for st, gpus, level in nd.open_runs:
            g = max(gpus, 1)
            r_e = nd.profile.power.power(level) * (end - st) * g
            busy_e += r_e
            carbon += r_e / 3.6e6 * nd.profile.carbon_g_kwh
            busy_s += (end - st) * g
        idle = max(nd.profile.slots * life - nd.busy_gpu_s, 0.0) * nd.profile.power.idle_w
        if nd.end_t is None:
            floor_w += nd.profile.slots * nd.profile.power.idle_w
        busy_e += nd.busy_energy_j
        idle_e += idle
        carbon += (nd.busy_energy_j + idle) / 3.6e6 * nd.profile.carbon_g_kwh
        slot_s += nd.profile.slots * life
        busy_s += nd.busy_gpu_s
        peer_s += life
        fates[nd.fate] += 1
        msgs_peers += nd.msgs
        bytes_peers += nd.bytes

    core_stats: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    for pid in sorted(rec.nodes):
        core_stats.update(rec.nodes[pid].stats)
        rejected.update(rec.nodes[pid].rejected)

    summary = {
        "jobs_submitted": rec.submitted,
        "jobs_completed": sum(1 for j in jobs.values() if j.finish_t is not None and j.ok),
        "jobs_failed": sum(1 for j in jobs.values() if j.finish_t is not None and not j.ok),
        "shards_submitted": sum(j.tj.shards for j in jobs.values() if j.submitted),
        "shards_completed": completed_shards,
        "shards_lost": lost,
        "shards_duplicated": dup,
        "jain_index": jain(list(mean_rho.values())),
        "jain_share_index": (sum(window_jain) / len(window_jain)) if window_jain else 1.0,
        "max_rho": max(all_rho) if all_rho else None,
        "mean_rho": (sum(all_rho) / len(all_rho)) if all_rho else None,
        "mean_jct_s": (sum(all_jct) / len(all_jct)) if all_jct else None,
        "makespan_s": makespan,
        "sim_time_s": end,
        "utilization": busy_s / slot_s if slot_s > 0 else 0.0,
        "energy_j": busy_e + idle_e,
        "energy_busy_j": busy_e,
        "energy_idle_j": idle_e,
        "idle_floor_w": floor_w,
        "carbon_g": carbon,
        "wasted_gpu_s": rec.wasted_gpu_s,
        "msgs_per_peer_s": rec.msgs / peer_s if peer_s > 0 else 0.0,
        "bytes_per_peer_s": rec.bytes / peer_s if peer_s > 0 else 0.0,
        "msgs_per_peer_s_split": _split(rec.msg_kinds, peer_s),
        "bytes_per_peer_s_split": _split(rec.bytes_kinds, peer_s),
        "events": rec.events,
    }
    return {
        "scenario": sc.name,
        "seed": rec.seed,
        "summary": summary,
        "jobs": jobs_out,
        "tenants": {
            t: {
                "jobs": sum(1 for j in jobs.values() if j.tj.tenant == t),
                "mean_rho": mean_rho.get(t),
                "max_rho": max(per_tenant_rho[t]) if t in per_tenant_rho else None,
                "mean_jct_s": (sum(per_tenant_jct[t]) / len(per_tenant_jct[t])) if t in per_tenant_jct else None,
                "gpu_s": gpu_s_t[t],
            }
            for t in tenants
        },
        "shares_over_time": {"bucket_s": bucket, "t_s": [i * bucket for i in range(nb)], "tenants": shares_t},
        "peers": {
            "initial": rec.initial_peers,
            "joined": sum(1 for n in rec.nodes.values() if n.is_peer) - rec.initial_peers,
            "crashed": fates["crashed"],
            "left": fates["left"],
            "live_at_end": fates["live"],
            "profiles": dict(sorted(Counter(n.name for n in rec.nodes.values() if n.is_peer).items())),
        },
        "network": {
            "msgs": rec.msgs,
            "bytes": rec.bytes,
            "msgs_by_peers": msgs_peers,
            "bytes_by_peers": bytes_peers,
            "by_kind": dict(sorted(rec.msg_kinds.items())),
            **{k: v for k, v in sorted(rec.net_stats.items())},
        },
        "core_stats": dict(sorted(core_stats.items())),
        "core_rejected": dict(sorted(rejected.items())),
        "faults": _faults(rec),
    }


def _faults(rec: RunRecord) -> dict[str, Any]:
    """What was injected and what it did: shards the targets held and
    that were re-run elsewhere, messages eaten, and the garbage
    collection on both sides (peers: abandoned leases and undeliverable
    results, per node and per tenant; clients: lapsed leases and
    deduplicated results)."""
    sc = rec.scenario
    holders = rec.holders
    tenant_of = {c.id: t for t, c in rec.clients.items()}
    injected = []
    for i, f in enumerate(sc.faults):
        tg = set(rec.fault_targets[i]) if i < len(rec.fault_targets) else set()
        d = f.describe()
        d["targets"] = len(tg)
        if f.kind in ("crash", "hang", "slow"):
            held = rerun = by_targets = reawarded = 0
            rerun_by: dict[str, int] = {}
            for jid, hs in holders.items():
                for shard, att in hs.items():
                    mine = {(p, a) for a, p in att.items() if p in tg}
                    if not mine:
                        continue
                    held += 1
                    if any(p not in tg and a > min(x[1] for x in mine) for a, p in att.items()):
                        reawarded += 1  # a later attempt went to a peer outside the fault
                    got = rec.jobs[jid].delivered_by.get(shard)
                    if got is not None and got not in mine:
                        rerun += 1
                        task = sc.task_of(rec.jobs[jid].tj.tenant)
                        rerun_by[task] = rerun_by.get(task, 0) + 1
                    elif got is not None:
                        by_targets += 1
            d.update(shards_held=held, shards_reawarded=reawarded, shards_rerun=rerun,
                     lapses=sum(rec.lapsed_at[p] for p in tg),
                     shards_rerun_by_task=dict(sorted(rerun_by.items())), shards_delivered_by_targets=by_targets)
        if f.kind == "client-disconnect":
            d["tenants"] = sorted(tenant_of[c] for c in tg)
        injected.append(d)
    nodes: dict[str, Any] = {}
    gc: Counter[str] = Counter()
    stale = 0
    for pid in sorted(rec.nodes):
        n = rec.nodes[pid]
        st = n.stats
        row: dict[str, Any]
        if n.is_peer:
            row = {k: st.get(k, 0) for k in ("leases_abandoned", "results_undelivered", "leases_revoked")
                   if st.get(k, 0)}
            if rec.lapsed_at[pid]:
                row["lapses"] = rec.lapsed_at[pid]
            stale += n.stale_leases
            if n.stale_leases:
                row["stale_leases"] = n.stale_leases
        else:
            row = {k: st.get(k, 0) for k in ("leases_lapsed", "results_duplicate", "renewals_unknown")
                   if st.get(k, 0)}
        for k, v in row.items():
            gc[k] += v
        if row or n.fault_ids:
            row["faults"] = [sc.faults[i].kind for i in n.fault_ids]
            row["role"] = f"client:{n.name}" if not n.is_peer else f"peer:{n.name}"
            row["fate"] = n.fate if n.fate != "live" else ("hung" if n.hung else "live")
            nodes[pid] = row
    tenants = {}
    for tname in sorted(rec.clients):
        c = rec.clients[tname]
        g = rec.gc_tenant.get(c.id, Counter())
        tenants[tname] = {
            "task": sc.task_of(tname),
            "leases_abandoned": g["leases_abandoned"],
            "results_undelivered": g["results_undelivered"],
            "leases_lapsed": c.stats.get("leases_lapsed", 0),
            "results_duplicate": c.stats.get("results_duplicate", 0),
        }
    counts = {k: v for k, v in sorted(rec.fault_stats.items())}
    for k in ("to_hung", "client_offline", "delayed", "partitioned", "lost", "duplicated"):
        counts[f"msgs_{k}"] = rec.net_stats[k]
    return {
        "injected": injected,
        "counts": counts,
        "gc": {k: gc[k] for k in ("leases_abandoned", "results_undelivered", "leases_revoked", "leases_lapsed",
                                  "results_duplicate", "renewals_unknown")} | {"stale_leases_at_end": stale},
        "tenants": tenants,
        "nodes": nodes,
    }
