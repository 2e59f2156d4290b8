"""The plan of a run: the swarm, its workload, churn and faults, drawn as data.

``make_plan(scenario, seed)`` makes every seeded draw that does not depend
on how the run goes: the peers' identities, regions and start times, the
clients, the trace, the partitions' sides, the crash/leave/join times (and
the joining peers themselves) and the injected faults' targets and windows.
Every policy's simulator builds from the same plan: ``netsim.sim.Simulator``
drives fedswarm's cores through it, ``netsim.baselines`` its schedulers,
so they see the same swarm, churn and workload.

Randomness: one master ``random.Random(seed)``; every component
(identities, each core, network, churn, placement, workload, faults) gets
its own RNG seeded from it, in a fixed order, and each draws in a fixed
order. What the run itself still draws (the network's per-message delays,
a joining peer's bootstrap peers, which depend on who is alive) comes from
the states the plan hands on (``net_rng_state``, ``churn_rng_state``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from fedswarm.core.identity import Identity
from fedswarm.profiles import Profile

from .network import NetworkModel, Partition
from .scenario import Scenario
from .workload import TraceJob

__all__ = ["Plan", "PeerPlan", "ClientPlan", "Action", "make_plan"]

#: one scheduled action: (time, kind, subject, arg). Kinds: ``start`` (a
#: peer or client id), ``submit`` (a TraceJob), ``crash``/``leave`` (a peer
#: id), ``join`` (a PeerPlan), ``hang``/``resume`` (a peer id; arg: the
#: fault's index). In the order they were drawn: a simulator pushes them in
#: this order, so equal times break ties the same way everywhere.
Action = tuple[float, str, Any, Any]


@dataclass(frozen=True)
class PeerPlan:
    identity: Identity
    profile: Profile
    region: str
    core_seed: int  # seeds the peer core's RNG

    @property
    def id(self) -> str:
        return self.identity.peer_id


@dataclass(frozen=True)
class ClientPlan:
    tenant: str
    identity: Identity
    region: str
    core_seed: int

    @property
    def id(self) -> str:
        return self.identity.peer_id


@dataclass
class Plan:
    scenario: Scenario
    seed: int
    peers: list[PeerPlan]  # the initial swarm, in construction order
    boot: tuple[str, ...]  # the initial peers' bootstrap peers (and the clients')
    clients: list[ClientPlan]  # one per tenant, sorted by tenant
    trace: list[TraceJob]
    actions: list[Action]
    net: NetworkModel  # the scenario's network, its seed and every partition (faults' too)
    part_b: list[frozenset[str] | None]  # per partition: side B's peers (None: by region)
    net_rng_state: Any
    churn_rng_state: Any
    # -- injected faults ([[faults]]) --
    fault_targets: list[tuple[str, ...]] = field(default_factory=list)  # per fault: its targets' ids
    fault_ids: dict[str, list[int]] = field(default_factory=dict)  # node id -> indices into scenario.faults
    windows: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)  # peer: slow/hang
    offline: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)  # client-disconnect
    delay_faults: list[tuple[float, float, float, float, str]] = field(default_factory=list)

    @property
    def initial_peers(self) -> list[str]:
        return sorted(p.id for p in self.peers)


def _identity(rng: random.Random) -> Identity:
    return Identity.from_seed(rng.randbytes(32))


def make_plan(scenario: Scenario, seed: int = 0, *, jobs: list[TraceJob] | None = None) -> Plan:
    """Every draw of a run that does not depend on how it goes (module docstring)."""
    sc = scenario
    master = random.Random(seed)
    id_rng = random.Random(master.getrandbits(64))
    core_rng = random.Random(master.getrandbits(64))
    net_rng = random.Random(master.getrandbits(64))
    churn_rng = random.Random(master.getrandbits(64))
    place_rng = random.Random(master.getrandbits(64))
    work_rng = random.Random(master.getrandbits(64))
    net = replace(sc.network, seed=master.getrandbits(64))
    fault_rng = random.Random(master.getrandbits(64))

    region_names = sorted(sc.regions)
    region_w = [sc.regions[r] for r in region_names]

    def draw_region() -> str:
        return place_rng.choices(region_names, weights=region_w)[0]

    actions: list[Action] = []

    # -- peers: identities and regions, then each one's core seed and start
    drafts: list[tuple[Identity, Profile, str]] = []
    for g in sc.swarm:
        prof = sc.profiles[g.profile]
        for _ in range(g.count):
            idn = _identity(id_rng)
            drafts.append((idn, prof, g.region or prof.region or draw_region()))
    boot = tuple(d[0].peer_id for d in drafts[: max(sc.bootstrap_peers, 1)])
    peers: list[PeerPlan] = []
    for idn, prof, region in drafts:
        p = PeerPlan(idn, prof, region, core_rng.getrandbits(64))
        peers.append(p)
        actions.append((place_rng.uniform(0, sc.warmup_s / 2), "start", p.id, None))
    initial = sorted(p.id for p in peers)

    # -- partitions: side B per partition
    part_b: list[frozenset[str] | None] = []
    for part in net.partitions:
        if part.regions:
            part_b.append(None)
        else:
            ids = list(initial)
            random.Random(churn_rng.getrandbits(64)).shuffle(ids)
            part_b.append(frozenset(ids[: int(round(part.fraction * len(ids)))]))

    # -- workload and tenants
    trace = list(jobs) if jobs is not None else sc.jobs(work_rng)
    clients: list[ClientPlan] = []
    for tname in sorted({j.tenant for j in trace}):
        idn = _identity(id_rng)
        core_seed = core_rng.getrandbits(64)
        drawn = draw_region()  # drawn even where the scenario names the region: the other draws stay put
        c = ClientPlan(tname, idn, sc.tenant_regions.get(tname, drawn), core_seed)
        clients.append(c)
        actions.append((sc.warmup_s / 2, "start", c.id, None))
    seen: set[str] = set()
    for j in trace:
        if j.job_id in seen:
            raise ValueError(f"duplicate job_id {j.job_id!r}")
        seen.add(j.job_id)
        actions.append((sc.warmup_s + j.arrival_s, "submit", j, None))

    # -- churn
    ch = sc.churn
    n0 = len(initial)
    n_crash = int(round(ch.crash_fraction * n0))
    n_leave = int(round(ch.leave_fraction * n0))
    victims = churn_rng.sample(initial, n_crash + n_leave)
    for pid in victims[:n_crash]:
        actions.append((churn_rng.uniform(*ch.crash_window_s), "crash", pid, None))
    for pid in victims[n_crash:]:
        actions.append((churn_rng.uniform(*ch.leave_window_s), "leave", pid, None))
    profs = [sc.profiles[g.profile] for g in sc.swarm]
    weights = [g.count for g in sc.swarm]
    joins: list[tuple[float, Profile, str]] = []
    for _ in range(ch.join_count):
        k = churn_rng.choices(range(len(profs)), weights=weights)[0]
        joins.append((churn_rng.uniform(*ch.join_window_s), profs[k], sc.swarm[k].region))
    # a joining peer's identity, region and core seed, drawn in the order the
    # joins happen (time, then draw order), as a run met them
    order = sorted(range(len(joins)), key=lambda i: joins[i][0])
    joined: dict[int, PeerPlan] = {}
    for i in order:
        _, prof, region = joins[i]
        idn = _identity(id_rng)
        region = region or prof.region or draw_region()
        joined[i] = PeerPlan(idn, prof, region, core_rng.getrandbits(64))
    for i, (t, _, _) in enumerate(joins):
        actions.append((t, "join", joined[i], None))

    plan = Plan(sc, seed, peers, boot, clients, trace, actions, net, part_b,
                net_rng.getstate(), churn_rng.getstate())
    if sc.faults:
        _plan_faults(plan, fault_rng)
    return plan


def _plan_faults(plan: Plan, rng: random.Random) -> None:
    """Turn ``scenario.faults`` into targets, windows and scheduled actions.

    Draws only from the fault RNG (seeded after every older one), so a
    scenario without faults replays exactly as before.
    """
    sc = plan.scenario
    initial = plan.initial_peers
    region = {p.id: p.region for p in plan.peers}
    tenants = {c.tenant: c.id for c in plan.clients}
    n0 = len(initial)
    pool = list(initial)
    rng.shuffle(pool)  # peer faults take disjoint victims from this order
    for i, f in enumerate(sc.faults):
        targets: list[str] = []
        if f.kind in ("crash", "hang", "slow"):
            n = f.count if f.count is not None else int(round((f.fraction or 0.0) * n0))
            n = min(n, len(pool))
            targets, pool = sorted(pool[:n]), pool[n:]
            for pid in targets:
                plan.fault_ids.setdefault(pid, []).append(i)
                if f.kind == "crash":
                    plan.actions.append((rng.uniform(f.start_s, f.end_s), "crash", pid, None))
                elif f.kind == "hang":
                    plan.windows[pid] = plan.windows.get(pid, ()) + ((f.start_s, f.end_s, 0.0),)
                    plan.actions.append((f.start_s, "hang", pid, i))
                    if f.end_s < math.inf:
                        plan.actions.append((f.end_s, "resume", pid, i))
                else:
                    plan.windows[pid] = plan.windows.get(pid, ()) + ((f.start_s, f.end_s, 1.0 / f.factor),)
        elif f.kind == "partition":
            plan.net.partitions = plan.net.partitions + (Partition(f.start_s, f.end_s, f.fraction or 0.0, f.regions),)
            if f.regions:
                plan.part_b.append(None)
                targets = [p for p in initial if region[p] in f.regions]
            else:
                ids = list(initial)
                random.Random(rng.getrandbits(64)).shuffle(ids)
                side = frozenset(ids[: int(round((f.fraction or 0.0) * n0))])
                plan.part_b.append(side)
                targets = sorted(side)
        elif f.kind == "delay":
            plan.delay_faults.append((f.start_s, f.end_s, f.fraction if f.fraction is not None else 1.0,
                                      f.delay_s, f"delay{i}"))
        elif f.kind == "client-disconnect":
            names = sorted(tenants)
            if f.tenant:
                if f.tenant not in tenants:
                    raise ValueError(f"faults[{i}]: no tenant {f.tenant!r} in the workload (have {names})")
                chosen = [f.tenant]
            else:
                n = f.count if f.count is not None else int(round((f.fraction or 0.0) * len(names)))
                chosen = sorted(rng.sample(names, min(n, len(names))))
            for tname in chosen:
                cid = tenants[tname]
                plan.offline[cid] = plan.offline.get(cid, ()) + ((f.start_s, f.end_s),)
                plan.fault_ids.setdefault(cid, []).append(i)
                targets.append(cid)
        plan.fault_targets.append(tuple(targets))
