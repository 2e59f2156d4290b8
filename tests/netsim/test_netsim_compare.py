"""netsim compare: baselines on the same workload/swarm, determinism, CLI."""

from __future__ import annotations

import json

import pytest

from netsim import dumps_results
from netsim.baselines import BASELINES, BaselineSim, run_baseline
from netsim.cli import main
from netsim.compare import compare, extras
from netsim.scenario import load_scenario
from netsim.sim import Simulator
from netsim.workload import TraceJob

from netsim_helpers import SCENARIOS, make_scenario


def _small(**kw):
    data = dict(
        swarm=[{"profile": "datacenter-a100", "count": 2}, {"profile": "volunteer-gaming", "count": 6}],
        client={"verify": "none"},
        churn={"crash_fraction": 0.25, "crash_window_s": [20, 60]},
    )
    data.update(kw)
    return make_scenario(**data)


JOBS = [
    TraceJob("a0", "a", 0.0, 12, 1, 20.0),
    TraceJob("a1", "a", 5.0, 3, 1, 30.0, kind="chain", deadline_s=400.0),
    TraceJob("b0", "b", 2.0, 2, 8, 15.0),
    TraceJob("c0", "c", 8.0, 4, 1, 10.0, deadline_s=100.0),
]


@pytest.mark.parametrize("policy", BASELINES)
def test_baseline_completes_every_shard_once_under_crashes(policy):
    res = run_baseline(_small(), 3, policy, JOBS)
    s = res["summary"]
    assert s["jobs_completed"] == len(JOBS)
    assert s["shards_completed"] == sum(j.shards for j in JOBS)
    assert s["shards_lost"] == 0 and s["shards_duplicated"] == 0
    assert res["peers"]["crashed"] == 2
    assert s["energy_j"] > s["energy_busy_j"] > 0


def test_baselines_share_the_simulators_churn_and_peers():
    sc = _small()
    b = BaselineSim(sc, 3, "fifo", jobs=JOBS)
    sim = Simulator(sc, 3, jobs=JOBS)
    assert sorted(b.peers) == sim.initial_peers
    b.run()
    sim.run()
    crashed_b = sorted(p for p, r in b.nodes.items() if r.fate == "crashed")
    crashed_s = sorted(p for p, r in sim.nodes.items() if r.fate == "crashed")
    assert crashed_b == crashed_s


def test_baselines_are_deterministic():
    sc = load_scenario(SCENARIOS / "smoke-20.toml")
    for pol in BASELINES:
        a = dumps_results(run_baseline(sc, 5, pol))
        assert a == dumps_results(run_baseline(sc, 5, pol))


def test_message_counts_per_shard():
    sc = _small(churn={})
    # networked: submit, assign, completion (to the scheduler), result (to
    # the client); the centralized scheduler also tells a peer to raise a
    # slowed run while shards wait (at most once per run)
    for pol, lo, hi in (("centralized", 4, 5), ("fifo", 4, 4), ("random", 4, 4), ("sparrow", 6, 8),
                        ("centralized-instant", 3, 4), ("fifo-instant", 3, 3), ("random-instant", 3, 3),
                        ("sparrow-instant", 6, 8)):
        ex = extras(run_baseline(sc, 1, pol, JOBS), JOBS)
        assert lo - 1e-9 <= ex["msgs_per_shard"] <= hi + 1e-9, (pol, ex)


