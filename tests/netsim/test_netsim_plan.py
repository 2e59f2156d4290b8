"""The plan / loop / report split: a plan is data every policy builds from,
and report() reads only the run record."""

from __future__ import annotations

from netsim import dumps_results
from netsim.baselines import BaselineSim
from netsim.plan import make_plan
from netsim.report import report
from netsim.sim import Simulator
from netsim.workload import TraceJob

from netsim_helpers import make_scenario

JOBS = [
    TraceJob("a0", "a", 0.0, 6, 1, 20.0),
    TraceJob("a1", "a", 5.0, 3, 1, 30.0, kind="chain", deadline_s=400.0),
    TraceJob("b0", "b", 2.0, 2, 2, 15.0),
]


def _scenario(**kw):
    data = dict(
        swarm=[{"profile": "workstation-rtx4090", "count": 6}, {"profile": "volunteer-gaming", "count": 4}],
        client={"verify": "none"},
        churn={"crash_fraction": 0.2, "crash_window_s": [20, 60], "leave_fraction": 0.1,
               "leave_window_s": [10, 40], "join_count": 3, "join_window_s": [5, 50]},
        faults=[{"kind": "slow", "count": 1, "factor": 2.0, "start_s": 10, "end_s": 60}],
    )
    data.update(kw)
    return make_scenario(**data)


def test_one_plan_replays_in_two_simulators():
    """The loop never writes to its plan: two runs from one plan give the
    same bytes as a run that made its own."""
    sc = _scenario()
    plan = make_plan(sc, 4, jobs=JOBS)
    a = Simulator(sc, 4, plan=plan)
    a.run()
    b = Simulator(sc, 4, plan=plan)
    b.run()
    c = Simulator(sc, 4, jobs=JOBS)
    c.run()
    assert dumps_results(a.results()) == dumps_results(b.results()) == dumps_results(c.results())
    assert a.results()["peers"]["joined"] == 3


def test_joining_peers_are_the_plans_in_every_policy():
    """Joins are drawn in the plan (in the order they happen), so fedswarm
    and a baseline see the same joining peers and the same crashes."""
    sc = _scenario()
    plan = make_plan(sc, 2, jobs=JOBS)
    joins = sorted(a[2].id for a in plan.actions if a[1] == "join")
    assert len(joins) == 3
    sim = Simulator(sc, 2, plan=plan)
    sim.run()
    base = BaselineSim(sc, 2, "fifo", jobs=JOBS)
    base.run()
    assert sorted(set(sim.nodes) - set(plan.initial_peers) - set(sim.tenant_of)) == joins
    assert sorted(set(base.nodes) - set(plan.initial_peers)) == joins
    crashed = sorted(p for p, r in sim.nodes.items() if r.fate == "crashed")
    assert crashed == sorted(p for p, r in base.nodes.items() if r.fate == "crashed")
    assert plan.fault_targets[0] and plan.windows[plan.fault_targets[0][0]]


def test_report_reads_the_record_not_the_cores():
    sc = _scenario()
    sim = Simulator(sc, 3, jobs=JOBS)
    sim.run()
    rec = sim.record()
    want = dumps_results(sim.results())
    for node in sim.nodes.values():
        node.core = None  # a report that reached into a core would fail now
    assert dumps_results(report(rec)) == want


def test_a_tenant_names_its_clients_region():
    """``region`` in a tenant's table places its client there; the region is
    still drawn, so the other tenants' clients and every peer stay where
    they were. A region that is not a name is refused."""
    import pytest
    from netsim.scenario import ScenarioError

    def tenants(first_region=None):
        ts = [{"name": n, "jobs": 2, "rate_per_h": 600, "shards": 2, "duration_s": 10} for n in ("a", "b", "c")]
        if first_region is not None:
            ts[0]["region"] = first_region
        return {"tenants": ts}

    net = {"regions": {"us": 0.5, "eu": 0.3, "asia": 0.2}}
    drawn = make_plan(_scenario(workload=tenants(), network=net), 3)
    named = {c.tenant: c.region for c in drawn.clients}
    other = "asia" if named["a"] != "asia" else "eu"
    placed = make_plan(_scenario(workload=tenants(other), network=net), 3)
    assert {c.tenant: c.region for c in placed.clients} == {**named, "a": other}
    assert [(p.id, p.region) for p in placed.peers] == [(p.id, p.region) for p in drawn.peers]
    for bad in ("", 3):
        with pytest.raises(ScenarioError, match="region"):
            _scenario(workload=tenants(bad), network=net)
