"""netsim.parallel: a run split into parts, in one process or in several.

What must hold: one part is the unpartitioned run byte for byte; a
partitioned run gives the same bytes whether its parts run in turn in one
process or each in its own (so also on a second run); every shard is still
delivered exactly once; and the scenarios it cannot split are refused."""

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from netsim import dumps_results, load_scenario
from netsim.parallel import Partitioned, PartitionError, lookahead, owner
from netsim.scenario import ScenarioError
from netsim.sim import Simulator
from netsim_helpers import REPO, SCENARIOS, make_scenario

CHURN = {
    "max_time_s": 3600, "warmup_s": 10, "settle_s": 5, "pubsub_fanout": 4,
    "network": {"regions": {"us": 0.5, "eu": 0.5}, "intra_ms": [5, 20], "inter_ms": [50, 150], "loss": 0.01},
    "peer": {"gossip_interval_s": 2.0},
    "swarm": [{"profile": "datacenter-a100", "count": 4}, {"profile": "workstation-rtx4090", "count": 10},
              {"profile": "volunteer-gaming", "count": 10}],
    "churn": {"crash_fraction": 0.1, "crash_window_s": [20, 60], "leave_fraction": 0.1, "leave_window_s": [20, 60],
              "leave_grace_s": 20, "join_count": 4, "join_window_s": [10, 60]},
    "workload": {"task": "sim", "tenants": [
        {"name": "alice", "jobs": 4, "rate_per_h": 360, "shards": 6, "duration_s": 10},
        {"name": "bob", "jobs": 3, "rate_per_h": 360, "shards": 4, "duration_s": 15},
        {"name": "carol", "jobs": 2, "rate_per_h": 360, "shards": 5, "duration_s": 8},
    ]},
}


def churn(**parallel):
    return make_scenario(name="churn-24", **CHURN, **({"parallel": parallel} if parallel else {}))


def run_parts(sc, seed, workers):
    run = Partitioned(sc, seed, workers=workers)
    run.run()
    return dumps_results(run.results())


def summary(text):
    return json.loads(text)["summary"]


def test_one_part_is_the_unpartitioned_run_byte_for_byte():
    for sc, seed in ((load_scenario(SCENARIOS / "smoke-20.toml"), 1), (churn(), 2)):
        plain = Simulator(sc, seed)
        plain.run()
        assert run_parts(sc, seed, 1) == dumps_results(plain.results())


@pytest.mark.parametrize("parallel", [
    {"parts": 2, "first_share": 0.4},  # parts by a hash of the peers' ids
    {"regions": [["eu"], ["us", "asia"]]},  # parts by region
])
def test_parts_give_the_same_bytes_in_one_process_or_several(parallel):
    sc = churn(**parallel)
    together = run_parts(sc, 5, workers=1)
    apart = run_parts(sc, 5, workers=2)
    assert apart == together
    s = summary(apart)
    assert s["shards_lost"] == 0 and s["shards_duplicated"] == 0
    assert s["jobs_completed"] == s["jobs_submitted"] == 9
    plain = Simulator(churn(), 5)
    plain.run()
    ref = plain.results()
    # the same swarm, workload and churn as the unpartitioned run; its own
    # (deterministic) message delays, so not the same bytes
    assert s["shards_submitted"] == ref["summary"]["shards_submitted"]
    peers = json.loads(apart)["peers"]
    assert peers == ref["peers"] and peers["crashed"] > 0 and peers["left"] > 0 and peers["joined"] == 4
    assert apart != dumps_results(ref)


def test_a_part_sees_the_others_churn_and_messages_cross_between_parts():
    sc = churn(parts=2, first_share=0.5)
    run = Partitioned(sc, 3, workers=1)
    p0, p1 = run.local[0], run.local[1]
    run.run()
    mine0 = {pid for pid, r in p0.nodes.items() if not r.remote}
    mine1 = {pid for pid, r in p1.nodes.items() if not r.remote}
    assert mine0 and mine1 and not mine0 & mine1
    assert set(p0.nodes) == set(p1.nodes) == mine0 | mine1  # every node, run in one part
    rec = run.record()
    assert rec.msgs == sum(p.msgs for p in (p0, p1)) and rec.events == p0.events + p1.events
    # peers that crashed or left: the other part's stand-ins for them say so
    gone = [pid for pid, n in rec.nodes.items() if n.fate in ("crashed", "left")]
    assert len(gone) >= 4
    for pid in gone:
        other = p1 if pid in mine0 else p0
        assert other.nodes[pid].remote and not other.nodes[pid].alive
    live = [pid for pid, n in rec.nodes.items() if n.is_peer and n.fate == "live"]
    assert live and all((p1 if pid in mine0 else p0).nodes[pid].alive for pid in live)
    # both parts took messages from the other: the clients (part 0) got results from part 1's peers
    assert any(h for by in rec.holders.values() for sh in by.values() for h in sh.values() if h in mine1)
    assert any(h for by in rec.holders.values() for sh in by.values() for h in sh.values() if h in mine0)


def test_the_lookahead_is_the_least_latency_between_parts():
    assert lookahead(churn(parts=2)) == 0.005  # peers of one region in both parts
    assert lookahead(churn(regions=[["eu"], ["us", "asia"]])) == 0.05  # only region to region
    sc = churn(regions=[["eu"], ["us", "asia"]])
    assert owner("any", True, "eu", sc) == 0 and owner("any", False, "asia", sc) == 1
    with pytest.raises(PartitionError, match="region 'ap'"):
        owner("p", True, "ap", sc)
    hashed = churn(parts=3, first_share=0.2)
    parts = [owner(f"peer{i}", True, "us", hashed) for i in range(3000)]
    assert owner("client", False, "us", hashed) == 0
    assert 450 < parts.count(0) < 750 and 1000 < parts.count(1) < 1400 and 1000 < parts.count(2) < 1400