@pytest.mark.parametrize("policy,hops", [("centralized", 7), ("fifo", 7), ("random", 7), ("sparrow", 12)])
def test_networked_baselines_pay_each_hop(policy, hops):
    """One 3-shard chain on a quiet swarm with every link 10 ms and no jitter:
    the networked run takes exactly ``hops`` one-way latencies longer than
    the instant one. Central: submit, then per shard assign and completion
    (the next shard is ready when the scheduler hears), and the last result
    to the client. Sparrow (its scheduler is the client): per shard a probe,
    the late-binding request and reply, and the completion."""
    sc = make_scenario(
        swarm=[{"profile": "datacenter-a100", "count": 3}],
        network={"regions": {"us": 1.0}, "intra_ms": [10, 10], "inter_ms": [10, 10], "jitter_ms": 0, "loss": 0},
        client={"verify": "none"},
    )
    jobs = [TraceJob("c", "a", 0.0, 3, 1, 20.0, kind="chain")]
    net = run_baseline(sc, 1, policy, jobs)
    inst = run_baseline(sc, 1, f"{policy}-instant", jobs)
    assert net["policy"] == policy and inst["policy"] == f"{policy}-instant"
    jn, ji = net["jobs"][0]["jct_s"], inst["jobs"][0]["jct_s"]
    assert jn - ji == pytest.approx(hops * 0.010, abs=1e-9)


def test_networked_centralized_holds_a_slot_until_it_hears():
    """Two 1-GPU shards, one 1-slot peer: the second starts when the
    completion of the first reached the scheduler and the assignment came
    back (two hops after the first ended), not the moment the slot freed."""
    sc = make_scenario(
        swarm=[{"profile": "volunteer-gaming", "count": 1}],
        network={"regions": {"us": 1.0}, "intra_ms": [10, 10], "inter_ms": [10, 10], "jitter_ms": 0, "loss": 0},
        client={"verify": "none"},
    )
    b = BaselineSim(sc, 1, "centralized", jobs=[TraceJob("j", "a", 0.0, 2, 1, 20.0)])
    b.run()
    (s1, e1, _, _), (s2, e2, _, _) = sorted(b.intervals)
    assert s2 - e1 == pytest.approx(0.020, abs=1e-9)
    b = BaselineSim(sc, 1, "centralized-instant", jobs=[TraceJob("j", "a", 0.0, 2, 1, 20.0)])
    b.run()
    (s1, e1, _, _), (s2, e2, _, _) = sorted(b.intervals)
    assert s2 == e1


def test_centralized_is_fair_on_a_quiet_swarm():
    res = run_baseline(_small(churn={}), 1, "centralized", JOBS)
    assert res["summary"]["max_rho"] < 3.0


def test_compare_json_and_cli(tmp_path, capsys):
    sc = load_scenario(SCENARIOS / "smoke-20.toml")
    cmp = compare(sc, 1, ["fedswarm", "centralized"])
    for p in ("fedswarm", "centralized"):
        d = cmp["policies"][p]
        assert {"summary", "deadline_misses", "msgs_per_shard", "p99_jct_s"} <= set(d)
        assert d["summary"]["shards_completed"] == d["summary"]["shards_submitted"]
    # energy over the longest run's length: the shorter run's peers idle on at their floor
    runs = sorted(cmp["policies"].values(), key=lambda d: d["summary"]["sim_time_s"])
    short, long_ = runs[0]["summary"], runs[-1]["summary"]
    assert runs[-1]["energy_horizon_j"] == long_["energy_j"]
    gap = long_["sim_time_s"] - short["sim_time_s"]
    assert runs[0]["energy_horizon_j"] == pytest.approx(short["energy_j"] + short["idle_floor_w"] * gap)
    assert short["idle_floor_w"] > 0
    out = tmp_path / "c.json"
    rc = main(["compare", str(SCENARIOS / "smoke-20.toml"), "--policies", "centralized,sparrow,random,fifo",
               "--seed", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"centralized", "sparrow", "random", "fifo"}
    for name in ("c.png", "c.cdf.png", "c.energy.png", "c.shares.png", "c.messages.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not list(tmp_path.glob("*.csv"))  # no CSV fallback any more
    assert "mean_jct_s" in capsys.readouterr().out
    rc2 = main(["compare", str(SCENARIOS / "smoke-20.toml"), "--policies", "centralized,sparrow,random,fifo",
                "--seed", "2", "--out", str(tmp_path / "d.json")])
    assert rc2 == 0 and (tmp_path / "d.json").read_text() == out.read_text()
    assert main(["compare", str(SCENARIOS / "smoke-20.toml"), "--policies", "nope"]) == 2
