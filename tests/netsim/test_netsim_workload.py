import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import random

import pytest

from netsim.workload import TraceError, generate, read_trace, write_trace

FULL = """job_id,tenant,arrival_s,shards,gpus_per_shard,duration_s,deadline_s,weight,kind
j1,alice,0,4,1,30,,1,bag
j2,bob,5.5,3,2,60,600,2.0,chain
"""
MIN = """tenant,job_id,arrival_s,shards,gpus_per_shard,duration_s
alice,a,10,2,1,5
alice,b,1,1,1,7.5
"""


def test_full_columns(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(FULL)
    j1, j2 = read_trace(f)
    assert (j1.job_id, j1.tenant, j1.shards, j1.gpus_per_shard, j1.duration_s, j1.deadline_s, j1.chain) == (
        "j1", "alice", 4, 1, 30.0, None, False)
    assert (j2.arrival_s, j2.deadline_s, j2.weight, j2.kind, j2.chain) == (5.5, 600.0, 2.0, "chain", True)


def test_required_only_sorted_by_arrival(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(MIN)
    jobs = read_trace(f)
    assert [j.job_id for j in jobs] == ["b", "a"]
    assert all(j.kind == "bag" and j.weight == 1.0 and j.deadline_s is None for j in jobs)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("job_id,tenant,arrival_s,shards,duration_s\nj,a,0,1,1\n", "missing required column.*gpus_per_shard"),
        (MIN + "alice,c,3,two,1,5\n", r":4: column 'shards'.*not an integer"),
        (MIN + "alice,c,3,0,1,5\n", "must be > 0"),
        (MIN + "alice,a,3,1,1,5\n", "duplicate job_id"),
        (MIN + "alice,c,3,1,1\n", "expected 6 fields"),
        (FULL + "j3,a,0,1,1,5,,1,swarm\n", "kind"),
        (MIN.replace("duration_s", "duration_s,colour") .replace("5\n", "5,red\n").replace("7.5\n", "7.5,b\n"), "unknown column"),
        ("", "empty trace"),
    ],
)
def test_malformed(tmp_path, text, msg):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(TraceError, match=msg):
        read_trace(f)


def test_generate_deterministic_and_roundtrip(tmp_path):
    tenants = [
        {"name": "a", "jobs": 20, "rate_per_h": 60, "shards": {"dist": "pareto", "xm": 2, "alpha": 1.5, "max": 50},
         "duration_s": {"dist": "lognormal", "median": 30, "sigma": 1}, "chain_fraction": 0.5, "chain_max_shards": 3,
         "deadline_factor": 3},
        {"name": "b", "jobs": 5, "rate_per_h": 10, "shards": 4, "duration_s": {"dist": "uniform", "lo": 1, "hi": 2}},
    ]
    a = generate(tenants, random.Random(7))
    assert a == generate(tenants, random.Random(7))
    assert a != generate(tenants, random.Random(8))
    assert len(a) == 25 and [j.arrival_s for j in a] == sorted(j.arrival_s for j in a)
    assert all(j.shards <= 3 for j in a if j.chain)
    f = tmp_path / "g.csv"
    write_trace(f, a)
    assert read_trace(f) == a
    with pytest.raises(TraceError, match="unknown key"):
        generate([{**tenants[1], "colour": 1}], random.Random(0))