def test_what_cannot_be_split_is_refused():
    faults = make_scenario(name="f", parallel={"parts": 2}, faults=[{"kind": "crash", "count": 1, "start_s": 5}])
    with pytest.raises(PartitionError, match="faults"):
        Partitioned(faults, 1)
    part = make_scenario(name="p", parallel={"parts": 2},
                         network={"partitions": [{"start_s": 1, "end_s": 2, "fraction": 0.5}]})
    with pytest.raises(PartitionError, match="partitions"):
        Partitioned(part, 1)
    unnamed = churn(regions=[["eu"], ["asia"]])  # the A100 servers are in "us"
    with pytest.raises(PartitionError, match="region 'us'"):
        Partitioned(unnamed, 1, workers=2)
    short = make_scenario(name="s", parallel={"parts": 2}, settle_s=0.001)  # the stop is heard a window late
    with pytest.raises(PartitionError, match="settle_s"):
        Partitioned(short, 1)
    for bad, msg in (({"parts": 0}, "parts"), ({"parts": 2, "first_share": 1.5}, "first_share"),
                     ({"regions": [["eu"], ["eu"]]}, "two parts"), ({"regions": "eu"}, "lists"),
                     ({"parts": 3, "regions": [["eu"], ["us"]]}, "names 2"), ({"workers": 2}, "unknown")):
        with pytest.raises(ScenarioError, match=msg):
            make_scenario(name="b", parallel=bad)


def test_fast_mode_and_real_signatures_give_the_same_partitioned_run():
    sc = replace(load_scenario(SCENARIOS / "smoke-20.toml"), parts=2, part_regions=(("us",), ("eu", "asia")))
    fast = Partitioned(sc, 4, workers=1)
    fast.run()
    slow = Partitioned(sc, 4, workers=1, fast=False)
    slow.run()
    assert dumps_results(slow.results()) == dumps_results(fast.results())


@pytest.mark.slow
def test_netsim_run_splits_a_scenario_over_processes(tmp_path):
    """The command line: ``[parallel]`` in the file, ``--workers`` chooses the
    processes, and the JSON does not depend on it."""
    path = tmp_path / "split.toml"
    path.write_text((SCENARIOS / "leave-20.toml").read_text().replace('name = "leave-20"', 'name = "leave-20-split"', 1)
                    + '\n[parallel]\nregions = [["us"], ["eu", "asia"]]\n')
    outs = []
    for workers in ("2", "1"):
        out = tmp_path / f"w{workers}.json"
        p = subprocess.run([sys.executable, "-m", "netsim", "run", str(path), "--seed", "2", "--out", str(out), "-q",
                            "--profiles", str(REPO / "peers"), "--workers", workers],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
        assert p.returncode == 0, p.stderr
        assert f"parts=2 workers={workers}" in p.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert json.loads(outs[0])["summary"]["shards_lost"] == 0


def test_a_part_that_fails_ends_the_run_with_an_error_not_a_hang(monkeypatch, capfd):
    from netsim import parallel

    real = parallel.PartSim.run_window

    def failing(self, t_end):
        if self.index == 1 and t_end > 30:
            raise ValueError("part 1 broke")
        return real(self, t_end)

    monkeypatch.setattr(parallel.PartSim, "run_window", failing)  # the forked part inherits it
    run = Partitioned(churn(parts=2, first_share=0.5), 1, workers=2)
    with pytest.raises(RuntimeError, match="part 1's process stopped"):
        run.run()
    assert "ValueError: part 1 broke" in capfd.readouterr().err
    assert run.pids == []  # reaped


def test_parts_run_ahead_of_what_they_heard_and_skip_idle_stretches():
    """Windows are a fraction of the lookahead, so a part runs AHEAD windows
    before it hears of the others' (every message still lands in a window
    its receiver has not run: ``PartSim._post`` asserts it); a stretch in
    which no part has anything to do costs a few windows, not one per
    window's length of it."""
    from netsim import parallel

    sc = make_scenario(
        name="sparse", max_time_s=2000, settle_s=5, parallel={"regions": [["eu"], ["us", "asia"]]},
        network={"regions": {"us": 0.5, "eu": 0.5}},
        peer={"gossip_interval_s": 10.0},
        swarm=[{"profile": "datacenter-a100", "count": 2}, {"profile": "workstation-rtx4090", "count": 2}],
        workload={"task": "sim", "tenants": [
            {"name": "late", "jobs": 1, "rate_per_h": 3600, "start_s": 600, "shards": 3, "duration_s": 10,
             "region": "eu"}]})
    run = Partitioned(sc, 1, workers=2)
    run.run()
    s = run.results()["summary"]
    assert s["jobs_completed"] == 1 and s["shards_lost"] == 0 and s["shards_duplicated"] == 0
    window = parallel.lookahead(sc) / (parallel.AHEAD + 1)
    assert run.now > 600
    assert 10 < run.windows < 0.1 * run.now / window  # ~4 windows per gossip round, not 80 per second
    assert run.windows <= (parallel.AHEAD + 1) * run.events + 1


def test_rings_smaller_than_a_frame_neither_stall_nor_change_the_run(monkeypatch):
    """With slots of a few hundred bytes every frame spans many of them and
    both parts' rings fill at once: a writer waiting for room takes in what
    the other part writes meanwhile, so neither waits on the other forever,
    and the bytes are those of the run in one process."""
    from netsim import parallel

    monkeypatch.setattr(parallel, "_SLOT", 4096)  # 8 slots of about 500 bytes
    sc = churn(regions=[["eu"], ["us", "asia"]])
    assert run_parts(sc, 5, workers=2) == run_parts(sc, 5, workers=1)
