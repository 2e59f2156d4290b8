"""The fault matrix (issue 6): every fault scenario against a batch tenant and
an llm-batch tenant, two seeds each; no shard lost or delivered twice, every
job finished, abandoned work garbage-collected, plus each fault's own
signature. Seed 2 runs are marked slow (still part of the full suite)."""

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import json
import math
from dataclasses import replace

import pytest

from netsim import Simulator, dumps_results, load_scenario, run_scenario
from netsim.cli import main
from netsim.faults import FAULT_SCENARIOS, format_matrix, matrix_rows
from netsim.scenario import Fault, ScenarioError
from netsim.sim import NodeRec

from netsim_helpers import SCENARIOS, make_scenario

SEEDS = [1, pytest.param(2, marks=pytest.mark.slow)]
_cache: dict = {}


def result(name, seed):
    if (name, seed) not in _cache:
        _cache[(name, seed)] = run_scenario(load_scenario(SCENARIOS / f"{name}.toml"), seed=seed)
    return _cache[(name, seed)]


def injected(res, kind):
    return [d for d in res["faults"]["injected"] if d["kind"] == kind]


def check_exactly_once(res):
    s = res["summary"]
    assert s["jobs_submitted"] == 16 and s["jobs_completed"] == 16 and s["jobs_failed"] == 0
    assert s["shards_completed"] == s["shards_submitted"] > 0
    assert s["shards_lost"] == 0 and s["shards_duplicated"] == 0
    rows = matrix_rows(res)
    for kind in ("batch", "llm"):  # both job kinds ran and completed
        r = rows[kind]
        assert r["jobs"] == 8 and r["done"] == 8 and r["delivered"] == r["shards"] and r["lost"] == r["dup"] == 0
    assert {j["task"] for j in res["jobs"]} == {"sim", "llm-batch"}
    # garbage collection: no live peer still holds a lease whose client went
    # silent more than lease_grace_s ago
    assert res["faults"]["gc"]["stale_leases_at_end"] == 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", FAULT_SCENARIOS)
def test_fault_matrix_exactly_once(name, seed):
    check_exactly_once(result(name, seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_crash(seed):
    res = result("fault-crash", seed)
    (c,) = injected(res, "crash")
    assert c["targets"] == 8 and res["peers"]["crashed"] == 8
    assert c["shards_held"] > 0 and c["shards_rerun"] > 0 and c["lapses"] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_hang_leases_lapse_and_rerun(seed):
    res = result("fault-hang", seed)
    hangs = injected(res, "hang")
    assert [h["targets"] for h in hangs] == [4, 3, 2]
    f = res["faults"]
    assert f["counts"]["peers_hung"] == 9 and f["counts"]["peers_resumed"] == 7
    assert f["counts"]["msgs_to_hung"] > 0  # connected: messages reach it and are dropped
    # the hung peers' leases lapsed at the clients and their shards were re-run elsewhere
    assert sum(h["lapses"] for h in hangs) > 0
    assert sum(h["shards_rerun"] for h in hangs) > 0
    # two peers never wake up: still hung, holding their leases, at the end
    assert sum(1 for n in f["nodes"].values() if n["fate"] == "hung") == 2


@pytest.mark.parametrize("seed", SEEDS)
def test_slow_jobs_finish_later(seed):
    sc = load_scenario(SCENARIOS / "fault-slow.toml")
    res = result("fault-slow", seed)
    base = run_scenario(replace(sc, faults=()), seed=seed)
    assert [j["job_id"] for j in base["jobs"]] == [j["job_id"] for j in res["jobs"]]  # same workload
    assert res["summary"]["mean_jct_s"] > 1.2 * base["summary"]["mean_jct_s"]
    assert sum(d["shards_delivered_by_targets"] for d in injected(res, "slow")) > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_partition(seed):
    res = result("fault-partition", seed)
    assert res["faults"]["counts"]["msgs_partitioned"] > 0
    assert [d["targets"] for d in injected(res, "partition")] == [12, 24]  # 30% of 40; the asia region


@pytest.mark.parametrize("seed", SEEDS)
def test_messages(seed):
    res = result("fault-messages", seed)
    c = res["faults"]["counts"]
    assert c["msgs_lost"] > 0 and c["msgs_duplicated"] > 0 and c["msgs_delayed"] > 0
    assert res["faults"]["gc"]["results_duplicate"] > 0  # duplicated results were deduplicated


@pytest.mark.parametrize("seed", SEEDS)
def test_client_disconnect_gc(seed):
    res = result("fault-client", seed)
    f = res["faults"]
    assert [d["tenants"] for d in injected(res, "client-disconnect")] == [["batch"], ["llm"]]
    assert f["counts"]["msgs_client_offline"] > 0
    # both outages exceed lease_grace_s (12 s): the peers garbage-collected the
    # work of the vanished client, and every shard was still delivered once
    assert f["gc"]["leases_abandoned"] > 0
    assert all(t["leases_lapsed"] > 0 for t in f["tenants"].values())
    check_exactly_once(res)


def test_fault_run_is_deterministic():
    sc = load_scenario(SCENARIOS / "fault-hang.toml")
    assert dumps_results(run_scenario(sc, seed=1)) == dumps_results(result("fault-hang", 1))


def test_no_faults_same_as_before():
    """A scenario without [[faults]] draws nothing from the fault RNG."""
    sc = load_scenario(SCENARIOS / "smoke-20.toml")
    res = run_scenario(sc, seed=3)
    assert res["faults"]["injected"] == [] and res["faults"]["gc"]["stale_leases_at_end"] == 0


def test_finish_time_integrates_slow_and_hang_windows():
    sim = Simulator(make_scenario(swarm=[{"profile": "workstation-rtx4090", "count": 2}]), seed=1)
    rec = NodeRec("x", None, True, "us")
    assert sim._finish_at(rec, 5.0, 3.0) == 8.0
    rec.windows = ((10.0, 20.0, 0.1),)  # tenfold slower in [10, 20)
    assert sim._finish_at(rec, 0.0, 5.0) == 5.0
    assert sim._finish_at(rec, 8.0, 3.0) == pytest.approx(20.0)  # 2 s of work by t=10, the last 1 s takes 10 s
    assert sim._finish_at(rec, 12.0, 1.0) == pytest.approx(20.0 + 0.2)
    rec.windows = ((10.0, 20.0, 0.0),)  # hung in [10, 20): paused
    assert sim._finish_at(rec, 8.0, 3.0) == pytest.approx(21.0)
    rec.windows = ((10.0, math.inf, 0.0),)  # hung for good
    assert sim._finish_at(rec, 8.0, 3.0) == math.inf
    rec.windows = ((0.0, math.inf, 0.1),)  # permanently slow
    assert sim._finish_at(rec, 1.0, 2.0) == pytest.approx(21.0)


BASE = dict(workload={"tenants": [{"name": "a", "jobs": 1, "rate_per_h": 60, "shards": 1, "duration_s": 1}]})


@pytest.mark.parametrize("fault, msg", [
    ({"kind": "meteor"}, "kind must be one of"),
    ({"kind": "crash", "count": 1, "colour": 1}, "unknown key"),
    ({"kind": "crash"}, "needs fraction or count"),
    ({"kind": "hang", "count": 1, "fraction": 0.1}, "not both"),
    ({"kind": "hang", "count": -1}, "non-negative integer"),
    ({"kind": "hang", "fraction": 1.5}, "probability"),
    ({"kind": "slow", "count": 1, "factor": 0.5}, ">= 1"),
    ({"kind": "slow", "count": 1, "start_s": 50, "end_s": 10}, "end_s"),
    ({"kind": "partition", "start_s": 1}, "needs end_s"),
    ({"kind": "partition", "start_s": 1, "end_s": 2, "fraction": 0.5, "regions": ["us"]}, "not both"),
    ({"kind": "delay", "start_s": 1, "end_s": 2}, "needs delay_s"),
    ({"kind": "delay", "start_s": 1, "end_s": 2, "delay_s": 0}, "> 0"),
    ({"kind": "client-disconnect", "tenant": "zed", "start_s": 1, "end_s": 2}, "no tenant"),
    ({"kind": "client-disconnect", "start_s": 1, "end_s": 2}, "needs tenant"),
    ({"kind": "hang", "count": 1, "start_s": "soon"}, "number"),
])
def test_faults_validated_strictly(fault, msg):
    with pytest.raises(ScenarioError, match=msg):
        make_scenario(faults=[fault], **BASE)


def test_fault_parsing_and_tenant_task():
    sc = make_scenario(faults=[{"kind": "hang", "count": 2, "start_s": 5}, {"kind": "slow", "fraction": 0.5},
                               {"kind": "client-disconnect", "tenant": "a", "start_s": 1, "end_s": 9}],
                       workload={"tenants": [{**BASE["workload"]["tenants"][0], "task": "llm-batch"}]})
    assert sc.faults[0] == Fault("hang", 5.0, math.inf, None, 2)
    assert sc.faults[1].factor == 10.0 and sc.faults[1].end_s == math.inf
    assert sc.task_of("a") == "llm-batch" and sc.task_of("b") == "sim"
    with pytest.raises(ScenarioError, match="task"):
        make_scenario(workload={"tenants": [{**BASE["workload"]["tenants"][0], "task": "gpt"}]})
    with pytest.raises(ScenarioError, match="array"):
        make_scenario(faults={"kind": "crash"}, **BASE)


def test_cli_faults(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["faults", "--only", "fault-crash", "--seeds", "1", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "| crash" in cap.out and "batch" in cap.out and "llm" in cap.out
    m = json.loads(out.read_text())
    assert m["runs"][0]["rows"]["llm"]["lost"] == 0
    assert format_matrix(m).splitlines() == cap.out.splitlines()
